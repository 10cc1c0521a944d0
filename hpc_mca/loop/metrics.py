"""What a run reports: scalars to its trackers (:mod:`.trackers`: TensorBoard, W&B, MLflow), a
progress line per logging step, progress.json.

Only global rank 0 writes. Values arrive already reduced over the job (see ``step.py``).

``<run_dir>/steps.jsonl`` gets one line per optimizer step (step, loss, tokens, grad_norm, lr,
skipped): the exact record that resume and layout-equivalence checks compare; on CUDA also
``max_memory_gib``, the allocator's peak since the process started.

``<run_dir>/progress.json`` is the contract with ``hpc-mca status`` on the login node: a small
JSON object rewritten atomically at every logging step (fields: step, max_steps, loss, lr,
grad_norm, tokens_per_s, eta_s, skipped_iters, eval_loss, updated, plus whatever else
``write_progress`` is given). The figures always belong to the step written with them: a
``step`` written between logging steps (a signal's save, the end of the run, a restart) takes
that step's own loss, LR and gradient norm from its steps.jsonl record, and the throughput and
ETA of the steps since the last logging step; a step whose record is unknown drops them rather
than showing another step's. ``startup_s``, written at this process's first step, is the time
from the rank's start to that step's end: ``hpc-mca resume`` warns when a lead-time signal
would leave less than that to train (:func:`hpc_mca.slurm.timelimit.startup_warning`).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hpc_mca.rundir import EVALS_FILE, PROGRESS_FILE, STEPS_FILE, write_atomic
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
        if enabled:  # the last start's start-up stays known until this one's first step
            self.progress.update(_previous_startup(run_dir))
        self._last: dict[str, Any] = {}
        """The newest steps.jsonl record this process wrote."""
        self._since_log = [0, 0.0, 0]
        """Input tokens, seconds and steps recorded since the last logging step."""

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
        self._since_log = [0, 0.0, 0]
        self.write_progress(step=step, max_steps=self.max_steps, loss=values["train/loss"],
                            lr=values["train/lr"], grad_norm=values["train/grad_norm"],
                            tokens_per_s=values["perf/tokens_per_s"], eta_s=eta,
                            skipped_iters=int(values.get("train/skipped_iters", 0)))

    def record_step(self, **fields: float) -> None:
        """Append one step's numbers to steps.jsonl."""
        if self.enabled:
            with open(self.run_dir / STEPS_FILE, "a", encoding="utf-8") as out:
                out.write(json.dumps(fields) + "\n")
            first = not self._last
            self._last = fields
            tokens, seconds, steps = self._since_log
            self._since_log = [tokens + int(fields.get("input_tokens") or 0),
                               seconds + float(fields.get("seconds") or 0.0), steps + 1]
            started = _process_start()
            if first and started is not None:
                self.write_progress(startup_s=round(time.time() - started, 3))

    def record_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """Append one evaluation to evals.jsonl, under transformers' names (``eval/loss`` is
        ``eval_loss``): the run's outputs (:mod:`.outputs`) list every evaluation from it."""
        if self.enabled:
            record = {"step": step, **{k.replace("/", "_"): v for k, v in metrics.items()}}
            with open(self.run_dir / EVALS_FILE, "a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")

    def write_progress(self, **fields: object) -> None:
        """Merge ``fields`` into progress.json (write to a temp file, then rename). A ``step``
        given without its loss brings that step's own figures (see the module doc)."""
        if not self.enabled:
            return
        step = fields.get("step")
        if isinstance(step, int) and step != self.progress.get("step") and "loss" not in fields:
            fields = {**self._figures_of(step), **fields}
        self.progress.update(fields, updated=time.time())
        write_atomic(self.run_dir / PROGRESS_FILE,
                     json.dumps(self.progress, indent=1, default=_jsonable))

    def _figures_of(self, step: int) -> dict[str, Any]:
        """``step``'s loss, lr, grad_norm, tokens_per_s and eta_s: from this process's record
        of it, else from steps.jsonl (a restart resumes at a checkpoint's step, whose line is
        the file's last); None where unknown, so no other step's figures stay beside it."""
        record = self._last if self._last.get("step") == step else _record_of(self.run_dir, step)
        tokens, seconds, steps = self._since_log if record is self._last else (0, 0.0, 0)
        if record is not None and not steps:  # one step's own time and tokens
            tokens, seconds = int(record.get("input_tokens") or 0), float(record.get("seconds") or 0.0)
            steps = 1 if seconds > 0 else 0
        figures: dict[str, Any] = {key: (record or {}).get(key) for key in ("loss", "lr", "grad_norm")}
        figures["tokens_per_s"] = tokens / seconds if steps and seconds > 0 else None
        figures["eta_s"] = (max(0, self.max_steps - step) * seconds / steps
                            if steps and seconds > 0 else None)
        return figures

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def _record_of(run_dir: Path, step: int, tail_bytes: int = 65536) -> dict[str, Any] | None:
    """``step``'s line in steps.jsonl, looked for in the file's last ``tail_bytes`` only (a
    long run's file is large; the step wanted is the last one written)."""
    try:
        with open(run_dir / STEPS_FILE, "rb") as steps:
            steps.seek(0, os.SEEK_END)
            steps.seek(max(0, steps.tell() - tail_bytes))
            lines = steps.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a partial first line of the tail
        if isinstance(record, dict) and record.get("step") == step:
            return record
    return None


def _previous_startup(run_dir: Path) -> dict[str, Any]:
    """``startup_s`` of the progress file a previous start of the run wrote, if any."""
    try:
        value = json.loads((run_dir / PROGRESS_FILE).read_text()).get("startup_s")
    except (OSError, ValueError, AttributeError):
        return {}
    return {"startup_s": value} if isinstance(value, (int, float)) else {}


def _process_start() -> float | None:
    """This process's start (unix time), or None where psutil cannot tell."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - a missing start time only drops startup_s
        return None


def _jsonable(value: object) -> str | None:
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
