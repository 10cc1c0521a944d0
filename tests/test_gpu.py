"""One-GPU checks, run with ``pytest -m gpu`` on a machine with CUDA (skipped elsewhere; the
CPU suite hides CUDA, see conftest): the Megatron model in bf16 against transformers in bf16,
and a short bf16 training run of the bundled demo on the GPU's fast paths.

The bf16 tolerance calibrates itself: against the fp32 transformers logits, our bf16 logits
may be off by at most twice what transformers' own bf16 logits are (plus 1e-2), since two
correct bf16 implementations differ by rounding order, not by a fixed amount.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "hpc_mca" / "assets" / "demo"
WORKER = Path(__file__).with_name("models_worker.py")

pytestmark = pytest.mark.gpu


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(HPC_MCA_DIST_TIMEOUT="120", PYTHONWARNINGS="ignore")
    return env


NEW_FAMILIES = ["qwen2_moe", "glm4_moe", "deepseek_v3"]


@pytest.mark.parametrize("family,config_class,overrides", [
    ("llama", "LlamaConfig", dict(vocab_size=200)),
    ("qwen3_moe", "Qwen3MoeConfig", dict(vocab_size=160, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32)),
])
def test_bf16_logits_match_transformers_bf16(tmp_path, family, config_class, overrides):
    import transformers

    config = getattr(transformers, config_class)(
        num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, max_position_embeddings=256, **overrides)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path / family)
    _check_bf16_logits(tmp_path, family, hf)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_new_family_bf16_logits_match_transformers_bf16(tmp_path, family):
    """tests/test_models.py's tiny qwen2_moe, glm4_moe and deepseek_v3 (shared experts,
    sigmoid-routed groups, multi-latent attention), in bf16 on the GPU."""
    import transformers
    from trainer_fixtures import make_family_dir

    model_dir = make_family_dir(tmp_path / family, family)
    _check_bf16_logits(tmp_path, family, transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval())


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_new_family_trains_in_bf16(tmp_path, family):
    """Four bf16 sft steps of each new family on the GPU: every loss and gradient norm finite."""
    from trainer_fixtures import make_family_dir, make_sft_data, write_config

    data = make_sft_data(tmp_path, 64, seed=1, name="train")
    config = write_config(tmp_path, make_family_dir(tmp_path / family, family), data,
                          data={"cutoff_len": 64, "sequence_packing": True},
                          training={"max_steps": 4, "bf16": True, "report_to": ["none"]})
    run_dir = tmp_path / "run"
    records = _four_finite_steps([str(config), f"training.output_dir={run_dir}"], run_dir)
    assert all(r["max_memory_gib"] > 0 for r in records)  # the GPU's own figure, per step


def _four_finite_steps(train_args: list[str], run_dir: Path) -> list[dict]:
    """``hpc-mca train TRAIN_ARGS`` on the GPU, which must end well with four step records in
    ``run_dir``, every loss and gradient norm finite; the records."""
    proc = subprocess.run([sys.executable, "-m", "hpc_mca", "train", *train_args],
                          env=_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(records) == 4
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    return records


def _check_bf16_logits(tmp_path: Path, family: str, hf: torch.nn.Module) -> None:
    """Our bf16 logits (tests/models_worker.py on the GPU) within twice transformers' own bf16
    error of the fp32 logits, plus 1e-2."""
    config = hf.config
    inputs = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    torch.save(inputs, tmp_path / "inputs.pt")
    with torch.no_grad():
        exact = hf.cuda()(inputs.cuda()).logits.float().cpu()
        hf_bf16 = hf.to(torch.bfloat16)(inputs.cuda()).logits.float().cpu()
    job = {"name": "cuda", "layout": {}, "models": [family], "dtype": "bfloat16"}
    proc = subprocess.run([sys.executable, "-W", "ignore", str(WORKER), str(tmp_path),
                           str(tmp_path / "out"), json.dumps([job])],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ours = torch.load(tmp_path / "out" / "cuda" / f"{family}.logits.pt").float()
    theirs_error = (hf_bf16 - exact).abs().max().item()
    our_error = (ours - exact).abs().max().item()
    assert our_error <= 2 * theirs_error + 1e-2, (our_error, theirs_error)


def test_one_gpu_bf16_demo_trains_on_the_fused_paths(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "hpc_mca", "train", str(DEMO / "sft_addition.yaml"),
         f"training.output_dir={run_dir}", "max_steps=60", "logging_steps=20", "bf16=true",
         "eval_steps=60", "save_steps=60"],
        env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (run_dir / "finished").exists()
    from hpc_mca.models.packed_kernels import varlen_available

    expected = "varlen" if varlen_available() else "flex"
    assert f"packed kernel {expected}" in proc.stdout, proc.stdout[-3000:]
    # model.fusions unset: compiled layers and the fused cross-entropy, the fastest measured
    assert "decoder layers: torch.compile" in proc.stdout, proc.stdout[-3000:]
    records = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == 60 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-10:]) < sum(losses[:10])  # it learns


def test_pinned_host_memory_is_registered_by_threads():
    """The allocator setting every GPU rank adds (hpc_mca.runtime.host_memory) is one torch
    accepts: a non-blocking copy to the host lands in pinned memory, bit for bit."""
    code = ("from hpc_mca.runtime.host_memory import register_pinned_host_memory as r; r(); "
            "import torch; x = torch.randn(1 << 26, device='cuda'); "
            "y = x.to('cpu', non_blocking=True); torch.cuda.synchronize(); "
            "assert y.is_pinned() and torch.equal(x.cpu(), y); print('pinned ok')")
    env = {k: v for k, v in _env().items() if not k.startswith("PYTORCH_")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "pinned ok" in proc.stdout, proc.stderr[-2000:]


def test_the_pinned_memory_seconds_a_save_reports_fit_inside_the_copy_that_made_them():
    """A save's "of which new pinned host memory" figure (torch's allocation timer, read by
    hpc_mca.runtime.host_memory.pinned_host_seconds) checked against a second clock: creating
    the blocks of a first staging takes some time, and no more than the whole copy took by the
    wall clock; a second staging reuses the cached blocks and creates none."""
    code = ("import time, torch; from hpc_mca.runtime.host_memory import pinned_host_seconds as p; "
            "x = [torch.randn(1 << 26, device='cuda') for _ in range(4)]; torch.cuda.synchronize()\n"
            "for _ in range(2):\n"
            "    b = p(); t = time.perf_counter(); y = [v.to('cpu', non_blocking=True) for v in x]\n"
            "    torch.cuda.synchronize(); print(time.perf_counter() - t, p() - b); del y")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (first_wall, first_alloc), (_, second_alloc) = (
        map(float, line.split()) for line in proc.stdout.split("\n")[:2])
    assert 0 < first_alloc <= first_wall, (first_alloc, first_wall)
    assert second_alloc == 0


@pytest.mark.parametrize("backend", ["megatron", "standard"])
def test_vl_demo_trains_in_bf16(tmp_path, backend):
    """Four bf16 LoRA sft steps of the vision-language demo (a tiny Qwen2-VL, images of the
    bundled shapes data) on the GPU, on each backend: every loss and gradient norm finite."""
    run_dir = tmp_path / "run"
    _four_finite_steps([str(REPO / "hpc_mca" / "assets" / "demo_vl" / "sft_shapes.yaml"),
                        "max_steps=4", "logging_steps=1", "bf16=true", "report_to=none",
                        f"use_mca={'true' if backend == 'megatron' else 'false'}",
                        f"output_dir={run_dir}"], run_dir)
