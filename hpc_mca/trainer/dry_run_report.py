"""A plan's dry run (:mod:`.dry_run`) beside the planner's estimate, rank by rank, and the
refusal of a layout whose real static bytes plus the estimated activations do not fit."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpc_mca.config.sections import FinetuningArguments, ParallelArguments, TrainingArguments
from hpc_mca.topology import LayoutError
from hpc_mca.topology.memory import MemoryEstimate, rank_memory
from hpc_mca.topology.planner import Plan
from hpc_mca.topology.search import memory_workload, workload
from hpc_mca.trainer.dry_run import RankBytes, default_ranks, dry_run

__all__ = ["dry_run_plan", "format_rank"]

_GIB = 1 << 30


def dry_run_plan(plan: Plan, *, ranks: list[int] | None = None,
                 finetuning: FinetuningArguments | None = None) -> str:
    """Dry-run ``plan``'s ``ranks`` (default: the first and last pipeline stage's) and return
    the comparison table. Raises LayoutError (one line) when a rank's static bytes plus the
    planner's activations exceed the GPU's usable memory, or the trainer's own error."""
    req, layout = plan.request, plan.layout
    world = req.world_size
    if req.backend != "megatron":
        raise LayoutError(f"--dry-run builds the Megatron trainer's model; this plan is for the "
                          f"{req.backend!r} backend; valid: a Megatron plan")
    for rank in ranks or []:
        if not 0 <= rank < world:
            raise LayoutError(f"--rank {rank} is outside the planned world of {world} ranks; "
                              f"valid: 0..{world - 1}")
    source: str | Path | Mapping[str, Any]
    if isinstance(req.model, (str, os.PathLike)):
        source = Path(req.model)
    elif isinstance(req.model, Mapping):
        source = req.model
    else:
        raise LayoutError("--dry-run needs the model's HF config (--model DIR|config.json or a "
                          "config's model_name_or_path); valid: an HF model directory")
    training = TrainingArguments(bf16=req.precision in ("bf16", "fp8"), fp16=req.precision == "fp16",
                                 per_device_train_batch_size=plan.micro_batch_size)
    parallel = ParallelArguments(use_distributed_optimizer=plan.use_distributed_optimizer,
                                 sequence_parallel=plan.sequence_parallel)
    work = memory_workload(req, workload(req, layout, plan.micro_batch_size, plan.recompute))
    overrides = {"mtp_num_layers": req.mtp_num_layers} if req.mtp_num_layers else {}
    if finetuning is None and not req.lora:  # --model without a run config: the planned stage
        finetuning = FinetuningArguments(stage=req.stage, use_ref_model=req.reference)
    blocks = []
    for rank in ranks or default_ranks(layout, world):
        got = dry_run(source, replace(layout, dp=None), world, rank, training=training,
                      parallel=parallel, finetuning=finetuning, seq_length=req.seq_length,
                      model_overrides=overrides, global_batch_size=req.global_batch_size)
        estimate = rank_memory(req.shape, layout, work, got.pipeline_rank)
        blocks.append(format_rank(got, estimate, layout.pp))
        total = got.static + estimate.activations
        if total > plan.usable_bytes:
            raise LayoutError(
                f"rank {rank} (pipeline stage {got.pipeline_rank}) needs {total / _GIB:.1f} GiB "
                f"({got.static / _GIB:.1f} GiB built by the dry run + {estimate.activations / _GIB:.1f}"
                f" GiB estimated activations) of {plan.usable_bytes / _GIB:.1f} GiB usable; valid: "
                "a layout that fits (more TP/PP/EP, recompute, a smaller micro-batch)")
    return "\n".join(blocks)


def format_rank(got: RankBytes, estimate: MemoryEstimate, pp: int) -> str:
    """One rank's terms: the dry run's bytes, the planner's, their difference."""
    rows = [("params", sum(got.params.values()), estimate.params),
            ("grads", sum(got.grads.values()), estimate.grads),
            ("optimizer", got.optimizer, estimate.optimizer),
            ("static", got.static, estimate.params + estimate.grads + estimate.optimizer)]
    lines = [f"dry run  rank {got.rank} (pipeline stage {got.pipeline_rank} of {pp}), built in "
             f"{got.seconds:.1f} s",
             f"  {'term':<12}{'built':>12}{'planner':>12}{'difference':>20}"]
    for name, built, planned in rows:
        share = f"{(planned - built) / built:+.2%}" if built else "n/a"
        lines.append(f"  {name:<12}{_gib(built):>12}{_gib(planned):>12}"
                     f"{(planned - built) / (1 << 20):>+12.1f} MiB ({share})")
    lines.append(f"  {'activations':<12}{'':>12}{_gib(estimate.activations):>12}"
                 "  (the planner's estimate: the dry run runs no step)")
    lines.append(f"  {'total':<12}{_gib(got.static + estimate.activations):>12}")
    by_dtype = {"params": got.params, "grads": got.grads, "master": got.master,
                "moments": got.moments}
    lines.append("  by dtype    " + "; ".join(
        f"{term} " + ", ".join(f"{dtype} {_gib(n)}" for dtype, n in sorted(parts.items()))
        for term, parts in by_dtype.items() if parts))
    return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / _GIB:.3f} GiB"
