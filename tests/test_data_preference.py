"""Pairwise data for stage dpo: LLaMA-Factory's formats, prompt-aligned truncation, and rows
and loaders that never split a pair."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from hpc_mca.data.arguments import DataRun
from hpc_mca.data.conversation import example_of
from hpc_mca.data.errors import DataError
from hpc_mca.data.preference import pair_rows, split_pairs, tokenize_pairs
from hpc_mca.data.records import Record
from hpc_mca.data.samples import infer_seqlen
from hpc_mca.data.tokenize import IGNORE_INDEX, load_tokenizer

DEMO = "hpc_mca/assets/demo"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO)


def _data(**fields):
    return SimpleNamespace(**{"dataset_format": "auto", "template": "chat", "cutoff_len": 32,
                              **fields})


def test_alpaca_and_sharegpt_pairs_read_alike():
    alpaca = Record("a:1", {"system": "add", "instruction": "1+2=", "input": "now",
                            "chosen": "3", "rejected": "4"})
    sharegpt = Record("a:1", {"system": "add",
                              "conversations": [{"from": "human", "value": "1+2=\nnow"}],
                              "chosen": {"from": "gpt", "value": "3"},
                              "rejected": {"role": "assistant", "content": "4"}})
    example = example_of(alpaca, "alpaca", True)
    assert example == example_of(sharegpt, "sharegpt", True)
    assert (example.prompt, example.response, example.system) == (
        [{"role": "user", "content": "1+2=\nnow"}],
        [{"role": "assistant", "content": "3"}, {"role": "assistant", "content": "4"}], "add")


def _decoded(tokenizer, store, index):
    ids, labels = store.sample(index)
    answer = labels[labels != IGNORE_INDEX]
    return tokenizer.decode(ids), tokenizer.decode(answer)


def test_pairs_share_the_prompt_and_label_only_the_answer(tokenizer):
    records = [Record("x:1", {"instruction": "12+34=", "chosen": "46", "rejected": "461"})]
    store = tokenize_pairs(records, tokenizer, _data())
    assert len(store) == 2 and store.stats["pairs"] == 1
    assert _decoded(tokenizer, store, 0) == ("<|user|>12+34=<|assistant|>46", "46<|end|>")
    assert _decoded(tokenizer, store, 1) == ("<|user|>12+34=<|assistant|>461", "461<|end|>")


HISTORY_PROMPT = ("<|system|>Add.<|user|>1+2=<|assistant|>3<|end|><|user|>3+4=<|assistant|>7"
                  "<|end|><|user|>12+34=<|assistant|>")


@pytest.mark.parametrize("record", [
    {"system": "Add.", "history": [["1+2=", "3"], ["3+4=", "7"]], "instruction": "12+34=",
     "chosen": "46", "rejected": ""},
    {"system": "Add.", "conversations": [
        {"from": "human", "value": "1+2="}, {"from": "gpt", "value": "3"},
        {"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"},
        {"from": "human", "value": "12+34="}],
     "chosen": {"from": "gpt", "value": "46"}, "rejected": {"from": "gpt", "value": ""}},
], ids=["alpaca", "sharegpt"])
def test_history_is_prompt_and_only_the_final_answer_is_trained(tokenizer, record):
    """Earlier assistant turns are history (TRL's and LLaMA-Factory's prompt), never labels; an
    empty rejected answer is scored on its end-of-turn token alone, as TRL does."""
    store = tokenize_pairs([Record("x:1", record)], tokenizer, _data(cutoff_len=64))
    prompt = len(tokenizer(HISTORY_PROMPT, add_special_tokens=False)["input_ids"])
    assert prompt == 29
    assert _decoded(tokenizer, store, 0) == (HISTORY_PROMPT + "46", "46<|end|>")
    assert _decoded(tokenizer, store, 1) == (HISTORY_PROMPT, "<|end|>")
    # labels[t] is token t + 1: the answer's tokens are 29..31 (chosen), 29 (rejected).
    assert np.flatnonzero(store.sample(0)[1] != IGNORE_INDEX).tolist() == [28, 29, 30]
    assert np.flatnonzero(store.sample(1)[1] != IGNORE_INDEX).tolist() == [28]


def test_an_answer_without_tokens_is_dropped_and_counted():
    """A template that ends no turn with a token leaves an empty answer nothing to score (TRL
    would count it as log-probability 0). Issue #39: LLaMA-Factory keeps such a pair, scoring
    nothing; the pipeline drops it and counts it (it was a DataError before)."""
    bare = load_tokenizer(DEMO)
    bare.chat_template = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
                          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}"
                          "{% endif %}")
    record = Record("x:7", {"instruction": "1+1=", "chosen": "2", "rejected": ""})
    store = tokenize_pairs([record], bare, _data())
    assert len(store) == 0 and store.stats["dropped"] == 1
    ok = tokenize_pairs([Record("x:8", {**record.data, "rejected": "3"})], bare, _data())
    assert _decoded(bare, ok, 1) == ("<|user|>1+1=<|assistant|>", "3")


def test_truncation_cuts_one_prompt_for_both_answers(tokenizer):
    record = Record("x:1", {"instruction": "1234567+7654321=", "chosen": "8888888",
                            "rejected": "88888"})
    store = tokenize_pairs([record], tokenizer, _data(cutoff_len=12))
    assert store.stats["truncated"] == 1
    (c_ids, c_labels), (r_ids, r_labels) = store.sample(0), store.sample(1)
    prompt = int(np.argmax(c_labels != IGNORE_INDEX))  # first input whose label is trained
    assert prompt == int(np.argmax(r_labels != IGNORE_INDEX))
    assert np.array_equal(c_ids[:prompt + 1], r_ids[:prompt + 1])
    # Issue #39: LLaMA-Factory's budget is cutoff_len tokens before the shift (it was + 1).
    assert len(c_ids) <= 11 and len(r_ids) <= 11
    # 17 prompt + 8 answer tokens into 12: both halves shrink in proportion.
    assert infer_seqlen(17, 8, 12) == (9, 3)
    assert infer_seqlen(3, 8, 13) == (3, 8) and infer_seqlen(17, 3, 13) == (10, 3)
    assert infer_seqlen(4, 20, 13) == (4, 9)


@pytest.mark.parametrize("record, message", [
    ({"instruction": "1+1=", "chosen": "2"}, "x:1: finetuning.stage='dpo' needs pairwise records"),
    ({"conversations": [{"from": "human", "value": "1+1="}],
      "chosen": {"from": "human", "value": "2"}, "rejected": {"from": "gpt", "value": "3"}},
     "x:1: 'chosen' must be an answer turn (assistant or function call), got role 'user'"),
])
def test_bad_pairs_are_one_line(tokenizer, record, message):
    with pytest.raises(DataError) as err:
        tokenize_pairs([Record("x:1", record)], tokenizer, _data())
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_conversation_ending_with_an_answer_is_an_invalid_pair(tokenizer):
    """Issue #39: LLaMA-Factory drops a pairwise conversation that ends on the answer side (its
    answers are chosen and rejected); the pipeline drops and counts it (a DataError before)."""
    record = {"conversations": [{"from": "human", "value": "1+1="}, {"from": "gpt", "value": "2"}],
              "chosen": {"from": "gpt", "value": "2"}, "rejected": {"from": "gpt", "value": "3"}}
    store = tokenize_pairs([Record("x:1", record)], tokenizer, _data())
    assert len(store) == 0 and store.stats["invalid"] == 1


def _store(tokenizer, count):
    from hpc_mca.data.addition import make_problems, preference_record

    records = [Record(f"x:{i}", preference_record(a, b))
               for i, (a, b) in enumerate(make_problems(count, seed=4))]
    return tokenize_pairs(records, tokenizer, _data())


@pytest.mark.parametrize("packed", [False, True])
def test_loaders_keep_every_pair_in_one_micro_batch(tokenizer, packed):
    """Documents of a micro-batch alternate chosen, rejected of the same prompt."""
    from hpc_mca.data.dataset import train_dataloader

    store = _store(tokenizer, 40)
    rows = pair_rows(store, 64, 0, packed=packed, align=4)
    assert len(rows) == (len(rows.rows) if packed else 40)
    run = DataRun(stage="dpo", seed=1, seq_length=64, micro_batch_size=2, global_batch_size=4,
                  data_parallel_size=2)
    seen = 0
    for micro, _ in zip(train_dataloader(rows, run, data_parallel_rank=1), range(8)):
        ids = micro.input_ids.reshape(-1)
        docs = micro.document_index()
        starts = [int((docs == d).nonzero()[0]) for d in range(micro.num_documents)]
        assert micro.num_documents % 2 == 0
        for c, r in zip(starts[0::2], starts[1::2]):
            prompt = int((ids[c:] == 4).nonzero()[0])  # <|assistant|> ends the prompt
            assert np.array_equal(ids[c:c + prompt + 1], ids[r:r + prompt + 1])
        seen += micro.num_documents // 2
    assert seen == 16 if not packed else seen > 0


def test_held_out_pairs_stay_whole(tokenizer):
    store = _store(tokenizer, 10)
    train, held = split_pairs(store, 0.2, seed=3)
    assert len(held) == 4 and len(train) == 16
    for part in (train, held):
        assert np.array_equal(part[0::2] + 1, part[1::2]) and (part[0::2] % 2 == 0).all()
    assert not set(train) & set(held)


def test_demo_pairs_are_a_valid_dpo_dataset(tokenizer, tmp_path):
    from hpc_mca.data.addition import DEMO_DIR

    path = DEMO_DIR / "dpo_train.jsonl"
    records = [Record(f"{path}:{n}", json.loads(line))
               for n, line in enumerate(path.read_text().splitlines()[:50], 1)]
    store = tokenize_pairs(records, tokenizer, _data(dataset_format="alpaca", cutoff_len=16))
    assert store.stats["pairs"] == 50 and store.stats["dropped"] == 0
