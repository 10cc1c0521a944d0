"""What a run reports: scalars to its trackers (:mod:`.trackers`: TensorBoard, W&B, MLflow), a
progress line per logging step, progress.json.

Only global rank 0 writes. Values arrive already reduced over the job (see ``step.py``).

``<run_dir>/steps.jsonl`` gets one line per optimizer step (step, loss, tokens, grad_norm, lr,
skipped): the exact record that resume and layout-equivalence checks compare.

``<run_dir>/progress.json`` is the contract with ``hpc-mca status`` on the login node: a small
JSON object rewritten atomically at every logging step (fields: step, max_steps, loss, lr,
grad_norm, tokens_per_s, eta_s, skipped_iters, eval_loss, updated, plus whatever else
``write_progress`` is given).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from hpc_mca.rundir import PROGRESS_FILE, STEPS_FILE, write_atomic
from hpc_mca.topology import ModelShape

from .trackers import Tracker

# Dense bf16 peak TFLOP/s per GPU model, for the MFU estimate (vendor data sheets, no sparsity).
_PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0,
                "B200": 2250.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
"""Dense bf16 TFLOP/s by device-name fragment, first match wins (PCIe/NVL before plain H100)."""


def flops_per_token(model: ModelShape, seq_length: int) -> float:
    """Training FLOPs per token, PaLM's MFU convention: 6 per active weight (a multiply-add
    forward, two backward) plus 12 × layers × heads × head_dim × seq_length for the attention
    scores (QK^T and AV over the whole sequence: causal masking is not subtracted)."""
    h, layers = model.hidden_size, model.num_layers
    head_dim = model.kv_channels
    attn = h * head_dim * (model.num_attention_heads * 2 + model.num_query_groups * 2)
    if model.is_moe:
        mlp = 3 * h * model.expert_ffn_hidden_size * model.moe_router_topk
    else:
        mlp = 3 * h * model.ffn_hidden_size
    weights = layers * (attn + mlp) + h * model.vocab_size
    scores = layers * 2 * model.num_attention_heads * head_dim * seq_length
    return 6.0 * weights + 6.0 * scores


def peak_flops_per_device() -> float | None:
    """Peak FLOP/s of one device, or None when unknown (CPU). HPC_MCA_PEAK_TFLOPS overrides."""
    override = os.environ.get("HPC_MCA_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    if not torch.cuda.is_available():
        return None
    return peak_flops_of(torch.cuda.get_device_name())


def peak_flops_of(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the device called ``device_name``; None when not in the table."""
    for key, tflops in _PEAK_TFLOPS.items():
        if key in device_name:
            return tflops * 1e12
    return None


class MetricsWriter:
    """TensorBoard + console + progress.json on rank 0; a no-op elsewhere."""

    def __init__(self, run_dir: Path, enabled: bool, trackers: Sequence[Tracker], max_steps: int,
                 flops_per_token: float, world_size: int) -> None:
        self.run_dir, self.enabled, self.max_steps = run_dir, enabled, max_steps
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.peak = peak_flops_per_device()
        self.trackers = list(trackers) if enabled else []
        self.progress: dict[str, Any] = {}

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """``values`` at ``step`` to every tracker (:mod:`.trackers`)."""
        for tracker in self.trackers:
            tracker.scalars(step, values)

    def throughput(self, tokens_per_s: float) -> dict[str, float]:
        out = {"perf/tokens_per_s": tokens_per_s}
        if self.peak:
            out["perf/mfu"] = tokens_per_s * self.flops_per_token / (self.peak * self.world_size)
        return out

    def progress_line(self, step: int, values: dict[str, float], step_time: float) -> None:
        if not self.enabled:
            return
        eta = (self.max_steps - step) * step_time
        parts = [f"step {step}/{self.max_steps}", f"loss {values['train/loss']:.4f}",
                 f"lr {values['train/lr']:.3e}", f"grad_norm {values['train/grad_norm']:.3f}",
                 f"tok/s {values['perf/tokens_per_s']:.0f}"]
        parts += [f"mtp{key.rsplit('_', 1)[1]} {value:.4f}" for key, value in values.items()
                  if key.startswith("train/mtp_loss_")]
        if "train/rewards/accuracies" in values:  # dpo
            parts += [f"reward_acc {values['train/rewards/accuracies']:.3f}",
                      f"margin {values['train/rewards/margins']:.4f}"]
        if "perf/mfu" in values:
            parts.append(f"mfu {100 * values['perf/mfu']:.1f}%")
        if values.get("train/skipped_iters"):
            parts.append(f"skipped {int(values['train/skipped_iters'])}")
        parts.append(f"eta {_duration(eta)}")
        print(" | ".join(parts), flush=True)
        self.write_progress(step=step, max_steps=self.max_steps, loss=values["train/loss"],
                            lr=values["train/lr"], grad_norm=values["train/grad_norm"],
                            tokens_per_s=values["perf/tokens_per_s"], eta_s=eta,
                            skipped_iters=int(values.get("train/skipped_iters", 0)))

    def record_step(self, **fields: Any) -> None:
        """Append one step's numbers to steps.jsonl."""
        if self.enabled:
            with open(self.run_dir / STEPS_FILE, "a", encoding="utf-8") as out:
                out.write(json.dumps(fields) + "\n")

    def write_progress(self, **fields: Any) -> None:
        """Merge ``fields`` into progress.json (write to a temp file, then rename)."""
        if not self.enabled:
            return
        self.progress.update(fields, updated=time.time())
        write_atomic(self.run_dir / PROGRESS_FILE,
                     json.dumps(self.progress, indent=1, default=_jsonable))

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def _jsonable(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
