"""hpc_mca.data.tokenize / samples / store / dataset: label masks, the causal shift, caching."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from hpc_mca.data.addition import DEMO_DIR
from hpc_mca.data.arguments import DataArguments
from hpc_mca.data.conversation import example_of
from hpc_mca.data.dataset import load_samples
from hpc_mca.data.errors import DataError
from hpc_mca.data.records import Record
from hpc_mca.data.samples import supervised_sample
from hpc_mca.data.templates import get_template
from hpc_mca.data.tokenize import IGNORE_INDEX, causal_shift, encode_documents, load_tokenizer, pt_samples


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEMO_DIR)


def _data(tmp_path: Path, **overrides) -> DataArguments:
    fields = dict(dataset_format="auto", text_field="text", template="chat", cutoff_len=64,
                  seq_length=None, pt_chunking="concat", train_on_prompt=False,
                  max_samples=None, preprocessing_cache_dir=str(tmp_path / "cache"),
                  overwrite_cache=False)
    return DataArguments(**{**fields, **overrides})


def _sft(tok, messages, template="chat", train_on_prompt=False, cutoff=64):
    """(tokens, trained mask, shifted sample or None when nothing is trained, truncated)."""
    example = example_of(Record("f:1", {"messages": messages}), "sharegpt", False)
    built = supervised_sample(get_template(template, tok), tok, example, cutoff, train_on_prompt=train_on_prompt)
    tokens, trained, targets = built.arrays()
    sample = causal_shift(tokens, trained, targets)
    return tokens, trained, (sample if (sample[1] != IGNORE_INDEX).any() else None), built.truncated


def _trained_text(tok, sample) -> str:
    _, labels = sample
    return tok.decode(labels[labels != IGNORE_INDEX].tolist())


def test_causal_shift_is_next_token():
    tokens = np.array([5, 6, 7, 8], dtype=np.int32)
    ids, labels = causal_shift(tokens, np.array([False, False, True, True]))
    assert ids.tolist() == [5, 6, 7]
    assert labels.tolist() == [IGNORE_INDEX, 7, 8]


def test_chat_template_loss_only_on_the_response(tok):
    messages = [{"role": "user", "content": "12+345="}, {"role": "assistant", "content": "357"}]
    tokens, trained, sample, truncated = _sft(tok, messages)
    assert tok.decode(tokens.tolist()) == "<|user|>12+345=<|assistant|>357<|end|>"
    assert tok.decode(tokens[trained].tolist()) == "357<|end|>"
    ids, labels = sample
    assert len(ids) == len(tokens) - 1 and not truncated
    assert _trained_text(tok, sample) == "357<|end|>"
    kept = labels != IGNORE_INDEX
    assert (labels[kept] == tokens[1:][kept]).all()  # labels[t] = token[t + 1]


def test_multi_turn_and_system(tok):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "1+1="},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="},
                {"role": "assistant", "content": "4"}]
    _, _, sample, _ = _sft(tok, messages)
    assert _trained_text(tok, sample) == "2<|end|>4<|end|>"


def test_train_on_prompt_and_plain_template(tok):
    messages = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    _, trained, _, _ = _sft(tok, messages, train_on_prompt=True)
    assert trained.all()
    tokens, trained, sample, _ = _sft(tok, messages, template="plain")
    assert tok.decode(tokens.tolist()) == "1+1=2<|end|>"
    assert _trained_text(tok, sample) == "2<|end|>"


def test_truncation_keeps_the_answer_and_drops_untrainable(tok):
    # Issue #39: LLaMA-Factory's rule (infer_seqlen on cutoff_len tokens before the shift): an
    # answer under half the budget stays whole and the prompt is cut from its end; before,
    # the first cutoff_len + 1 tokens were kept and the answer lost its end.
    messages = [{"role": "user", "content": "1234567+1="}, {"role": "assistant", "content": "99"}]
    tokens, _, sample, truncated = _sft(tok, messages, cutoff=12)  # 15 tokens -> 12 kept
    assert truncated and len(tokens) == 12 and _trained_text(tok, sample) == "99<|end|>"
    _, _, sample, truncated = _sft(tok, messages, cutoff=4)  # both shrink: the answer to nothing
    assert truncated and sample is None


def test_template_that_is_not_prefix_stable_is_refused(tmp_path: Path):
    shutil.copytree(DEMO_DIR, tmp_path / "tok", ignore=shutil.ignore_patterns("*.jsonl"))
    config_path = tmp_path / "tok" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = ("{{ messages | length }}{% for m in messages %}{{ m['content'] }}"
                               "{% endfor %}")
    config_path.write_text(json.dumps(config))
    bad = load_tokenizer(tmp_path / "tok")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(DataError, match="the chat template does not render turn 1"):
        _sft(bad, messages)


def test_pt_concat_predicts_every_token_once(tok):
    docs = list(encode_documents(tok, ["abcdefg", "hij"]))
    assert tok.decode(docs[0].tolist()) == "abcdefg<|end|>"
    stream = np.concatenate(docs)
    samples = list(pt_samples(docs, 4, "concat"))
    labels = np.concatenate([lab for _, lab in samples])
    assert labels.tolist() == stream[1:].tolist()
    assert all(len(ids) <= 4 for ids, _ in samples)


def test_pt_document_chunking_never_mixes_documents(tok):
    docs = list(encode_documents(tok, ["abcdefg", "hij"]))
    samples = list(pt_samples(docs, 4, "document"))
    assert [tok.decode(ids.tolist()) for ids, _ in samples] == ["abcd", "efg", "hij"]
    assert [tok.decode(lab.tolist()) for _, lab in samples] == [
        "bcde", "fg<|end|>", "ij<|end|>"]


def _alpaca_file(path: Path, pairs: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"instruction": q, "output": a}) + "\n" for q, a in pairs))
    return path


def test_tokenization_is_cached_by_content(tok, tmp_path: Path):
    path = _alpaca_file(tmp_path / "a.jsonl", [("1+1=", "2"), ("2+3=", "5")])
    data = _data(tmp_path)
    first = load_samples(str(path), tok, data, "sft")
    assert first.stats["cache_hits"] == 0 and len(first) == 2
    copy = tmp_path / "copy.jsonl"
    shutil.copy(path, copy)
    again = load_samples(str(copy), tok, data, "sft")  # same content elsewhere: a hit
    assert again.stats["cache_hits"] == 1
    assert np.array_equal(again.input_ids, first.input_ids)
    assert np.array_equal(again.labels, first.labels)
    changed = load_samples(str(path), tok, _data(tmp_path, cutoff_len=5), "sft")
    assert changed.stats["cache_hits"] == 0
    _alpaca_file(path, [("1+1=", "2")])
    assert load_samples(str(path), tok, data, "sft").stats["cache_hits"] == 0
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 3


def test_malformed_line_is_reported_before_training(tok, tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "1+1=", "output": "2"}\n{"instruction": "x" "output": 1}\n')
    with pytest.raises(DataError) as err:
        load_samples(str(path), tok, _data(tmp_path), "sft")
    assert str(err.value).startswith(f"{path}:2: invalid JSON (")
    assert "\n" not in str(err.value)


def test_unknown_format_is_one_line(tok, tmp_path: Path):
    path = tmp_path / "odd.jsonl"
    path.write_text('{"question": "1+1=", "answer": "2"}\n')
    with pytest.raises(DataError) as err:
        load_samples(str(path), tok, _data(tmp_path), "sft")
    assert str(err.value).startswith(f"{path}:1: cannot tell the sft format")
    assert "\n" not in str(err.value)
