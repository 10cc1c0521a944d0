"""LLaMA-Factory's own example configs run here as its users wrote them (issues #39, #60).

The six qwen3 YAMLs (tests/lf_examples.py) are LLaMA-Factory 0.9.5's
``examples/train_full/qwen3_full_sft.yaml`` and ``examples/train_lora/qwen3_lora_{sft,dpo,kto,
pretrain}.yaml`` (key for key, value for value, comments left out), and the dpo one with
``pref_loss: orpo`` (LLaMA-Factory has no orpo YAML; its README says to set that key); the
llama3 ones are 0.9.3's ``llama3_lora_sft``, ``llama3_full_sft`` and ``llama3_lora_pretrain``.
A test changes only what a user moving to this machine must change: the model
(``model_name_or_path``: the tiny test model), where the data lives (``dataset_dir``: data in
LLaMA-Factory's formats under its example dataset names, made here, small enough that the
examples' 3 epochs are a few steps), and where the run goes (``output_dir``). The full-sft
examples also name a DeepSpeed config (``examples/deepspeed/ds_z3_config.json``, not on this
machine): on the Megatron backend the ZeRO stage its name gives becomes the distributed
optimizer; the standard backend has no ZeRO sharding and refuses the key in one line
(tests/test_lf_keys.py), so that test drops the key there.

The qwen3 ones run on 2 CPU ranks, the llama3 ones on 1, each on both backends (``use_mca``,
ROLL's key for the backend, on the command line). Each must end as a finished run of finite
losses that leaves in output_dir what LLaMA-Factory's run leaves there: the HF model (full) or
the PEFT adapter (LoRA) with the tokenizer and generation config, trainer_state.json, the
results files and the loss plot; and transformers (with peft) must load that model with the
trained model's logits, to 1e-5 (tests/outputs_worker.py records them in memory at the end).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from lf_examples import EXAMPLES, LLAMA3_EXAMPLES
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
    # Sizes that keep the examples' 3 epochs short: 16 sft rows, 16 pairs, 16 kto examples.
    problems = make_problems(32, seed=5)
    data = root / "data"
    data.mkdir()
    alpaca = [{**alpaca_record(a, b), "input": ""} for a, b in problems]
    (data / "identity.json").write_text(json.dumps(alpaca[:8], indent=2))
    (data / "alpaca_en_demo.json").write_text(json.dumps(alpaca[8:16], indent=2))
    pairs = [preference_record(a, b) for a, b in problems[16:]]
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
    # pt packs documents into rows of cutoff_len (2048) tokens: ~17 rows.
    sums = [f"{a}+{b}={a + b}." for a, b in make_problems(3300, seed=6)]
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


WORKER = str(Path(__file__).with_name("outputs_worker.py"))


def _run_example(name: str, config: dict, model_dir: Path, data_dir: Path, tmp_path: Path,
                 backend: str, nproc: int) -> Path:
    """Run LLaMA-Factory's example ``config`` with only the model, the data directory and
    output_dir changed (the backend is the command line's choice), and check what it leaves in
    output_dir: a finished run of finite losses, the model as LLaMA-Factory's run leaves it,
    and its result files."""
    config = dict(config)
    if backend != "megatron":
        config.pop("deepspeed", None)  # refused there: see the module docstring
    run = tmp_path / "run"
    config.update(model_name_or_path=str(model_dir), dataset_dir=str(data_dir), output_dir=str(run))
    path = tmp_path / "example.yaml"
    path.write_text(yaml.safe_dump(config))
    logits = tmp_path / "trained_logits.pt"
    done = run_ranks(nproc, [WORKER, str(logits), str(path), f"use_mca={backend == 'megatron'}"],
                     timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    progress = json.loads((run / "progress.json").read_text())
    assert progress.get("finished") is True, progress
    logged = steps(run)
    assert logged and logged[-1]["step"] == progress["max_steps"], (name, logged[-1])
    assert all(math.isfinite(s["loss"]) for s in logged)
    _check_outputs(run, config, len(logged), logits, model_dir, backend == "megatron")
    return run


def _check_outputs(run: Path, config: dict, num_steps: int, logits: Path, model_dir: Path,
                   megatron: bool) -> None:
    """output_dir holds what LLaMA-Factory's run leaves there, and the model in it is the
    trained one: transformers (and peft, for an adapter) give the trained model's logits."""
    import torch
    from outputs_worker import IDS

    lora = config["finetuning_type"] == "lora"
    weights = ("adapter_config.json", "adapter_model.safetensors") if lora else ("config.json", "model.safetensors")
    for name in (*weights, "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "trainer_state.json", "train_results.json", "all_results.json", "training_loss.png"):
        assert (run / name).is_file(), f"{name} missing from output_dir: {sorted(p.name for p in run.iterdir())}"
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["global_step"] == num_steps
    train = json.loads((run / "train_results.json").read_text())
    assert math.isclose(train["epoch"], config["num_train_epochs"], rel_tol=1e-6), train
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert losses and all(math.isfinite(v) for v in losses)
    ours = torch.load(logits)
    with torch.no_grad():
        if lora:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            # The base as the run held it, in fp32 math: the Megatron backend holds a bf16
            # run's weights in bf16 (as LLaMA-Factory loads the base in its compute dtype), the
            # standard backend in fp32 (transformers' autocast).
            dtype = torch.bfloat16 if config.get("bf16") and megatron else torch.float32
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).float()
            theirs = PeftModel.from_pretrained(base, run).eval()(IDS).logits
        else:
            from transformers import AutoModelForCausalLM

            theirs = AutoModelForCausalLM.from_pretrained(run, dtype=torch.float32).eval()(IDS).logits
    vocab = theirs.shape[-1]
    assert (theirs.float() - ours[..., :vocab]).abs().max() < 1e-5


@pytest.mark.parametrize("backend", ["megatron", "standard"])
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_llama_factory_example_runs_unchanged(setup, tmp_path, example, backend):
    model_dir, data_dir = setup
    _run_example(example, EXAMPLES[example], model_dir, data_dir, tmp_path, backend, nproc=2)


@pytest.mark.parametrize("backend", ["megatron", "standard"])
@pytest.mark.parametrize("example", sorted(LLAMA3_EXAMPLES))
def test_llama3_example_runs_unchanged_on_one_rank(setup, tmp_path, example, backend):
    model_dir, data_dir = setup
    _run_example(example, LLAMA3_EXAMPLES[example], model_dir, data_dir, tmp_path, backend, nproc=1)
