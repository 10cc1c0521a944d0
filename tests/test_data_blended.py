"""Blended pretraining corpora (data.data_path) through megatron-core's dataset builder."""

from pathlib import Path

import numpy as np
import pytest
import yaml
from trainer_fixtures import make_model_dir, rewind, run_train, steps, write_indexed

from hpc_mca.config.loading import load_config
from hpc_mca.config.sections import ConfigError
from hpc_mca.data.addition import DEMO_DIR
from hpc_mca.data.blended import BlendedSamples
from hpc_mca.data.dataset import build_datasets, train_dataloader
from hpc_mca.data.sampler import DataSampler


def _build_datasets(config, **kwargs):
    """build_datasets with the data section and the view the config gives the pipeline."""
    return build_datasets(config.data, config.data_run(), **kwargs)


def _corpora(root: Path) -> tuple[Path, Path]:
    """Corpus A holds token ids 10-19 only, corpus B 20-29: a sample tells its corpus."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    prefixes = []
    for name, low in (("a", 10), ("b", 20)):
        docs = [rng.integers(low, low + 10, size=int(rng.integers(5, 40))).tolist()
                for _ in range(150)]
        write_indexed(root / name, docs)
        prefixes.append(root / name)
    return prefixes[0], prefixes[1]


def _config(root: Path, *overrides: str):
    a, b = _corpora(root)
    return load_config(None, [
        f"model_name_or_path={DEMO_DIR}", f"output_dir={root / 'out'}", "stage=pt",
        f"data.data_path=0.7 {a} 0.3 {b}", "cutoff_len=16", "per_device_train_batch_size=2",
        "global_batch_size=8", "max_steps=125", *overrides]).resolve(world_size=1)


def _corpus(ids: np.ndarray) -> str:
    assert ids.min() >= 10 and ids.max() < 30, ids
    assert (ids < 20).all() or (ids >= 20).all(), ids  # a sample never mixes corpora
    return "a" if ids[0] < 20 else "b"


def test_blend_draws_each_corpus_in_its_weight(tmp_path):
    data = _build_datasets(_config(tmp_path))
    samples = data.train.samples
    assert isinstance(samples, BlendedSamples) and len(data.train) >= 1000
    assert data.eval is None
    drawn = [_corpus(samples.sample(i)[0]) for i in range(1000)]
    share_a = drawn.count("a") / 1000
    assert abs(share_a - 0.7) <= 0.01, share_a
    assert [samples.corpus_of(i) for i in range(20)] == [int(d == "b") for d in drawn[:20]]
    row = data.train[0]  # rows are full: seq_length inputs, shifted labels, all trained
    assert row["input_ids"].shape == (16,) and bool(row["loss_mask"].all())
    assert row["labels"][:-1].tolist() == row["input_ids"][1:].tolist()
    assert row["position_ids"].tolist() == list(range(16))
    # The index is cached next to the run; a second build reads it and gives the same blend.
    cache = tmp_path / "out" / "megatron_indices"
    assert sorted(p.name.split("-", 1)[1] for p in cache.glob("*BlendedDataset-train-*")) == [
        "BlendedDataset-train-dataset_index.npy",
        "BlendedDataset-train-dataset_sample_index.npy", "BlendedDataset-train-description.txt"]
    again = _build_datasets(_config(tmp_path / "again")).train.samples
    assert all((again.sample(i)[0] == samples.sample(i)[0]).all() for i in range(50))


def test_split_holds_out_documents_for_evaluation(tmp_path):
    data = _build_datasets(_config(tmp_path, "data.split=90,10,0", "val_size=40"))
    assert data.eval is not None and len(data.eval) >= 40
    drawn = [_corpus(data.eval.samples.sample(i)[0]) for i in range(len(data.eval))]
    assert 0.6 <= drawn.count("a") / len(drawn) <= 0.8


def test_resumed_loader_continues_the_uninterrupted_order(tmp_path):
    config = _config(tmp_path)
    rows = _build_datasets(config).train

    def tokens(loader, batches):
        out = []
        for _, batch in zip(range(batches), loader):
            out.append(batch.input_ids.numpy().copy())
        return np.concatenate(out)

    whole = tokens(train_dataloader(rows, config.data_run(), data_parallel_rank=0), 20)
    resumed_rows = _build_datasets(config).train  # a fresh process: rebuilt from the cache
    resumed = tokens(train_dataloader(resumed_rows, config.data_run(), data_parallel_rank=0,
                                      consumed_samples=24), 8)
    assert np.array_equal(resumed, whole[24:40])
    # The order is the sampler's contract over the blend: global sample k is known directly.
    sampler = DataSampler(len(rows), micro_batch_size=2, global_batch_size=8, seed=config.training.seed)
    assert [rows.samples.corpus_of(i) for i in sampler.global_indices(24, 16)] == [
        int(_corpus(ids) == "b") for ids in resumed]


@pytest.mark.parametrize("override, message", [
    ("data.data_path=0.7 {a} 0.3 {missing}", "data.data_path: no Megatron .bin/.idx pair at "),
    ("data.data_path=0.7 {a} 0.3", "has 3 entries, not weight/prefix pairs"),
    ("data.data_path=0.7 {a} -0.3 {b}", "weight -0.3 of "),
    ("data.data_path=0 {a} 1 {b}", "weight 0.0 of "),
    ("stage=sft", "data.data_path with finetuning.stage='sft'"),
    ("dataset={a}.bin", "data.data_path and data.dataset are both set; valid: one of them"),
    ("data.split=0,1,0", "data.split='0,1,0' leaves no training documents"),
])
def test_bad_blend_input_is_one_line(tmp_path, override, message):
    a, b = _corpora(tmp_path)
    text = override.format(a=a, b=b, missing=tmp_path / "missing")
    with pytest.raises(Exception) as caught:
        config = load_config(None, [
            f"model_name_or_path={DEMO_DIR}", f"output_dir={tmp_path / 'out'}", "stage=pt",
            f"data.data_path=0.7 {a} 0.3 {b}", "cutoff_len=16", "max_steps=5",
            "per_device_train_batch_size=2", text]).resolve(world_size=1)
        _build_datasets(config)
    line = str(caught.value)
    assert message in line and "\n" not in line, line
    if "missing" in override:
        assert isinstance(caught.value, ConfigError) and str(tmp_path / "missing") in line


def _blend_config(root, model_dir, a, b, **training):
    """A pt run on the 0.7/0.3 blend of corpora ``a`` and ``b``; ``training`` adds settings."""
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"model_name_or_path": str(model_dir)},
        "data": {"data_path": [0.7, str(a), 0.3, str(b)], "cutoff_len": 16},
        "finetuning": {"stage": "pt"},
        "training": {"per_device_train_batch_size": 2, "global_batch_size": 4,
                     "learning_rate": 1e-3, "logging_steps": 1, "seed": 7, **training}}))
    return config


@pytest.mark.slow
def test_a_blended_pt_run_resumes_with_the_same_data(tmp_path):
    """6 steps straight vs. 3 steps, a checkpoint, and a resume: same losses and token counts
    (the data order of the resumed half is that of the uninterrupted run)."""
    a, b = _corpora(tmp_path)
    model_dir = make_model_dir(tmp_path, layers=2)
    config = _blend_config(tmp_path, model_dir, a, b, max_steps=6, save_steps=3)
    whole = tmp_path / "whole"
    proc = run_train(config, whole, 1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = steps(whole)
    assert [s["step"] for s in reference] == [1, 2, 3, 4, 5, 6]
    resumed = rewind(whole, tmp_path / "resumed", 3)
    proc = run_train(config, resumed, 1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "at step 3" in proc.stdout, proc.stdout[-2000:]
    again = {s["step"]: s for s in steps(resumed)}
    for want in reference[3:]:
        mine = again[want["step"]]
        assert mine["tokens"] == want["tokens"]
        assert mine["loss"] == pytest.approx(want["loss"], abs=1e-6), (mine, want)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["true", "false"])
def test_a_blended_run_on_two_ranks_equals_one(tmp_path, backend):
    """DP2 (rank 0 builds the blend and its index cache, rank 1 reads them) trains the same
    losses as one process, on either backend."""
    a, b = _corpora(tmp_path)
    model_dir = make_model_dir(tmp_path, layers=2)
    config = _blend_config(tmp_path, model_dir, a, b, max_steps=4, use_mca=backend == "true",
                           report_to=["none"])
    runs = {}
    for nproc in (1, 2):
        proc = run_train(config, tmp_path / f"np{nproc}", nproc)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[nproc] = steps(tmp_path / f"np{nproc}")
    for one, two in zip(runs[1], runs[2]):
        assert one["tokens"] == two["tokens"]
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-5), (one, two)
