"""LoRA on Megatron layers: what a user checks against peft on the transformers model.

A Llama with weights trains 6 SFT steps of LoRA (rank 4, every linear) on one process; its
exported PEFT adapter, loaded by ``peft.PeftModel.from_pretrained`` onto the transformers
model, and its merged HF export give the trained model's logits; the base weights are
untouched; the trainable parameters are peft's. TP2, PP2 and DP2 (distributed optimizer) train
the same curve, and their exports are the same adapter. A Qwen3-MoE with adapters on its
experts does the same on EP2, and a DeepSeek-V3 (multi-latent attention, a dense first layer,
shared and routed experts) with every target on TP2 with sequence parallelism.
A step-3 adapter checkpoint resumes on TP2 to the uninterrupted curve, holds only the
adapters, and refuses another base model in one line. dpo's reference under LoRA is the base
model: the same reference log-probabilities as a full dpo run's frozen copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_fixtures import (
    make_family_dir,
    make_model_dir,
    make_sft_data,
    rewind,
    run_ranks,
    run_train,
    steps,
    write_config,
)

WORKER = Path(__file__).with_name("lora_worker.py")
LORA = {"finetuning_type": "lora", "lora_rank": 4}
TRAIN = {"learning_rate": 5e-3, "max_steps": 6, "save_steps": 3, "export_hf_dir": "adapter",
         "export_merged_dir": "merged"}
IDS = [[(i + 12 * row) % 40 + 3 for i in range(12)] for row in range(2)]  # lora_worker's input


def _worker(config: Path, run: Path, out: Path, nproc: int, *overrides: str) -> None:
    proc = run_ranks(nproc, [WORKER, out, config, f"training.output_dir={run}", *overrides])
    assert proc.returncode == 0, proc.stderr[-4000:]


def _peft_logits(model_dir: Path, adapter: Path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return PeftModel.from_pretrained(base, adapter).eval()(torch.tensor(IDS)).logits


def _hf_logits(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(
            torch.tensor(IDS)).logits


def _ours(out: Path, vocab: int):
    import torch

    return torch.load(out / "logits.pt")[..., :vocab]


def _peft_trainable(model_dir: Path, **targets) -> int:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **targets)).get_nb_trainable_parameters()[0]


def _same_curve(got: list[dict], want: list[dict], what: str) -> None:
    assert [s["step"] for s in got] == [s["step"] for s in want], what
    for mine, ref in zip(got, want):
        for key in ("loss", "grad_norm"):
            assert mine[key] == pytest.approx(ref[key], abs=1e-5), (what, key, mine, ref)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = make_model_dir(root)
    config = write_config(root, model, make_sft_data(root, 200, 1, "train"), finetuning=LORA,
                          training=TRAIN)
    _worker(config, root / "one", root / "out_one", 1)
    return root, model, config


@pytest.mark.slow
def test_exports_give_the_trained_logits_and_the_base_is_untouched(dense):
    root, model, _ = dense
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ours = _ours(root / "out_one", vocab)
    assert (_hf_logits(model) - ours).abs().max() > 0.1  # the adapters changed the model
    assert (_peft_logits(model, root / "one" / "adapter") - ours).abs().max() < 1e-5
    assert (_hf_logits(root / "one" / "merged") - ours).abs().max() < 1e-5
    result = json.loads((root / "out_one" / "result.json").read_text())
    assert result["frozen_unchanged"]
    all_linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert result["trainable"] == _peft_trainable(model, target_modules=all_linear) == 16384
    config = json.loads((root / "one" / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert sorted(config["target_modules"]) == sorted(all_linear)


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", [
    ("tp2", ["parallel.tensor_model_parallel_size=2"]),
    ("pp2", ["parallel.pipeline_model_parallel_size=2"]),
    ("dp2", ["training.per_device_train_batch_size=4", "parallel.use_distributed_optimizer=true"]),
])
def test_parallel_layouts_equal_one_process(dense, name, overrides):
    root, model, config = dense
    _worker(config, root / name, root / f"out_{name}", 2, *overrides)
    _same_curve(steps(root / name), steps(root / "one"), name)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ours = _ours(root / "out_one", vocab)
    assert (_ours(root / f"out_{name}", vocab) - ours).abs().max() < 1e-5
    assert (_peft_logits(model, root / name / "adapter") - ours).abs().max() < 1e-5


@pytest.mark.slow
def test_adapter_checkpoint_resumes_on_another_layout_and_holds_only_adapters(dense):
    root, _, config = dense
    run = rewind(root / "one", root / "resumed", 3)
    proc = run_train(config, run, 2, "parallel.tensor_model_parallel_size=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout and "tp 1->2" in proc.stdout
    _same_curve(steps(run), steps(root / "one"), "resumed")
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(root / "one" / "checkpoints" / "iter_0000003")).read_metadata()
    model_keys = [k for k in metadata.state_dict_metadata if not k.startswith("optimizer")]
    tensors = [k for k in model_keys
               if isinstance(getattr(metadata.state_dict_metadata[k], "size", None), torch.Size)]
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors), tensors
    info = json.loads((root / "one" / "checkpoints" / "iter_0000003" / "checkpoint.json").read_text())
    assert info["training"]["base_model"]["fingerprint"]


@pytest.mark.slow
def test_another_base_model_is_refused_in_one_line(dense, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    root, model, config = dense
    other = tmp_path / "other"  # the same shape and config, other weights (a "fine-tune")
    shutil.copytree(model, other)
    weights = load_file(other / "model.safetensors")
    save_file({k: v + 1e-3 for k, v in weights.items()}, other / "model.safetensors",
              metadata={"format": "pt"})
    run = rewind(root / "one", tmp_path / "run", 3)
    proc = run_train(config, run, 1, f"model.model_name_or_path={other}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpc-mca train: error")]
    assert len(errors) == 1 and "has other weights than the base model the LoRA adapters" in errors[0]


@pytest.mark.slow
def test_moe_experts_on_expert_parallel(tmp_path):
    """Adapters on the experts (peft's target_parameters on the transformers side), EP2."""
    model = make_model_dir(tmp_path, moe=True)
    config = write_config(tmp_path, model, make_sft_data(tmp_path, 200, 1, "train"),
                          finetuning=LORA, training={**TRAIN, "save_steps": 6})
    _worker(config, tmp_path / "one", tmp_path / "out_one", 1)
    _worker(config, tmp_path / "ep2", tmp_path / "out_ep2", 2, "parallel.expert_model_parallel_size=2")
    _same_curve(steps(tmp_path / "ep2"), steps(tmp_path / "one"), "ep2")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ours = _ours(tmp_path / "out_one", vocab)
    for run in ("one", "ep2"):
        assert (_peft_logits(model, tmp_path / run / "adapter") - ours).abs().max() < 1e-5, run
    assert (_hf_logits(tmp_path / "ep2" / "merged") - ours).abs().max() < 1e-5
    result = json.loads((tmp_path / "out_ep2" / "result.json").read_text())
    peft = _peft_trainable(model, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    assert result["trainable"] == peft and result["frozen_unchanged"]


@pytest.mark.slow
def test_mla_and_experts_on_tensor_and_sequence_parallel(tmp_path):
    """lora_target all on DeepSeek-V3: every MLA projection (the down projections split over
    TP by rows too; target_modules) and the routed experts (target_parameters; the dense
    layer's MLP and the shared expert take none): TP2 with sequence parallelism trains one
    process's curve, and peft loads both adapters onto the transformers model with the
    trained logits."""
    model = make_family_dir(tmp_path / "deepseek", "deepseek_v3")
    config = write_config(tmp_path, model, make_sft_data(tmp_path, 200, 1, "train"),
                          finetuning=LORA, training={**TRAIN, "save_steps": 6})
    _worker(config, tmp_path / "one", tmp_path / "out_one", 1)
    _worker(config, tmp_path / "tp2", tmp_path / "out_tp2", 2, "parallel.tensor_model_parallel_size=2",
            "parallel.sequence_parallel=true")  # (MoE layers need it under TP)
    _same_curve(steps(tmp_path / "tp2"), steps(tmp_path / "one"), "tp2")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ours = _ours(tmp_path / "out_one", vocab)
    assert (_hf_logits(model) - ours).abs().max() > 0.01  # the adapters changed the model
    for run in ("one", "tp2"):
        assert (_peft_logits(model, tmp_path / run / "adapter") - ours).abs().max() < 1e-5, run
    modules = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    written = json.loads((tmp_path / "one" / "adapter" / "adapter_config.json").read_text())
    assert sorted(written["target_modules"]) == sorted(modules)
    result = json.loads((tmp_path / "out_tp2" / "result.json").read_text())
    peft = _peft_trainable(model, target_modules=modules,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    assert result["trainable"] == peft and result["frozen_unchanged"]


@pytest.mark.slow
def test_dpo_reference_is_the_base_model(tmp_path):
    """rewards = β·(policy − reference): the reference log-probabilities a LoRA dpo run uses
    (its base, adapters off) equal those of a full dpo run's frozen copy, step by step."""
    from hpc_mca.data.addition import make_problems, preference_record

    model = make_model_dir(tmp_path)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(preference_record(a, b)) + "\n"
                             for a, b in make_problems(64, seed=1)))
    config = write_config(tmp_path, model, pairs, finetuning={"stage": "dpo"},
                          training={"learning_rate": 5e-3, "max_steps": 5, "global_batch_size": 4,
                                    "warmup_steps": 0})
    for name, tuning in (("lora", ["finetuning.finetuning_type=lora", "finetuning.lora_rank=4"]),
                         ("full", [])):  # (lora_rank would be refused on the full run)
        proc = run_train(config, tmp_path / name, 1, *tuning)
        assert proc.returncode == 0, proc.stderr[-4000:]
    lora, full = steps(tmp_path / "lora"), steps(tmp_path / "full")
    assert lora[0]["loss"] == pytest.approx(0.693147, abs=1e-6)
    assert any(abs(s["rewards/margins"]) > 1e-4 for s in lora[1:])  # the policy moved
    for mine, ref in zip(lora, full):
        for side in ("chosen", "rejected"):
            reference = mine[f"logps/{side}"] - mine[f"rewards/{side}"] / 0.1
            assert reference == pytest.approx(ref[f"logps/{side}"] - ref[f"rewards/{side}"] / 0.1,
                                              abs=1e-4)


@pytest.mark.slow
def test_bf16_keeps_float32_adapters_and_resumes_exactly(dense, tmp_path):
    """bf16 with the distributed optimizer (the rules require it with LoRA): the adapters train
    and are checkpointed in float32, and a resume gives the uninterrupted run's steps."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    root, _, config = dense
    extra = ["training.bf16=true", "parallel.use_distributed_optimizer=true"]
    proc = run_train(config, tmp_path / "bf16", 1, *extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metadata = FileSystemReader(str(tmp_path / "bf16" / "checkpoints" / "iter_0000003")).read_metadata()
    dtypes = {v.properties.dtype for k, v in metadata.state_dict_metadata.items()
              if ".lora_" in k and not k.startswith("optimizer")}
    assert dtypes == {torch.float32}
    run = rewind(tmp_path / "bf16", tmp_path / "resumed", 3)
    proc = run_train(config, run, 1, *extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed, whole = steps(run), steps(tmp_path / "bf16")
    assert [s["step"] for s in resumed] == [s["step"] for s in whole] == list(range(1, 7))
    for mine, ref in zip(resumed[3:], whole[3:]):
        assert (mine["loss"], mine["grad_norm"]) == (ref["loss"], ref["grad_norm"]), (mine, ref)
