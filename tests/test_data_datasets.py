"""HF datasets reading, LLaMA-Factory's dataset_dir + dataset_info.json, mixing several datasets."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest

from hpc_mca.config.loading import load_config
from hpc_mca.config.sections import ConfigError
from hpc_mca.data.addition import DEMO_DIR
from hpc_mca.data.dataset import build_datasets
from hpc_mca.data.errors import DataError
from hpc_mca.data.mix import mix_order
from hpc_mca.data.records import read_records

N = 24


def _build_datasets(config, **kwargs):
    """build_datasets with the data section and the view the config gives the pipeline."""
    return build_datasets(config.data, config.data_run(), **kwargs)


def _config(tmp_path: Path, *overrides: str, stage: str = "sft"):
    return load_config(None, [
        f"model_name_or_path={DEMO_DIR}", f"output_dir={tmp_path / 'out'}",
        f"preprocessing_cache_dir={tmp_path / 'cache'}", "cutoff_len=48", "seq_length=48",
        "per_device_train_batch_size=1", "max_steps=2", f"stage={stage}",
        *overrides]).resolve(world_size=1)


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


def _samples(data) -> list[tuple[list[int], list[int]]]:
    samples = data.train.samples
    return [tuple(a.tolist() for a in samples.sample(i)) for i in range(len(samples))]


def _alpaca(i: int) -> dict:
    return {"instruction": f"add {i} and {i}", "input": f"{i}+{i}", "output": str(2 * i),
            "system": "be exact"}


def _turns(i: int, user: str, bot: str, role: str = "from", content: str = "value") -> list:
    return [{role: user, content: f"what is {i}+1"}, {role: bot, content: str(i + 1)}]


def _pair(i: int) -> dict:
    return {"instruction": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)}


@pytest.fixture
def lf_dir(tmp_path: Path) -> Path:
    """A LLaMA-Factory dataset_dir: custom alpaca columns, custom sharegpt tags, a ranking set."""
    root = tmp_path / "lf"
    root.mkdir()
    _jsonl(root / "alpaca.jsonl", [{"q": r["instruction"], "extra": r["input"], "a": r["output"],
                                    "sys": r["system"]} for r in map(_alpaca, range(N))])
    _jsonl(root / "chat.jsonl", [{"dialog": _turns(i, "me", "bot", "speaker", "text")}
                                 for i in range(N)])
    _jsonl(root / "pairs.jsonl", [{"prompt_text": p["instruction"], "good": p["chosen"],
                                   "bad": p["rejected"]} for p in map(_pair, range(N))])
    info = {
        "my_alpaca": {"file_name": "alpaca.jsonl", "columns": {
            "prompt": "q", "query": "extra", "response": "a", "system": "sys"}},
        "my_chat": {"file_name": "chat.jsonl", "formatting": "sharegpt",
                    "columns": {"messages": "dialog"},
                    "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "me",
                             "assistant_tag": "bot"}},
        "my_pairs": {"file_name": "pairs.jsonl", "ranking": True, "columns": {
            "prompt": "prompt_text", "chosen": "good", "rejected": "bad"}},
    }
    (root / "dataset_info.json").write_text(json.dumps(info))
    return root


@pytest.fixture
def direct(tmp_path: Path) -> dict[str, Path]:
    """The same data as lf_dir, in the default column names, given by path."""
    return {
        "alpaca": _jsonl(tmp_path / "alpaca.jsonl", [_alpaca(i) for i in range(N)]),
        "chat": _jsonl(tmp_path / "chat.jsonl",
                       [{"conversations": _turns(i, "human", "gpt")} for i in range(N)]),
        "pairs": _jsonl(tmp_path / "pairs.jsonl", [_pair(i) for i in range(N)]),
    }


@pytest.mark.parametrize("name, path, stage", [("my_alpaca", "alpaca", "sft"),
                                               ("my_chat", "chat", "sft"),
                                               ("my_pairs", "pairs", "dpo")])
def test_dataset_info_reads_like_the_direct_path(tmp_path, lf_dir, direct, name, path, stage):
    by_name = _build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}", f"dataset={name}",
                                     stage=stage))
    by_path = _build_datasets(_config(tmp_path, f"dataset={direct[path]}", stage=stage))
    expected = _samples(by_path)
    assert len(expected) == N * (2 if stage == "dpo" else 1)
    assert _samples(by_name) == expected  # same token ids and labels, sample by sample
    assert by_name.train.samples.lengths.sum() == by_path.train.samples.lengths.sum()


def test_interleave_under_hits_its_probabilities():
    source, index = mix_order([10_000, 10_000], "interleave_under", [0.7, 0.3], seed=1234)
    share = np.bincount(source[:10_000], minlength=2) / 10_000
    assert abs(share[0] - 0.7) < 0.02 and abs(share[1] - 0.3) < 0.02
    for k in range(2):  # each dataset is drawn in its own order, none twice
        assert np.array_equal(index[source == k], np.arange((source == k).sum()))
    over, _ = mix_order([10, 30], "interleave_over", [0.5, 0.5], seed=0)
    assert (over == 1).sum() >= 30  # over-sampling repeats the short set until all are seen


def test_mixed_training_data_follows_the_drawn_order(tmp_path, lf_dir, direct):
    config = _config(tmp_path, f"dataset={direct['alpaca']},{direct['chat']}",
                     "mix_strategy=interleave_under", "interleave_probs=0.7,0.3")
    mixed = _samples(_build_datasets(config))
    parts = [_samples(_build_datasets(_config(tmp_path, f"dataset={direct[k]}")))
             for k in ("alpaca", "chat")]
    source, index = mix_order([N, N], "interleave_under", [0.7, 0.3], config.training.seed)
    assert mixed == [parts[s][i] for s, i in zip(source, index)]
    assert 0 < (source == 1).sum() < (source == 0).sum() == N


def test_other_file_types_read_the_same_records(tmp_path, direct):
    import datasets

    jsonl = [r.data for r in read_records(direct["alpaca"])]
    table = datasets.Dataset.from_list(jsonl)
    table.save_to_disk(str(tmp_path / "saved"))
    table.to_csv(str(tmp_path / "a.csv"), index=False)
    table.to_parquet(str(tmp_path / "a.parquet"))
    (tmp_path / "dir").mkdir()
    table.to_parquet(str(tmp_path / "dir" / "part-0.parquet"))
    for path in ("saved", "a.csv", "a.parquet", "dir"):
        assert [r.data for r in read_records(tmp_path / path)] == jsonl, path
    assert next(read_records(tmp_path / "a.csv")).where == f"{tmp_path / 'a.csv'}:row 1"


@pytest.mark.parametrize("overrides, message", [
    (["dataset=nope"], "data.dataset: dataset 'nope' is not in {info}; valid: my_alpaca, "
                       "my_chat, my_pairs"),
    (["dataset=my_alpaca", "eval_dataset=gone"], "data.eval_dataset: dataset 'gone' is not in"),
])
def test_unknown_dataset_name_is_one_line(tmp_path, lf_dir, overrides, message):
    with pytest.raises(DataError) as err:
        _build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}", *overrides))
    assert message.format(info=lf_dir / "dataset_info.json") in _one_line(err)


def test_an_unknown_name_among_many_gets_its_closest_not_the_list(tmp_path, lf_dir):
    info = json.loads((lf_dir / "dataset_info.json").read_text())
    info.update({f"corpus_{i:03d}": {"file_name": "alpaca.jsonl"} for i in range(120)})
    (lf_dir / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(DataError) as err:
        _build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}", "dataset=my_alpacca"))
    assert _one_line(err).endswith("; did you mean 'my_alpaca'?")
    with pytest.raises(DataError) as err:
        _build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}", "dataset=identity"))
    assert _one_line(err).endswith("; valid: one of its 123 names (none is close to this one)")


def _with_entry(lf_dir: Path, **keys) -> None:
    info = json.loads((lf_dir / "dataset_info.json").read_text())
    info["my_alpaca"].update(keys)
    (lf_dir / "dataset_info.json").write_text(json.dumps(info))


@pytest.mark.parametrize("keys, message", [
    ({"formating": "sharegpt"}, "unknown key 'formating'; did you mean 'formatting'?"),
    ({"split": "test"}, "split='test'; a local file has one split; valid: train"),
    ({"num_samples": 0}, "num_samples=0 must be a positive integer"),
])
def test_entry_keys_are_read_or_refused(tmp_path, lf_dir, keys, message):
    _with_entry(lf_dir, **keys)
    with pytest.raises(DataError) as err:
        _build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}", "dataset=my_alpaca"))
    assert message in _one_line(err)


def test_hub_entries_read_their_local_file_or_are_refused(tmp_path, lf_dir):
    # Issue #39: an entry with a hub source and a local file_name is read from the file (jobs
    # run offline); subset and folder are ignored for a local file, as LLaMA-Factory does.
    local = _samples(_build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}", "dataset=my_alpaca")))
    _with_entry(lf_dir, hf_hub_url="org/data", subset="main", folder="data")
    hub = _samples(_build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}", "dataset=my_alpaca")))
    assert hub == local
    info = json.loads((lf_dir / "dataset_info.json").read_text())
    info["my_alpaca"] = {"hf_hub_url": "org/data"}
    (lf_dir / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(DataError) as err:
        _build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}", "dataset=my_alpaca"))
    assert "has hf_hub_url: hub, script and cloud entries are not read" in _one_line(err)


def test_num_samples_draws_that_many_records_with_the_seed(tmp_path, lf_dir):
    everything = _samples(_build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}",
                                                 "dataset=my_alpaca")))
    _with_entry(lf_dir, num_samples=5, split="train")
    five = _samples(_build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}",
                                           "dataset=my_alpaca")))
    order = np.random.RandomState(42).permutation(N)[:5]  # training.seed's default
    assert five == [everything[i] for i in order]
    again = _samples(_build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}",
                                            "dataset=my_alpaca", "seed=8")))
    assert len(again) == 5 and again != five
    _with_entry(lf_dir, num_samples=N + 3)  # more than the file has: all once, then repeats
    more = _samples(_build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}",
                                           "dataset=my_alpaca")))
    assert len(more) == N + 3 and sorted(set(map(str, more))) == sorted(map(str, everything))
    cut = _samples(_build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}",
                                          "dataset=my_alpaca", "max_samples=2")))
    assert cut == more[:2]  # max_samples cuts what num_samples drew


def test_missing_column_and_missing_info_are_one_line(tmp_path, lf_dir):
    info = json.loads((lf_dir / "dataset_info.json").read_text())
    info["my_alpaca"]["columns"]["response"] = "answer"
    (lf_dir / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(DataError) as err:
        _build_datasets(_config(tmp_path, f"dataset_dir={lf_dir}", "dataset=my_alpaca"))
    assert _one_line(err) == (f"data.dataset: dataset 'my_alpaca' column response='answer' is "
                              f"not in {lf_dir / 'alpaca.jsonl'}; its columns: q, extra, a, sys")
    with pytest.raises(DataError) as err:
        _build_datasets(_config(tmp_path, f"dataset_dir={tmp_path}", "dataset=my_alpaca"))
    assert _one_line(err) == f"data.dataset_dir={str(tmp_path)!r} has no dataset_info.json"


@pytest.mark.parametrize("overrides, message", [
    (["dataset=a.jsonl,b.jsonl", "mix_strategy=interleave_under", "interleave_probs=0.5"],
     "data.interleave_probs has 1 values for 2 datasets"),
    (["dataset=a.jsonl,b.jsonl", "mix_strategy=interleave_over", "interleave_probs=0.5,0.6"],
     "data.interleave_probs=[0.5, 0.6] must be non-negative and sum to 1 (they sum to 1.1)"),
    (["dataset=a.jsonl", "mix_strategy=shuffle"],
     "data.mix_strategy='shuffle' is not valid; valid: concat, interleave_under, interleave_over"),
    (["dataset=a.jsonl,b.jsonl", "interleave_probs=0.5,0.5"],
     "data.interleave_probs needs data.mix_strategy interleave_under or interleave_over"),
])
def test_bad_mix_settings_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, *overrides)
    assert message in _one_line(err)


def test_no_network_and_hub_names_refused(tmp_path, direct, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    data = _build_datasets(_config(tmp_path, f"dataset={direct['chat']}"))
    assert len(data.train.samples) == N
    with pytest.raises(DataError) as err:
        _build_datasets(_config(tmp_path, "dataset=tatsu-lab/alpaca"))
    assert _one_line(err) == ("data.dataset: 'tatsu-lab/alpaca' is not a local path; datasets "
                              "are read from local files or directories only (nothing is "
                              "downloaded): download it first and give its path")
