"""hpc_mca.data.dataset end to end: config -> rows -> per-rank loaders; indexed corpora."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_fixtures import write_indexed

from hpc_mca.config.loading import load_config
from hpc_mca.data.addition import DEMO_DIR
from hpc_mca.data.dataset import build_datasets, check_eval_rows, eval_dataloader, train_dataloader
from hpc_mca.data.errors import DataError
from hpc_mca.data.store import IndexedSamples


def _build_datasets(config, **kwargs):
    """build_datasets with the data section and the view the config gives the pipeline."""
    return build_datasets(config.data, config.data_run(), **kwargs)


def _config(tmp_path: Path, *overrides: str):
    return load_config(None, [
        f"model_name_or_path={DEMO_DIR}", f"output_dir={tmp_path / 'out'}",
        f"preprocessing_cache_dir={tmp_path / 'cache'}", "cutoff_len=16", "seq_length=32",
        "per_device_train_batch_size=2", "max_steps=10", *overrides]).resolve(world_size=2)


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def sft_file(tmp_path: Path) -> Path:
    return _write(tmp_path / "sft.jsonl", [{"instruction": f"{i}+{i}=", "output": str(2 * i)}
                                           for i in range(40)])


@pytest.mark.parametrize("packing", [False, True])
def test_sft_rows_and_rank_loaders(tmp_path: Path, sft_file: Path, packing: bool):
    config = _config(tmp_path, f"dataset={sft_file}", f"sequence_packing={packing}",
                     "val_size=0.1")
    data = _build_datasets(config)
    assert len(data.eval.samples) == 4 and len(data.train.samples) == 36
    assert (len(data.train) < 36) == packing
    batches = [next(iter(train_dataloader(data.train, config.data_run(), data_parallel_rank=r)))
               for r in range(2)]
    for batch in batches:
        assert batch.input_ids.shape == (2, 32)
        assert batch.packed == packing and (batch.cu_seqlens is not None) == packing
    run = config.data_run()
    fresh = list(itertools.islice(train_dataloader(data.train, run, data_parallel_rank=0), 3))
    resumed = list(itertools.islice(train_dataloader(data.train, run, data_parallel_rank=0,
                                                     consumed_samples=4), 2))
    for a, b in zip(fresh[1:], resumed):  # 4 = one micro-step of 2 rows on each of 2 ranks
        assert torch.equal(a.input_ids, b.input_ids)
    evaluation = list(eval_dataloader(data.eval, _config(
        tmp_path, f"dataset={sft_file}", "val_size=0.1", "per_device_eval_batch_size=1"
    ).data_run(), data_parallel_rank=1))
    assert len(evaluation) == len(data.eval) // 2
    assert "train: 36 samples" in data.describe()


def test_eval_rows_short_of_one_evaluation_step_are_one_line(tmp_path: Path, sft_file: Path):
    """4 eval rows, 2 data-parallel ranks of 4: the line says which batch size would do."""
    config = _config(tmp_path, f"dataset={sft_file}", "val_size=0.1",
                     "per_device_eval_batch_size=4")
    data = _build_datasets(config)  # both backends check the rows once built (tests/test_standard.py)
    with pytest.raises(DataError) as err:
        check_eval_rows(data.eval, config.data_run())
    assert str(err.value) == (
        "the eval data has 4 rows, fewer than one evaluation step of "
        "training.per_device_eval_batch_size=4 × data-parallel size 2 = 8 rows; valid: "
        "training.per_device_eval_batch_size at most 2, or more eval data")
    with pytest.raises(DataError, match="the eval data has 4 rows"):
        eval_dataloader(data.eval, config.data_run(), data_parallel_rank=0)
    check_eval_rows(data.eval, _config(tmp_path, f"dataset={sft_file}", "val_size=0.1",
                                       "per_device_eval_batch_size=2").data_run())  # 4 rows: one step


def test_missing_dataset_file_fails_before_training(tmp_path: Path, sft_file: Path):
    config = _config(tmp_path, f"dataset={sft_file},{tmp_path / 'gone.jsonl'}")
    with pytest.raises(DataError) as err:
        _build_datasets(config)
    assert str(err.value) == (f"data.dataset: dataset file '{tmp_path / 'gone.jsonl'}' "
                              "does not exist")
    assert not (tmp_path / "cache").exists()  # nothing was tokenized


def test_pt_text_documents(tmp_path: Path):
    path = _write(tmp_path / "pt.jsonl", [{"body": "hello world " * 5}, {"body": "bye"}])
    config = _config(tmp_path, "stage=pt", f"dataset={path}", "text_field=body",
                     "pt_chunking=document", "sequence_packing=true")
    data = _build_datasets(config)
    tok = data.tokenizer
    samples = [data.train.samples.sample(i) for i in range(len(data.train.samples))]
    assert [len(ids) for ids, _ in samples] == [16, 16, 16, 12, 3]
    assert tok.decode(samples[-1][1].tolist()) == "ye<|end|>"
    row = data.train[0]
    assert row["loss_mask"].sum() > 0 and "cu_seqlens" in row


def test_indexed_corpus_concat_and_document(tmp_path: Path):
    docs = [list(range(10, 17)), list(range(20, 23)), list(range(30, 40))]
    write_indexed(tmp_path / "corpus", docs)
    stream = sum(docs, [])
    concat = IndexedSamples(str(tmp_path / "corpus"), 4, "concat")
    labels = np.concatenate([concat.sample(i)[1] for i in range(len(concat))])
    assert labels.tolist() == stream[1:]
    assert concat.sample(1)[0].tolist() == [14, 15, 16, 20]  # across a document boundary
    document = IndexedSamples(str(tmp_path / "corpus"), 4, "document")
    assert [document.sample(i)[0].tolist() for i in range(len(document))] == [
        [10, 11, 12, 13], [14, 15], [20, 21], [30, 31, 32, 33], [34, 35, 36, 37], [38]]
    assert document.lengths.tolist() == [4, 2, 2, 4, 4, 1]


def test_indexed_corpus_through_the_config(tmp_path: Path):
    write_indexed(tmp_path / "corpus", [list(range(3, 40))] * 4)
    config = _config(tmp_path, "stage=pt", f"dataset={tmp_path / 'corpus'}",
                     "sequence_packing=false")
    data = _build_datasets(config)
    assert len(data.train) == len(data.train.samples) == -(-(4 * 37 - 1) // 16)
    with pytest.raises(DataError, match="no Megatron .bin/.idx pair"):
        _build_datasets(_config(tmp_path, "stage=pt", "dataset_format=indexed",
                               f"dataset={tmp_path / 'nothing'}"))


def test_token_ids_beyond_the_model_vocabulary_are_bad_input(tmp_path: Path, sft_file: Path):
    """A tokenizer larger than the model (or a corpus tokenized for another model): one line
    naming the file, the sample and the id, before training (tokenized files) or when the
    sample is read (indexed corpora, too large to scan at every start)."""
    config = _config(tmp_path, f"dataset={sft_file}")
    top = int(_build_datasets(config).train.samples.input_ids.max())
    assert _build_datasets(config, vocab_size=top + 1).train is not None
    with pytest.raises(DataError) as err:
        _build_datasets(config, vocab_size=top)
    assert str(err.value).startswith(f"data.dataset: {sft_file}: token id {top} (first in "
                                     "sample ")
    assert str(err.value).endswith(f"not below the model's vocab_size {top}; valid: the "
                                   "model's tokenizer (tokenizer_name_or_path)")
    write_indexed(tmp_path / "corpus", [list(range(3, 12)), [5, 6, 700, 8]])
    corpus = IndexedSamples(str(tmp_path / "corpus"), 4, "document", vocab_size=500)
    assert corpus.sample(0)[0].tolist() == [3, 4, 5, 6]
    with pytest.raises(DataError, match=r"corpus: token id 700 in sample 2 \(tokens 9\.\.12 "
                                        r"of the corpus\) is not below the model's vocab_size 500"):
        corpus.sample(2)
