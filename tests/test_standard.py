"""The standard backend (training.use_mca=false): transformers' Trainer on the HF model.

A Llama with weights trains 10 steps on packed SFT rows of 61 slots and packed dpo pairs in
rows of 67, one row per micro-batch: streams of odd length, which Ulysses SP2 pads by a slot:

* the Megatron backend from the same weights gives the same losses, token counts, gradient
  norms and eval figures (sft, dpo and LoRA, whose adapters start from the same seeded draw);
* Ulysses SP2 and SP2×DP2 give SP1's losses (sft, dpo);
* a run resumed from its step-4 checkpoint equals the uninterrupted one (SP2, and LoRA, whose
  checkpoints hold the adapter alone);
* the PEFT and merged exports of a LoRA run give the same logits.

Bad input (one line each, before any process group) is checked on the config alone.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
from trainer_fixtures import (make_model_dir, make_sft_data, rewind, run_ranks, run_train, steps,
                              write_config, write_pairs)

from hpc_mca.trainer.config import ConfigError, load_config

STANDARD = ["training.use_mca=false"]
MEGATRON = ["training.use_mca=true"]
LORA = ["finetuning.finetuning_type=lora", "finetuning.lora_rank=4", "finetuning.lora_target=all",
        "training.export_hf_dir=adapter", "training.export_merged_dir=merged"]
KEYS = {"sft": ("loss", "grad_norm"),
        "dpo": ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                "rewards/margins", "logps/chosen", "logps/rejected")}



@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("standard")
    model = make_model_dir(root, layers=2)
    common = {"training": {"save_steps": 4, "eval_steps": 5, "report_to": ["none"],
                           "per_device_eval_batch_size": 2}}
    for stage in ("sft", "dpo"):
        (root / stage).mkdir()
    sft = write_config(root / "sft", model,
                       make_sft_data(root, 128, seed=1, name="train"),
                       make_sft_data(root, 32, seed=9, name="eval"),
                       data={"sequence_packing": True, "seq_length": 61},
                       training={**common["training"], "per_device_train_batch_size": 1})
    dpo = write_config(root / "dpo", model,
                       write_pairs(root / "pairs.jsonl", 128, 1),
                       write_pairs(root / "pairs_eval.jsonl", 16, 9),
                       finetuning={"stage": "dpo"}, data={"sequence_packing": True, "seq_length": 67},
                       training={**common["training"], "global_batch_size": 4,
                                 "per_device_train_batch_size": 1})
    return {"root": root, "model": model, "sft": sft, "dpo": dpo, "runs": {}}


def _run(setup, stage: str, name: str, nproc: int, *overrides: str):
    """The steps of run ``name`` of ``stage`` (trained once per module)."""
    key = (stage, name)
    if key not in setup["runs"]:
        run_dir = setup["root"] / stage / name
        proc = run_train(setup[stage], run_dir, nproc, *overrides)
        assert proc.returncode == 0, proc.stderr[-4000:]
        setup["runs"][key] = run_dir
    return setup["runs"][key]


def _same(got: list[dict], want: list[dict], keys: tuple[str, ...], tol: float, what: str) -> float:
    """Assert equal steps (counts exactly, ``keys`` within ``tol``); the largest difference."""
    assert [s["step"] for s in got] == list(range(1, 11)), what
    worst = 0.0
    for mine, ref in zip(got, want):
        assert mine.get("tokens") == ref.get("tokens") and mine.get("pairs") == ref.get("pairs")
        assert mine["lr"] == pytest.approx(ref["lr"], rel=1e-12), (what, mine, ref)
        for key in keys:
            worst = max(worst, abs(mine[key] - ref[key]))
            assert mine[key] == pytest.approx(ref[key], abs=tol), (what, key, mine, ref)
    print(f"{what}: largest difference {worst:.2e}")
    return worst


def _timeless(log: list[dict]) -> list[dict]:
    return [{k: v for k, v in step.items() if k != "seconds"} for step in log]


def _progress(run_dir) -> dict:
    return json.loads((run_dir / "progress.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_both_backends_train_the_same_from_the_same_weights(setup, stage):
    """fp32 on the CPU: the 10 losses (and every logged figure) within 1e-5, eval included."""
    standard = _run(setup, stage, "sp1", 1, *STANDARD)
    megatron = _run(setup, stage, "megatron", 1, *MEGATRON)
    _same(steps(standard), steps(megatron), KEYS[stage], 1e-5, f"{stage}: standard vs megatron")
    mine, ref = _progress(standard), _progress(megatron)
    evals = [k for k in ref if k.startswith("eval_")]
    assert evals and {k for k in mine if k.startswith("eval_")} == set(evals)
    for key in evals:
        assert mine[key] == pytest.approx(ref[key], abs=1e-5), key
    assert (standard / "finished").is_file()
    info = json.loads((standard / "checkpoints" / "iter_0000010" / "checkpoint.json").read_text())
    assert info["format"] == "hpc-mca/hf/1"


@pytest.mark.slow
@pytest.mark.parametrize("stage, name, nproc", [("sft", "sp2", 2), ("sft", "sp2dp2", 4),
                                                ("dpo", "sp2", 2)])
def test_ulysses_sequence_parallel_equals_one_process(setup, stage, name, nproc):
    run_dir = _run(setup, stage, name, nproc, *STANDARD, "parallel.sequence_parallel_size=2")
    _same(steps(run_dir), steps(_run(setup, stage, "sp1", 1, *STANDARD)), KEYS[stage], 1e-5,
          f"{stage} {name}")


@pytest.mark.slow
def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(setup):
    """SP2: the step-4 checkpoint (transformers' files, every rank's RNG state) resumed."""
    full = _run(setup, "sft", "sp2", 2, *STANDARD, "parallel.sequence_parallel_size=2")
    resumed = rewind(full, setup["root"] / "sft" / "sp2_resumed", 4)
    shutil.rmtree(resumed / "checkpoints" / "iter_0000008", ignore_errors=True)
    proc = run_train(setup["sft"], resumed, 2, *STANDARD, "parallel.sequence_parallel_size=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout and "at step 4 (32 samples)" in proc.stdout
    assert _timeless(steps(resumed)) == _timeless(steps(full))


@pytest.mark.slow
def test_lora_equals_the_megatron_backend_and_resumes_from_adapter_checkpoints(setup):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    standard = _run(setup, "sft", "lora", 1, *STANDARD, *LORA)
    megatron = _run(setup, "sft", "lora_megatron", 1, *MEGATRON, *LORA)
    _same(steps(standard), steps(megatron), KEYS["sft"], 1e-5, "lora: standard vs megatron")
    saved = standard / "checkpoints" / "iter_0000004"
    assert (saved / "adapter_model.safetensors").is_file()
    assert not (saved / "model.safetensors").exists()  # the frozen base is not saved

    resumed = rewind(standard, setup["root"] / "sft" / "lora_resumed", 4)
    proc = run_train(setup["sft"], resumed, 1, *STANDARD, *LORA)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "at step 4 (32 samples)" in proc.stdout
    assert _timeless(steps(resumed)) == _timeless(steps(standard))

    ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(setup["model"]).eval()
        plain = base(ids).logits
        adapted = PeftModel.from_pretrained(base, standard / "adapter").eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(standard / "merged").eval()(ids).logits
    assert (adapted - merged).abs().max() < 1e-5
    assert (adapted - plain).abs().max() > 1e-3  # the adapter changed the model


@pytest.mark.slow
def test_non_finite_gradients_skip_the_update(setup, tmp_path):
    """A user callback poisons one gradient before step 2's optimizer step: that step is
    skipped (no update, the LR schedule stays), counted, and the run goes on."""
    script = tmp_path / "poison.py"
    script.write_text(
        "import sys\n"
        "from transformers import TrainerCallback\n"
        "from hpc_mca.trainer.run import run_training\n"
        "class Poison(TrainerCallback):\n"
        "    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):\n"
        "        if state.global_step == 1:\n"
        "            next(model.parameters()).grad[0, 0] = float('nan')\n"
        "run_training(sys.argv[1], sys.argv[2:], callbacks=[Poison()])\n")
    run_dir = tmp_path / "run"
    proc = run_ranks(1, [script, setup["sft"], f"training.output_dir={run_dir}", *STANDARD,
                         "training.max_steps=4", "training.logging_steps=1",
                         "data.eval_dataset=null"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = steps(run_dir)
    assert [r["skipped"] for r in records] == [False, True, False, False]
    assert records[1]["lr"] == records[0]["lr"] and records[2]["lr"] != records[1]["lr"]
    assert all(math.isfinite(r["loss"]) for r in records) and math.isnan(records[1]["grad_norm"])
    assert "skipped 1" in proc.stdout
    info = json.loads((run_dir / "checkpoints" / "iter_0000004" / "checkpoint.json").read_text())
    assert info["skipped_iters"] == 1


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tensor_model_parallel_size=2"],
     "parallel.tensor_model_parallel_size=2 with training.use_mca=false: the standard backend "
     "keeps a whole model on every rank (data and Ulysses sequence parallelism only); valid: 1, "
     "or training.use_mca=true"),
    (["parallel.sequence_parallel_size=3"],
     "parallel.sequence_parallel_size=3 must divide the world size 4, num_attention_heads=4 and "
     "num_key_value_heads=2 (Ulysses splits heads over the ranks); valid: 1, 2"),
    (["parallel.sequence_parallel_size=4"], "num_key_value_heads=2"),
    (["training.optim=sgd"], "training.optim='sgd' with training.use_mca=false: the standard "
                             "backend's optimizer is torch's AdamW; valid: 'adam', or "
                             "training.use_mca=true"),
    (["parallel.calculate_per_token_loss=false"], "calculate_per_token_loss=False"),
])
def test_bad_standard_backend_settings_are_one_line(tmp_path, overrides, message):
    model = make_model_dir(tmp_path, layers=1)
    config = write_config(tmp_path, model, make_sft_data(tmp_path, 8, seed=1, name="train"))
    with pytest.raises(ConfigError) as err:
        load_config(config, [*STANDARD, *overrides]).resolve(world_size=4)
    assert "\n" not in str(err.value) and message in str(err.value)


def test_an_unknown_backend_option_is_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["training.use_mca=maybe"])
    assert str(err.value) == "training.use_mca='maybe' must be true or false"


def test_the_standard_backend_refuses_moe_models(tmp_path):
    model = make_model_dir(tmp_path, layers=1, moe=True)
    config = write_config(tmp_path, model, make_sft_data(tmp_path, 8, seed=1, name="train"))
    with pytest.raises(ConfigError, match="is a mixture of experts .qwen3_moe. with "
                                          "training.use_mca=false: the standard backend trains "
                                          "dense models only"):
        load_config(config, STANDARD).resolve(world_size=1)
