"""Our sft and dpo samples equal LLaMA-Factory 0.9.5's own (issue #39).

The peer side is LLaMA-Factory itself: its converters (alpaca, sharegpt) turn the records into
examples, ``get_template_and_fix_tokenizer`` gives the template and fixes its tokenizer, and its
``SupervisedDatasetProcessor`` / ``PairwiseDatasetProcessor`` build the samples. Our side reads
the same records from files through a dataset_info.json (so the column and tag mapping is part
of what is compared), with our templates and our tokenizer fix. Both are compared after the
causal shift HF applies to LLaMA-Factory's ``(input_ids, labels)``: inputs ``ids[:-1]``, labels
``labels[1:]``. LLaMA-Factory keeps a sample with nothing left to train; we drop it, so those
are counted on both sides and left out of the comparison.

Every registered template but chat and plain (the tokenizer's own rendering, not
LLaMA-Factory's) is compared on alpaca records (history, system, an empty input), multi-turn
sharegpt with system prompts (a system turn and a system column) and a broken conversation,
tool calls (glaive's layout: function_call and observation turns, a tools column), and
preference pairs (alpaca and sharegpt), at three cutoff lengths (the shortest cuts prompts and
answers), with mask_history and train_on_prompt on and off. The demo tokenizer (character
level) keeps it fast.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from lf_peer import lf_converter, lf_data_args, lf_get_template_and_fix_tokenizer, lf_pairwise, lf_supervised
from llamafactory.data.mm_plugin import get_mm_plugin
from llamafactory.data.parser import get_dataset_list

from hpc_mca.data.addition import DEMO_DIR
from hpc_mca.data.arguments import DataArguments
from hpc_mca.data.encode import conversation_store, prepare_template
from hpc_mca.data.errors import DataError
from hpc_mca.data.sources import resolve_sources, source_records
from hpc_mca.data.templates import TEMPLATE_NAMES
from hpc_mca.data.tokenize import IGNORE_INDEX, load_tokenizer

NAMES = [name for name in TEMPLATE_NAMES if name not in ("chat", "plain")]
CUTOFFS = (14, 60, 1024)
TOOLS = json.dumps([{"name": "add", "description": "Add two numbers",
                     "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                                    "b": {"type": "number"}},
                                    "required": ["a", "b"]}}])

ALPACA = [
    {"instruction": "add 2 and 3", "input": "quick", "output": "5", "system": "be terse",
     "history": [["hi there", "hello"], ["2+2", "4 is the answer"]]},
    {"instruction": "count " * 12, "input": "", "output": "one two three " * 5, "system": "", "history": []},
    {"instruction": "", "input": "only the input", "output": "ok", "system": "s", "history": []},
]
SHAREGPT = [
    {"conversations": [{"from": "system", "value": "you add numbers"},
                       {"from": "human", "value": "1+1"}, {"from": "gpt", "value": "2"},
                       {"from": "human", "value": "and 2+2 " * 4}, {"from": "gpt", "value": "4 " * 9}],
     "system": "ignored: the system turn wins"},
    {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi, how can I help"}],
     "system": "a column system prompt"},
    {"conversations": [{"from": "human", "value": "broken"}, {"from": "human", "value": "twice"}], "system": ""},
]
TOOL_CALLS = [
    {"conversations": [{"from": "human", "value": "what is 2 plus 3"},
                       {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}})},
                       {"from": "observation", "value": json.dumps({"result": 5})},
                       {"from": "gpt", "value": "2 plus 3 is 5"}],
     "tools": TOOLS},
    {"conversations": [{"from": "human", "value": "say hi"}, {"from": "gpt", "value": "hi"}], "tools": TOOLS},
]
PAIRS = [
    {"instruction": "2+2", "input": "", "chosen": "4", "rejected": "5 " * 12, "system": "math",
     "history": [["hi", "hello"]]},
    {"instruction": "name a colour " * 3, "input": "now", "chosen": "blue", "rejected": "", "system": "",
     "history": []},
]
SHAREGPT_PAIRS = [
    {"conversations": [{"from": "human", "value": "1+1"}, {"from": "gpt", "value": "2"},
                       {"from": "human", "value": "and 3+3"}],
     "chosen": {"from": "gpt", "value": "6"}, "rejected": {"from": "gpt", "value": "seven"}, "system": "sys"},
]
# LLaMA-Factory resets every column an entry's "columns" leaves out to none (prompt included), so
# these entries name all they use, as its own dataset_info.json does.
DATASETS = {
    "alpaca": (ALPACA, {"formatting": "alpaca", "columns": {"prompt": "instruction", "query": "input",
                                                           "response": "output", "history": "history",
                                                           "system": "system"}}),
    "sharegpt": (SHAREGPT, {"formatting": "sharegpt", "columns": {"messages": "conversations",
                                                                   "system": "system"}}),
    "tools": (TOOL_CALLS, {"formatting": "sharegpt", "columns": {"messages": "conversations",
                                                                "tools": "tools"}}),
    "pairs": (PAIRS, {"formatting": "alpaca", "ranking": True,
                      "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                  "rejected": "rejected", "history": "history", "system": "system"}}),
    "sharegpt_pairs": (SHAREGPT_PAIRS, {"formatting": "sharegpt", "ranking": True,
                                        "columns": {"messages": "conversations", "chosen": "chosen",
                                                    "rejected": "rejected", "system": "system"}}),
}
STAGES = {"pairs": "dpo", "sharegpt_pairs": "dpo"}
COMPARED: dict[str, int] = {}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lf_parity")
    info = {}
    for name, (records, entry) in DATASETS.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        info[name] = {"file_name": f"{name}.jsonl", **entry}
    (root / "dataset_info.json").write_text(json.dumps(info))
    return root


@pytest.fixture(scope="module")
def ours(data_dir) -> dict:
    """Our records of each dataset, read and mapped once (LLaMA-Factory's field names out)."""
    out = {}
    for name in DATASETS:
        stage = STAGES.get(name, "sft")
        source, = resolve_sources(DataArguments(dataset=[name], dataset_dir=str(data_dir)))
        out[name] = (source.formatting, source_records(source, stage, None, "data.dataset",
                                                       data_dir / "cache"))
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_DIR)


def _lf_examples(name: str, data_dir: Path, args) -> dict[str, list]:
    """LLaMA-Factory's converter output of dataset ``name`` as a column batch."""
    attr, = get_dataset_list([name], str(data_dir))
    convert = (lf_converter.AlpacaDatasetConverter if attr.formatting == "alpaca"
               else lf_converter.SharegptDatasetConverter)(attr, args)
    rows = [convert(record) for record in DATASETS[name][0]]
    return {key: [row[key] for row in rows] for key in rows[0]}


def _shift(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    return ids[:-1], labels[1:]


def _trains(sample: tuple[list[int], list[int]]) -> bool:
    return any(label != IGNORE_INDEX for label in sample[1])


def _lf_samples(name: str, data_dir: Path, base_tokenizer, **settings) -> tuple[list, object]:
    tok = copy.deepcopy(base_tokenizer)
    template = lf_get_template_and_fix_tokenizer(tok, dataset=name, **settings)
    template.mm_plugin = get_mm_plugin("base")  # text only: gemma3's plugin wants an image processor
    args = lf_data_args(dataset=name, **settings)
    batch = _lf_examples(name, data_dir, args)
    if STAGES.get(name) == "dpo":
        out = lf_pairwise.PairwiseDatasetProcessor(template=template, tokenizer=tok, processor=None,
                                                   data_args=args).preprocess_dataset(batch)
        samples = [_shift(out[f"{side}_input_ids"][i], out[f"{side}_labels"][i])
                   for i in range(len(out["chosen_input_ids"])) for side in ("chosen", "rejected")]
    else:
        out = lf_supervised.SupervisedDatasetProcessor(template=template, tokenizer=tok, processor=None,
                                                       data_args=args).preprocess_dataset(batch)
        samples = [_shift(ids, labels) for ids, labels in zip(out["input_ids"], out["labels"])]
    return samples, tok


def _our_samples(name: str, records, fmt: str, base_tokenizer, **settings) -> tuple[list, object]:
    tok = copy.deepcopy(base_tokenizer)
    data = DataArguments(**settings)
    template = prepare_template(tok, data)
    store = conversation_store(records, tok, template, data, fmt, ranking=STAGES.get(name) == "dpo")
    return [tuple(a.tolist() for a in store.sample(i)) for i in range(len(store))], tok


def _compare(name: str, data_dir: Path, ours: dict, tokenizer, **settings) -> int:
    theirs, their_tok = _lf_samples(name, data_dir, tokenizer, **settings)
    fmt, records = ours[name]
    mine, my_tok = _our_samples(name, records, fmt, tokenizer, **settings)
    assert (my_tok.eos_token, my_tok.pad_token, len(my_tok)) == \
        (their_tok.eos_token, their_tok.pad_token, len(their_tok)), settings
    if STAGES.get(name) == "dpo":  # a pair is dropped whole when either side trains nothing
        pairs = list(zip(theirs[::2], theirs[1::2]))
        theirs = [s for pair in pairs if all(map(_trains, pair)) for s in pair]
    else:
        theirs = [sample for sample in theirs if _trains(sample)]
    assert mine == theirs, (name, settings)
    return len(mine)


@pytest.mark.parametrize("name", NAMES)
def test_sft_samples_equal_llamafactorys(name, data_dir, ours, tokenizer):
    count = 0
    for dataset in ("alpaca", "sharegpt", "tools"):
        for cutoff in CUTOFFS:
            for mask_history in (False, True):
                for train_on_prompt in (False, True):
                    settings = dict(template=name, cutoff_len=cutoff, mask_history=mask_history,
                                    train_on_prompt=train_on_prompt)
                    if train_on_prompt and (mask_history or name == "glm4"):  # both refuse these
                        with pytest.raises(DataError, match="train_on_prompt"):
                            _our_samples(dataset, *ours[dataset][::-1], tokenizer, **settings)
                        with pytest.raises(ValueError):
                            _lf_samples(dataset, data_dir, tokenizer, **settings)
                        continue
                    count += _compare(dataset, data_dir, ours, tokenizer, **settings)
    COMPARED[f"sft:{name}"] = count
    # 3 alpaca + 2 valid sharegpt + 2 tool records under 9 settings (6 for glm4); the shortest
    # cutoff with mask_history may leave a sample nothing to train (dropped on both sides).
    assert count >= (6 if name == "glm4" else 9) * 7 - 7


@pytest.mark.parametrize("name", NAMES)
def test_dpo_pairs_equal_llamafactorys(name, data_dir, ours, tokenizer):
    count = sum(_compare(dataset, data_dir, ours, tokenizer, template=name, cutoff_len=cutoff)
                for dataset in ("pairs", "sharegpt_pairs") for cutoff in CUTOFFS)
    COMPARED[f"dpo:{name}"] = count
    # Three pairs, both sides, three cutoffs; a template that writes nothing for the empty
    # rejected answer leaves that pair nothing to score (dropped on both sides).
    assert count >= 2 * 3 * 3 - 2 * 3


def test_template_settings_equal_llamafactorys(data_dir, ours, tokenizer):
    count = 0
    for name in NAMES:
        count += _compare("sharegpt", data_dir, ours, tokenizer, template=name, cutoff_len=1024,
                          default_system="You are a careful adder.")
        count += _compare("tools", data_dir, ours, tokenizer, template=name, cutoff_len=1024, tool_format="qwen")
    for thinking in (True, False, None):
        for mask_history in (False, True):
            count += _compare("sharegpt", data_dir, ours, tokenizer, template="qwen3", cutoff_len=1024,
                              enable_thinking=thinking, mask_history=mask_history)
    assert count == len(NAMES) * 4 + 6 * 2


def test_every_template_was_compared():
    """The runs above covered every template (a registry entry cannot slip past the comparison)."""
    if len(COMPARED) < 2 * len(NAMES):
        pytest.skip("run with the parametrized tests of this module")
    assert sorted(COMPARED) == sorted(f"{kind}:{name}" for kind in ("sft", "dpo") for name in NAMES)
    total = sum(COMPARED.values())
    assert total >= len(NAMES) * 70, COMPARED  # 1256 with the 16 templates of issue #39
    print(f"compared {total} samples with LLaMA-Factory's")
