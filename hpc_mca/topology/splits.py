"""What the planner's search enumerates: the TP·PP·CP·EP·DP splits of a world that pass the
cheap arithmetic rules, and each split's micro-batch sizes and interleaving depths
(topology/search.py sizes, times and ranks them)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from .layout import Layout, balanced_pipeline_layout, divisors
from .model import ModelShape
from .rules import seq_alignment

if TYPE_CHECKING:
    from .planner import PlanRequest

# Beyond ~8k tokens per micro-batch the GEMMs are already large; more only costs memory.
MAX_MICRO_BATCH_TOKENS = 8192
# The deepest interleaving tried (published recipes go to 24 chunks of one layer each); the
# cost model weighs each chunk's extra point-to-point traffic against the smaller bubble.
MAX_VIRTUAL_STAGES = 24


def candidates(req: PlanRequest, world: int) -> Iterator[Layout]:
    """Resolved TP·PP·CP·EP·DP splits that pass the cheap arithmetic rules."""
    model = req.shape
    for tp in (t for t in divisors(req.node_size) if world % t == 0):
        for pp, stages in _pipeline_options(model.num_layers, world // tp):
            for cp in divisors(world // (tp * pp)):
                if req.max_context_parallel is not None and cp > req.max_context_parallel:
                    continue
                if req.seq_length % seq_alignment(cp, tp, tp > 1):
                    continue
                dp = world // (tp * pp * cp)
                if req.global_batch_size % ((req.micro_batch_size or 1) * dp):
                    continue
                for ep in _expert_parallel_options(model, tp * cp * dp):
                    yield Layout(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, pipeline_layout=stages)


def _pipeline_options(num_layers: int, ranks: int) -> Iterator[tuple[int, tuple[int, ...] | None]]:
    """PP sizes dividing ``ranks``: even splits, else a balanced explicit layout (which is how
    e.g. 126 layers go on 8 or 16 stages)."""
    for pp in divisors(ranks):
        if pp > num_layers:
            return
        if num_layers % pp == 0:
            yield pp, None
        elif (stages := balanced_pipeline_layout(num_layers, pp)) is not None:
            yield pp, stages


def _expert_parallel_options(model: ModelShape, stage_ranks: int) -> list[int]:
    if not model.is_moe:
        return [1]
    return [e for e in divisors(model.num_experts) if stage_ranks % e == 0]


def micro_batch_options(req: PlanRequest, layout: Layout) -> list[int]:
    """The forced micro-batch, else powers of two up to MAX_MICRO_BATCH_TOKENS tokens that
    divide the global batch per DP rank (always 1)."""
    if req.micro_batch_size is not None:
        return [req.micro_batch_size]
    sizes, mbs, dp = [1], 2, layout.dp or 1
    while mbs * req.seq_length <= MAX_MICRO_BATCH_TOKENS and req.global_batch_size % (mbs * dp) == 0:
        sizes.append(mbs)
        mbs *= 2
    return sizes


def virtual_options(num_layers: int, layout: Layout) -> Iterator[Layout]:
    """Interleaved versions of ``layout`` up to MAX_VIRTUAL_STAGES chunks a rank, fewest
    first. An even pipeline stays even; an uneven one gets a balanced layout over PP·VP
    stages (at least one layer each)."""
    if layout.pp == 1:
        return
    for vp in range(2, min(MAX_VIRTUAL_STAGES, num_layers // layout.pp) + 1):
        stages = layout.pp * vp
        if layout.pipeline_layout is None:
            if num_layers % stages == 0:
                yield replace(layout, vp=vp)
            continue
        chunks = balanced_pipeline_layout(num_layers, stages)
        if chunks is not None:
            yield replace(layout, vp=vp, pipeline_layout=chunks)
