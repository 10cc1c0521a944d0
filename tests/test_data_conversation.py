"""The data pipeline reads and tokenizes as LLaMA-Factory does (issue #39): samples are kept when
cut, invalid conversations are dropped and counted, named templates fix the tokenizer, tool
calls and .txt corpora are read, and several tokenizing processes give the serial result.
Sample-for-sample equality with LLaMA-Factory itself is tests/test_lf_parity.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpc_mca.config.loading import load_config
from hpc_mca.data.addition import DEMO_DIR, alpaca_record, make_problems
from hpc_mca.data.arguments import DataArguments
from hpc_mca.data.dataset import build_datasets, load_samples
from hpc_mca.data.errors import DataError
from hpc_mca.data.templates import TEMPLATE_NAMES
from hpc_mca.data.tokenize import IGNORE_INDEX, load_tokenizer

TOOLS = json.dumps([{"name": "add", "description": "Add two numbers",
                     "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}])
GLAIVE = {"conversations": [
    {"from": "human", "value": "add 2 and 3"},
    {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}})},
    {"from": "observation", "value": "5"}, {"from": "gpt", "value": "it is 5"}], "tools": TOOLS}


def _one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _build(tmp_path: Path, *overrides: str, stage: str = "sft"):
    config = load_config(None, [
        f"model_name_or_path={DEMO_DIR}", f"output_dir={tmp_path / 'out'}",
        f"preprocessing_cache_dir={tmp_path / 'cache'}", "seq_length=256",
        # kto's KL rows pair the examples of a micro-step: it needs two
        f"per_device_train_batch_size={2 if stage == 'kto' else 1}", "max_steps=2", f"stage={stage}",
        *overrides]).resolve(world_size=1)
    return build_datasets(config.data, config.data_run())


def _samples(store) -> list[tuple[list[int], list[int]]]:
    return [tuple(a.tolist() for a in store.sample(i)) for i in range(len(store))]


def _data(tmp_path: Path, **fields) -> DataArguments:
    return DataArguments(preprocessing_cache_dir=str(tmp_path / "cache"), **fields)


def test_prompts_that_fill_cutoff_len_are_kept_and_counted(tmp_path):
    """Before issue #39 a prompt that filled cutoff_len dropped its sample; LLaMA-Factory's
    rule keeps the answer (under half the budget) and cuts the prompt."""
    records = [alpaca_record(a, b) for a, b in make_problems(6, seed=1)]
    records[0]["instruction"] = "a long question " * 8
    path = _jsonl(tmp_path / "sft.jsonl", records)
    data = _build(tmp_path, f"dataset={path}", "cutoff_len=32")
    assert len(data.train.samples) == 6
    assert "truncated 1" in data.describe() and "dropped 0" in data.describe()
    ids, labels = data.train.samples.sample(0)
    assert len(ids) == 31  # cutoff_len tokens before the shift, as LLaMA-Factory counts
    tokenizer = data.tokenizer
    answer = records[0]["output"]
    assert tokenizer.decode(labels[labels != IGNORE_INDEX].tolist()) == answer + "<|end|>"


def test_invalid_conversations_are_dropped_and_counted(tmp_path):
    turns = [{"from": "human", "value": "1+1"}, {"from": "gpt", "value": "2"}]
    path = _jsonl(tmp_path / "chat.jsonl", [
        {"conversations": turns}, {"conversations": turns[:1]}, {"conversations": turns[::-1]}])
    data = _build(tmp_path, f"dataset={path}", "cutoff_len=64")
    assert len(data.train.samples) == 1
    assert "invalid 2" in data.describe()


def test_mask_history_trains_the_last_answer_and_enters_the_cache_key(tmp_path):
    turns = [{"from": "human", "value": "1+1"}, {"from": "gpt", "value": "two"},
             {"from": "human", "value": "2+2"}, {"from": "gpt", "value": "four"}]
    path = _jsonl(tmp_path / "chat.jsonl", [{"conversations": turns}])
    tokenizer = load_tokenizer(DEMO_DIR)

    def trained(**fields) -> str:
        store = load_samples(str(path), tokenizer, _data(tmp_path, cutoff_len=256, template="qwen", **fields), "sft")
        _, labels = store.sample(0)
        return tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())

    assert trained() == "two<|im_end|>\nfour<|im_end|>\n"
    assert trained(mask_history=True) == "four<|im_end|>\n"  # same cache dir: a new key
    # The last turn takes the budget first (the default system prompt alone is longer than 90).
    store = load_samples(str(path), tokenizer, _data(tmp_path, cutoff_len=90, template="qwen", mask_history=True),
                         "sft")
    _, labels = store.sample(0)
    assert store.stats["truncated"] == 1
    assert tokenizer.decode(labels[labels != IGNORE_INDEX].tolist()) == "four<|im_end|>\n"


def test_preprocessing_num_workers_gives_the_serial_samples(tmp_path):
    records = [alpaca_record(a, b) for a, b in make_problems(41, seed=3)]
    path = _jsonl(tmp_path / "sft.jsonl", records)
    tokenizer = load_tokenizer(DEMO_DIR)
    serial = load_samples(str(path), tokenizer, _data(tmp_path, cutoff_len=20, template="llama3"), "sft")
    parallel = load_samples(str(path), tokenizer, _data(tmp_path / "p", cutoff_len=20, template="llama3",
                                                        preprocessing_num_workers=3), "sft")
    assert parallel.stats["cache_hits"] == 0
    for name in ("input_ids", "labels", "offsets"):
        assert getattr(parallel, name).tobytes() == getattr(serial, name).tobytes()
    assert parallel.stats == serial.stats and serial.stats["truncated"] > 0


def test_a_named_template_fixes_the_tokenizer_the_rows_and_backends_use(tmp_path):
    path = _jsonl(tmp_path / "sft.jsonl", [alpaca_record(a, b) for a, b in make_problems(4, seed=1)])
    data = _build(tmp_path, f"dataset={path}", "cutoff_len=64", "template=qwen")
    assert data.tokenizer.eos_token == "<|im_end|>"  # LLaMA-Factory's replace_eos
    assert data.train.pad_token_id == data.tokenizer.pad_token_id
    ids, labels = data.train.samples.sample(0)
    assert data.tokenizer.decode(ids.tolist()).startswith("<|im_start|>system\nYou are Qwen")


@pytest.mark.parametrize("fields, message", [
    ({"template": "nope"}, "data.template='nope' is not a template; valid: " + ", ".join(TEMPLATE_NAMES)),
    ({"template": "glm4", "train_on_prompt": True}, "data.train_on_prompt=true does not work with "
                                                    "data.template='glm4'"),
    ({"template": "qwen", "train_on_prompt": True, "mask_history": True}, "contradict each other"),
])
def test_bad_template_settings_are_one_line(tmp_path, fields, message):
    path = _jsonl(tmp_path / "sft.jsonl", [alpaca_record(1, 2)])
    with pytest.raises(DataError) as err:
        load_samples(str(path), load_tokenizer(DEMO_DIR), _data(tmp_path, **fields), "sft")
    assert message in _one_line(err)


def _lf_dir(tmp_path: Path, entries: dict, files: dict) -> Path:
    root = tmp_path / "lf"
    root.mkdir()
    for name, records in files.items():
        if name.endswith(".txt"):
            (root / name).write_text(records)
        else:
            _jsonl(root / name, records)
    (root / "dataset_info.json").write_text(json.dumps(entries))
    return root


def test_tool_calls_go_through_the_templates_tool_format(tmp_path):
    root = _lf_dir(tmp_path, {"glaive": {"file_name": "glaive.jsonl", "formatting": "sharegpt",
                                         "columns": {"messages": "conversations", "tools": "tools"}}},
                   {"glaive.jsonl": [GLAIVE]})
    data = _build(tmp_path, f"dataset_dir={root}", "dataset=glaive", "cutoff_len=1024", "seq_length=1024",
                  "template=qwen")
    ids, labels = data.train.samples.sample(0)
    text = data.tokenizer.decode(ids.tolist())
    assert "# Tools" in text and "<tool_call>" in text and "<tool_response>\n5\n</tool_response>" in text
    trained = data.tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())
    assert trained.startswith("<tool_call>\n{\"name\": \"add\"") and trained.endswith("it is 5<|im_end|>\n")
    with pytest.raises(DataError) as err:  # the tokenizer's own chat template has no tool format
        _build(tmp_path, f"dataset_dir={root}", "dataset=glaive", "cutoff_len=256", "overwrite_cache=true")
    assert "cannot encode tools; valid: a named template" in _one_line(err)


def test_txt_files_are_pt_documents_one_per_line(tmp_path):
    root = _lf_dir(tmp_path, {"corpus": {"file_name": "c.txt", "columns": {"prompt": "text"}}},
                   {"c.txt": "abc\nde\n"})
    data = _build(tmp_path, f"dataset_dir={root}", "dataset=corpus", "cutoff_len=16", "pt_chunking=document",
                  stage="pt")
    decoded = [data.tokenizer.decode(ids.tolist() + [int(labels[-1])]) for ids, labels in _samples_of(data)]
    assert decoded == ["abc<|end|>", "de<|end|>"]
    direct = _build(tmp_path / "direct", f"dataset={root / 'c.txt'}", "cutoff_len=16", "pt_chunking=document",
                    stage="pt")
    assert _samples(direct.train.samples) == _samples(data.train.samples)


def _samples_of(data):
    samples = data.train.samples
    return [samples.sample(i) for i in range(len(samples))]


def test_llama3_pt_documents_end_with_end_of_text(tmp_path):
    shutil.copytree(DEMO_DIR, tmp_path / "tok", ignore=shutil.ignore_patterns("*.jsonl"))
    tokenizer = load_tokenizer(tmp_path / "tok")
    path = tmp_path / "c.txt"
    path.write_text("abc\n")
    data = _data(tmp_path, template="llama3", cutoff_len=16, pt_chunking="document")
    with pytest.raises(DataError) as err:
        load_samples(str(path), tokenizer, data, "pt")
    assert "ends pt documents with '<|end_of_text|>', which this tokenizer lacks" in _one_line(err)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end_of_text|>"]})
    store = load_samples(str(path), tokenizer, data, "pt")
    ids, labels = store.sample(0)
    assert labels[-1] == tokenizer.convert_tokens_to_ids("<|end_of_text|>") != tokenizer.eos_token_id
    assert tokenizer.eos_token == "<|eot_id|>"  # llama3 replaces the eos; pt ends with end_of_text


def test_kto_data_is_read_by_stage_kto_only(tmp_path):
    """kto_tag: refused in one line outside stage kto (an entry's column, a direct file's
    field); stage kto needs it, a boolean, and pairs each example with the answer before it in
    the micro-step for its KL row (the first with the last)."""
    turns = [[{"from": "human", "value": f"{a}+{b}="}, {"from": "gpt", "value": str(a + b + k % 2)}]
             for k, (a, b) in enumerate(make_problems(4, seed=2))]
    root = _lf_dir(tmp_path, {"kto": {"file_name": "k.jsonl", "formatting": "sharegpt",
                                      "columns": {"messages": "conversations", "kto_tag": "label"}},
                              "sft": {"file_name": "k.jsonl", "formatting": "sharegpt",
                                      "columns": {"messages": "conversations"}}},
                   {"k.jsonl": [{"conversations": t, "label": k % 2 == 0} for k, t in enumerate(turns)]})
    with pytest.raises(DataError) as err:
        _build(tmp_path, f"dataset_dir={root}", "dataset=kto", "cutoff_len=64")
    assert "dataset 'kto' has columns.kto_tag, which finetuning.stage='sft' does not read" in _one_line(err)
    with pytest.raises(DataError) as err:
        _build(tmp_path, f"dataset_dir={root}", "dataset=sft", "cutoff_len=64", stage="kto")
    assert "dataset 'sft' lacks columns.kto_tag, which finetuning.stage='kto' needs" in _one_line(err)
    path = _jsonl(tmp_path / "a.jsonl", [{**alpaca_record(1, 2), "kto_tag": True}])
    with pytest.raises(DataError) as err:
        load_samples(str(path), load_tokenizer(DEMO_DIR), _data(tmp_path), "sft")
    assert "kto_tag (unpaired feedback) is read by finetuning.stage='kto' only" in _one_line(err)
    path = _jsonl(tmp_path / "b.jsonl", [{**alpaca_record(1, 2), "kto_tag": "yes"}])
    with pytest.raises(DataError) as err:
        load_samples(str(path), load_tokenizer(DEMO_DIR), _data(tmp_path), "kto")
    assert "b.jsonl:1: finetuning.stage='kto' needs a boolean kto_tag" in _one_line(err)

    data = _build(tmp_path, f"dataset_dir={root}", "dataset=kto", "cutoff_len=64", stage="kto")
    store = data.train.samples
    assert len(data.train) == 4 and store.stats["desirable"] == 2 and store.stats["invalid"] == 0
    batch = data.train.collate([data.train[(0, 3)], data.train[(1, 0)]])
    assert batch.tags.tolist() == [1, 0] and batch.rows == 4
    for row, (own, other) in enumerate([(0, 0), (0, 3), (1, 1), (1, 0)]):
        prompt, answer = store.sample(2 * own)[0].tolist(), store.sample(2 * other + 1)[0].tolist()
        ids, labels = batch.input_ids[row].tolist(), batch.labels[row].tolist()
        whole = prompt + answer
        assert ids[:len(whole) - 1] == whole[:-1], row  # the prompt, then the row's answer
        assert [t for t in labels if t != -100] == answer, row  # only the answer is scored


def test_a_hub_entry_without_a_local_file_is_refused(tmp_path):
    root = _lf_dir(tmp_path, {"hub": {"hf_hub_url": "org/data", "subset": "main"}}, {})
    with pytest.raises(DataError) as err:
        _build(tmp_path, f"dataset_dir={root}", "dataset=hub", "cutoff_len=64")
    assert "has hf_hub_url: hub, script and cloud entries are not read" in _one_line(err)
