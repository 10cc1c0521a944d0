"""LLaMA-Factory's own example configs run here as its users wrote them (issue #39).

The six YAMLs (tests/lf_examples.py) are LLaMA-Factory's ``examples/train_full/qwen3_full_sft.yaml`` and
``examples/train_lora/qwen3_lora_{sft,dpo,kto,pretrain}.yaml`` (key for key, value for value, comments
left out), and the dpo one with ``pref_loss: orpo`` (LLaMA-Factory has no orpo YAML; its README
says to set that key). A test changes only what a user moving to this machine must change: the model
(``model_name_or_path``: the tiny test model), where the data lives (``dataset_dir``: data in
LLaMA-Factory's formats under its example dataset names, made here), where the run goes
(``output_dir``), and a small ``max_steps`` so that the test ends. The full-sft example also
names a DeepSpeed config, which this tool refuses (Megatron-Core's parallelism replaces it:
tests/test_lf_keys.py shows the one-line refusal), so that test drops the key.

Each runs on 2 CPU ranks on both backends (``use_mca``, ROLL's key for the backend), and must
end as a finished run with finite losses.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from lf_examples import EXAMPLES
from trainer_fixtures import make_model_dir, run_ranks, steps

from hpc_mca.data.addition import alpaca_record, make_problems, preference_record

pytestmark = pytest.mark.slow

DATASET_INFO = {
    "identity": {"file_name": "identity.json"},
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True, "formatting": "sharegpt",
                    "columns": {"messages": "conversations", "chosen": "chosen",
                                "rejected": "rejected"}},
    "c4_demo": {"file_name": "c4_demo.jsonl", "columns": {"prompt": "text"}},
    "kto_en_demo": {"file_name": "kto_en_demo.json", "formatting": "sharegpt",
                    "columns": {"messages": "messages", "kto_tag": "label"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                             "assistant_tag": "assistant"}},
}
"""LLaMA-Factory's data/dataset_info.json entries of the datasets its examples name."""


def _write_lf_data(root: Path) -> Path:
    """LLaMA-Factory's example datasets in their formats (alpaca json lists, sharegpt pairs,
    jsonl text), filled with the demo's arithmetic so the character tokenizer covers them."""
    problems = make_problems(96, seed=5)
    data = root / "data"
    data.mkdir()
    alpaca = [{**alpaca_record(a, b), "input": ""} for a, b in problems]
    (data / "identity.json").write_text(json.dumps(alpaca[:32], indent=2))
    (data / "alpaca_en_demo.json").write_text(json.dumps(alpaca[32:], indent=2))
    pairs = [preference_record(a, b) for a, b in problems[:64]]
    (data / "dpo_en_demo.json").write_text(json.dumps([
        {"conversations": [{"from": "human", "value": p["instruction"]}],
         "chosen": {"from": "gpt", "value": p["chosen"]},
         "rejected": {"from": "gpt", "value": p["rejected"]}} for p in pairs], indent=2))
    # kto_en_demo: sharegpt messages with a boolean label (LLaMA-Factory's 300 examples,
    # 150 desirable); here the right sum is desirable, a near miss undesirable.
    (data / "kto_en_demo.json").write_text(json.dumps([
        {"messages": [{"role": "user", "content": p["instruction"]},
                      {"role": "assistant", "content": p["chosen"] if k % 2 else p["rejected"]}],
         "label": bool(k % 2)} for k, p in enumerate(pairs)], indent=2))
    # pt packs documents into rows of cutoff_len (2048) tokens: 2 steps of 16 rows need ~64k.
    sums = [f"{a}+{b}={a + b}." for a, b in make_problems(6000, seed=6)]
    (data / "c4_demo.jsonl").write_text("".join(
        json.dumps({"text": " ".join(sums[i:i + 30])}) + "\n" for i in range(0, len(sums), 30)))
    (data / "dataset_info.json").write_text(json.dumps(DATASET_INFO, indent=2))
    return data


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lf_examples")
    # qwen3's template turns <|im_end|> into the eos token, a token the demo tokenizer lacks:
    # LLaMA-Factory adds it (and asks for resize_vocab), so the model's vocabulary has room.
    return make_model_dir(root, layers=2, vocab_size=128), _write_lf_data(root)


@pytest.mark.parametrize("backend", ["megatron", "standard"])
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_llama_factory_example_runs_unchanged(setup, tmp_path, example, backend):
    model_dir, data_dir = setup
    config = dict(EXAMPLES[example])
    config.pop("deepspeed", None)  # refused here: see the module docstring
    config.update(model_name_or_path=str(model_dir), dataset_dir=str(data_dir),
                  output_dir=str(tmp_path / "run"), max_steps=2)
    path = tmp_path / "example.yaml"
    path.write_text(yaml.safe_dump(config))
    done = run_ranks(2, ["train", str(path), f"use_mca={backend == 'megatron'}"], timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logged = steps(tmp_path / "run")
    assert logged and logged[-1]["step"] == 2
    assert all(math.isfinite(s["loss"]) for s in logged)
    progress = json.loads((tmp_path / "run" / "progress.json").read_text())
    assert progress.get("finished") is True, progress
