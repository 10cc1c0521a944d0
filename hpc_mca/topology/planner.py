"""plan(): choose a layout, micro-batch size and recompute policy that fit memory.

Strategy, in order of preference (each step only when the previous cannot fit):

1. no activation recompute (selective first when flash attention is off), then full recompute;
2. the least model parallelism TP·PP·CP, so the most GPUs do cheap data parallelism;
3. for equal TP·PP·CP: TP as large as possible (it stays inside a node on NVLink), then PP
   before CP (PP splits weights, CP only splits activations, which matters for long sequences);
4. for MoE, the smallest EP that fits (EP reuses data-parallel ranks, so it costs no DP).

A PP size that does not divide the layers gets a balanced explicit ``pipeline_layout``. On the
chosen layout the micro-batch then grows while it holds at most 8k tokens, and a pipeline is
interleaved (VP chunks of >= 4 layers) until its bubble is under 5%. Every candidate goes
through check_layout before it is returned, so the planner never emits a layout the rules
reject.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import LayoutError, raise_if
from .hardware import GPU_PRESETS, GiB, GpuSpec, get_gpu
from .layout import FIELD_NAMES, Layout, balanced_pipeline_layout, divisors
from .memory import PRECISIONS, RECOMPUTE, STAGES, MemoryEstimate, Workload, estimate_memory
from .model import ModelShape
from .rules import check_layout, seq_alignment

# Beyond ~8k tokens per micro-batch the GEMMs are already large; more only costs memory and,
# with pipelining, bubble.
MAX_MICRO_BATCH_TOKENS = 8192
# Interleaved chunks thinner than this spend more on point-to-point traffic than they save.
MIN_LAYERS_PER_VIRTUAL_CHUNK = 4
# Pipeline bubble, (PP−1)/(VP·micro-batches), below which interleaving is not worth its traffic.
BUBBLE_TARGET = 0.05
# How far the "nearest node counts" hint in a no-layout error looks.
_NODE_SEARCH_SPAN = 64


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """Everything plan() needs; forced fields (layout, micro batch, ...) are None for auto."""

    model: ModelShape | Mapping[str, Any] | str | os.PathLike[str]
    """ModelShape, an HF config dict, a config.json path or a model directory."""
    nodes: int
    """Nodes in the job."""
    seq_length: int
    """Tokens per sequence."""
    global_batch_size: int
    """Sequences per optimizer step across all data-parallel ranks."""
    gpus_per_node: int | None = None
    """Devices per node; None = the preset's (8 for GPUs, 1 for CPU)."""
    gpu: str = "H100-80GB"
    """GPU preset: one of GPU_PRESETS (H100-80GB, H200-141GB, A100-40GB, A100-80GB, CPU)."""
    gpu_memory_gib: float | None = None
    """Override the preset's memory per device, in GiB."""
    stage: str = "pt"
    """pt, sft or dpo."""
    precision: str = "bf16"
    """bf16, fp16, fp8 (H100/H200 only) or fp32."""
    lora: bool = False
    """Train LoRA adapters instead of all weights."""
    lora_rank: int = 16
    """LoRA rank, for the adapter parameter count."""
    sequence_packing: bool = False
    """Pack several documents per sequence (CP then needs 2·CP-aligned documents)."""
    flash_attention: bool = True
    """Fused attention (no s×s score matrix in memory)."""
    layout: Layout | None = None
    """Force this layout (checked, not searched)."""
    micro_batch_size: int | None = None
    """Force the micro-batch size."""
    recompute: str | None = None
    """Force none, selective or full activation recompute."""
    use_distributed_optimizer: bool | None = None
    """Force the distributed optimizer on or off; None = on whenever there is DP·CP to shard."""
    max_context_parallel: int | None = None
    """The largest CP the trainer that runs the plan supports (None = no limit): the search
    stays below it and a forced layout above it is refused."""
    shape: ModelShape = field(init=False, repr=False, compare=False)
    """The model as a ModelShape (filled from ``model``)."""

    def __post_init__(self) -> None:
        model = self.model
        shape = model if isinstance(model, ModelShape) else ModelShape.from_hf_config(model)
        object.__setattr__(self, "shape", shape)
        raise_if(_request_violations(self))

    @property
    def gpu_spec(self) -> GpuSpec:
        return get_gpu(self.gpu, self.gpu_memory_gib)

    @property
    def node_size(self) -> int:
        return self.gpus_per_node or self.gpu_spec.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.node_size


@dataclass(frozen=True)
class Plan:
    """A layout that passes check_layout, with its memory estimate and the reason for it."""

    layout: Layout
    """Resolved layout (dp filled in)."""
    micro_batch_size: int
    num_microbatches: int
    """Micro-batches per step per DP rank: global / (micro · DP)."""
    recompute: str
    """none, selective or full."""
    use_distributed_optimizer: bool
    sequence_parallel: bool
    """On whenever TP > 1 (required for MoE with TP, and what the activation estimate assumes)."""
    memory: MemoryEstimate
    """Per-GPU bytes on the busiest pipeline stage."""
    usable_bytes: int
    """The memory budget the plan was fitted to (device memory minus headroom)."""
    reason: str
    """One line on why this layout."""
    request: PlanRequest
    forced: bool = False
    """True when the layout came from the request rather than the search."""


def plan(request: PlanRequest | None = None, /, **fields: Any) -> Plan:
    """Plan a job: ``plan(PlanRequest(...))`` or ``plan(model=..., nodes=..., ...)``.

    Raises LayoutError (one line per problem) for bad input, a forced layout that breaks a rule
    or does not fit, or when no layout fits at all.
    """
    req = PlanRequest(**fields) if request is None else replace(request, **fields)
    return _plan_search(req) if req.layout is None else _plan_forced(req, req.layout)


def _request_violations(req: PlanRequest) -> list[str]:
    lines = []
    for name in ("nodes", "seq_length", "global_batch_size", "gpus_per_node", "lora_rank",
                 "micro_batch_size", "max_context_parallel"):
        value = getattr(req, name)
        optional = name in ("gpus_per_node", "micro_batch_size", "max_context_parallel")
        if (value is not None or not optional) and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1):
            lines.append(f"{name}={value!r} must be a positive integer")
    for name, choices in (("stage", STAGES), ("precision", PRECISIONS),
                          ("recompute", RECOMPUTE)):
        value = getattr(req, name)
        if value is not None and value not in choices:
            lines.append(f"{name}={value!r} is not valid; valid: {', '.join(choices)}")
    cap = req.max_context_parallel
    if req.layout is not None and cap is not None and req.layout.cp > cap:
        lines.append(f"{FIELD_NAMES['cp']}={req.layout.cp} is not supported by the trainer "
                     f"yet; valid: at most {cap}")
    try:
        gpu = req.gpu_spec
    except LayoutError as err:
        return lines + err.violations
    if req.precision == "fp8" and not gpu.fp8:
        fp8 = ", ".join(name for name, spec in GPU_PRESETS.items() if spec.fp8)
        lines.append(f"precision='fp8' needs an FP8 GPU ({fp8}), not {gpu.name}; "
                     "valid: bf16, fp16, fp32")
    return lines


# --- evaluating one candidate -----------------------------------------------------------------

def _auto_distributed_optimizer(req: PlanRequest, layout: Layout) -> bool:
    """Sharding optimizer state costs nothing but a reduce-scatter, so use it whenever there is
    more than one data-parallel rank to shard over."""
    if req.use_distributed_optimizer is not None:
        return req.use_distributed_optimizer
    return (layout.dp or 1) * layout.cp > 1


def _workload(req: PlanRequest, layout: Layout, mbs: int, recompute: str) -> Workload:
    return Workload(
        seq_length=req.seq_length, micro_batch_size=mbs,
        num_microbatches=req.global_batch_size // (mbs * (layout.dp or 1)),
        stage=req.stage, precision=req.precision, lora=req.lora, lora_rank=req.lora_rank,
        recompute=recompute, use_distributed_optimizer=_auto_distributed_optimizer(req, layout),
        flash_attention=req.flash_attention)


def _violations(req: PlanRequest, layout: Layout, mbs: int) -> list[str]:
    return check_layout(layout, req.world_size, req.shape, gpus_per_node=req.node_size,
                        global_batch_size=req.global_batch_size, micro_batch_size=mbs,
                        seq_length=req.seq_length, sequence_packing=req.sequence_packing)


def _estimate(req: PlanRequest, layout: Layout, mbs: int, recompute: str) -> MemoryEstimate:
    return estimate_memory(req.shape, layout, _workload(req, layout, mbs, recompute))


def _make_plan(req: PlanRequest, layout: Layout, mbs: int, recompute: str, reason: str, *,
               forced: bool) -> Plan:
    work = _workload(req, layout, mbs, recompute)
    return Plan(layout=layout, micro_batch_size=mbs, num_microbatches=work.num_microbatches,
                recompute=recompute, use_distributed_optimizer=work.use_distributed_optimizer,
                sequence_parallel=layout.tp > 1 and req.gpu_spec.sequence_parallel, memory=estimate_memory(req.shape, layout, work),
                usable_bytes=req.gpu_spec.usable_bytes, reason=reason, request=req,
                forced=forced)


def _recompute_options(req: PlanRequest) -> list[str]:
    if req.recompute is not None:
        return [req.recompute]
    return ["none"] + ([] if req.flash_attention else ["selective"]) + ["full"]


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


# --- forced layout ----------------------------------------------------------------------------

def _plan_forced(req: PlanRequest, forced: Layout) -> Plan:
    mbs = req.micro_batch_size or 1
    forced = _with_uneven_split(req, forced)
    raise_if(_violations(req, forced, mbs))  # before resolving: field lines beat the product one
    layout = forced.resolved(req.world_size)
    usable = req.gpu_spec.usable_bytes
    for recompute in _recompute_options(req):
        est = _estimate(req, layout, mbs, recompute)
        if est.total <= usable:
            mbs = req.micro_batch_size or _grow_micro_batch(req, layout, recompute)
            est = _estimate(req, layout, mbs, recompute)
            return _make_plan(req, layout, mbs, recompute,
                              _forced_reason(req, layout, est, recompute), forced=True)
    raise LayoutError(
        f"layout {layout.describe()} needs {_gib(est.total)} per GPU with recompute={recompute}, "
        f"more than the {_gib(usable)} usable on {req.gpu_spec.name}; valid: drop the forced "
        "layout to let the planner choose, add nodes, or use LoRA")


def _with_uneven_split(req: PlanRequest, forced: Layout) -> Layout:
    """A forced PP (×VP) that does not divide the layers gets the balanced uneven split the
    search would use (``--pp 8`` on 126 layers: 15,16×6,15), unless a split was given."""
    stages = forced.num_virtual_stages
    if forced.pipeline_layout is not None or req.shape.num_layers % stages == 0:
        return forced
    split = balanced_pipeline_layout(req.shape.num_layers, stages)
    return forced if split is None else replace(forced, pipeline_layout=split)


def _forced_reason(req: PlanRequest, layout: Layout, est: MemoryEstimate, recompute: str) -> str:
    return (f"user-forced {layout.describe()} passes every rule and fits {req.gpu_spec.name} "
            f"({_gib(est.total)} of {_gib(req.gpu_spec.usable_bytes)} usable, "
            f"recompute={recompute})")


# --- search -----------------------------------------------------------------------------------

def _candidates(req: PlanRequest, world: int) -> Iterator[Layout]:
    """Layouts that pass the cheap arithmetic rules, most preferred first (see module doc)."""
    model = req.shape
    found = []
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
                    found.append(Layout(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp,
                                        pipeline_layout=stages))
    yield from sorted(found, key=lambda lay: (lay.model_parallel_size, -lay.tp, lay.cp, lay.ep))


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


@dataclass
class _Search:
    """Best rejected candidate so far, for explaining the winner or the failure."""

    valid: int = 0
    leanest: tuple[int, Layout, str] | None = None

    def miss(self, total: int, layout: Layout, recompute: str) -> None:
        self.valid += 1
        if self.leanest is None or total < self.leanest[0]:
            self.leanest = (total, layout, recompute)


def _plan_search(req: PlanRequest) -> Plan:
    usable, mbs = req.gpu_spec.usable_bytes, req.micro_batch_size or 1
    search = _Search()
    for recompute in _recompute_options(req):
        for layout in _candidates(req, req.world_size):
            if _violations(req, layout, mbs):
                continue  # the arithmetic pre-filter is not the authority; check_layout is
            est = _estimate(req, layout, mbs, recompute)
            if est.total > usable:
                search.miss(est.total, layout, recompute)
                continue
            return _finish(req, layout, recompute, search)
    raise LayoutError(_no_fit_line(req, search))


def _finish(req: PlanRequest, layout: Layout, recompute: str, search: _Search) -> Plan:
    """Tune micro-batch and interleaving on the chosen layout, then explain it."""
    mbs = req.micro_batch_size or _grow_micro_batch(req, layout, recompute)
    layout = _interleave(req, layout, mbs, recompute)
    est = _estimate(req, layout, mbs, recompute)
    return _make_plan(req, layout, mbs, recompute,
                      _search_reason(req, layout, mbs, recompute, est, search), forced=False)


def _fits(req: PlanRequest, layout: Layout, mbs: int, recompute: str) -> bool:
    return (not _violations(req, layout, mbs)
            and _estimate(req, layout, mbs, recompute).total <= req.gpu_spec.usable_bytes)


def _grow_micro_batch(req: PlanRequest, layout: Layout, recompute: str) -> int:
    """Largest power-of-two micro-batch under MAX_MICRO_BATCH_TOKENS that fits, keeping at
    least 4·PP micro-batches per step when pipelining (the bubble is (PP−1)/micro-batches)."""
    best, mbs = 1, 2
    dp = layout.dp or 1
    while mbs * req.seq_length <= MAX_MICRO_BATCH_TOKENS:
        if req.global_batch_size % (mbs * dp) or (
                layout.pp > 1 and req.global_batch_size // (mbs * dp) < 4 * layout.pp):
            break
        if not _fits(req, layout, mbs, recompute):
            break
        best, mbs = mbs, mbs * 2
    return best


def _bubble(layout: Layout, microbatches: int) -> float:
    return (layout.pp - 1) / ((layout.vp or 1) * microbatches)


def _interleave(req: PlanRequest, layout: Layout, mbs: int, recompute: str) -> Layout:
    """Fewest virtual chunks (of >= 4 layers each) that bring the bubble under BUBBLE_TARGET,
    or as many as fit when none does; no interleaving when the bubble is already small."""
    microbatches = req.global_batch_size // (mbs * (layout.dp or 1))
    if layout.pp == 1 or _bubble(layout, microbatches) <= BUBBLE_TARGET:
        return layout
    best = layout
    for candidate in _virtual_options(req.shape.num_layers, layout):
        if _fits(req, candidate, mbs, recompute):
            best = candidate
            if _bubble(candidate, microbatches) <= BUBBLE_TARGET:
                break
    return best


def _virtual_options(num_layers: int, layout: Layout) -> Iterator[Layout]:
    """Interleaved versions of ``layout``, fewest chunks first, every chunk >= 4 layers.
    An even pipeline stays even; an uneven one gets a balanced layout over PP·VP stages."""
    for vp in range(2, num_layers // (layout.pp * MIN_LAYERS_PER_VIRTUAL_CHUNK) + 1):
        stages = layout.pp * vp
        if layout.pipeline_layout is None:
            if num_layers % stages == 0:
                yield replace(layout, vp=vp)
            continue
        chunks = balanced_pipeline_layout(num_layers, stages)
        if chunks is not None and min(chunks) >= MIN_LAYERS_PER_VIRTUAL_CHUNK:
            yield replace(layout, vp=vp, pipeline_layout=chunks)


def _search_reason(req: PlanRequest, layout: Layout, mbs: int, recompute: str,
                   est: MemoryEstimate, search: _Search) -> str:
    gpu = req.gpu_spec
    mp = layout.model_parallel_size
    head = (f"{layout.describe()}: the least model parallelism (TP·PP·CP={mp}) that fits "
            f"{gpu.name} ({_gib(est.total)} of {_gib(gpu.usable_bytes)} usable)")
    parts = [head + (" without recompute" if recompute == "none"
                     else f" only with {recompute} recompute")]
    if search.leanest is not None:
        parts.append(f"layouts preferred to it need >= {_gib(search.leanest[0])}")
    elif mp == 1:
        parts.append("the model fits one GPU, so every GPU does data parallelism")
    if layout.cp > 1:
        parts.append(f"CP{layout.cp} splits the {req.seq_length}-token sequences")
    if layout.ep > 1:
        parts.append(f"EP{layout.ep} spreads the {req.shape.num_experts} experts")
    if layout.vp:
        parts.append(f"VP{layout.vp} shrinks the pipeline bubble to "
                     f"{_bubble(layout, req.global_batch_size // (mbs * (layout.dp or 1))):.0%}")
    return "; ".join(parts)


def _no_fit_line(req: PlanRequest, search: _Search) -> str:
    where = f"{req.nodes} node(s) × {req.node_size} {req.gpu_spec.name}"
    if search.leanest is not None:
        total, layout, recompute = search.leanest
        return (f"no layout fits {where} ({_gib(req.gpu_spec.usable_bytes)} usable per GPU): "
                f"the leanest, {layout.describe()} with recompute={recompute}, needs "
                f"{_gib(total)}; valid: more nodes, a larger GPU, LoRA or a shorter seq_length")
    nearby = _nearest_workable_nodes(req)
    hint = ", ".join(map(str, nearby)) if nearby else "none nearby"
    return (f"nodes={req.nodes} gives world_size={req.world_size}, which no TP·PP·CP·DP split "
            f"satisfies with global_batch_size={req.global_batch_size}, "
            f"num_layers={req.shape.num_layers} and seq_length={req.seq_length}; "
            f"valid nodes: {hint}")


def _nearest_workable_nodes(req: PlanRequest) -> list[int]:
    """The closest node counts below and above with at least one rule-valid layout."""
    found = []
    for step in (-1, 1):
        n = req.nodes + step
        while n >= 1 and abs(n - req.nodes) <= _NODE_SEARCH_SPAN:
            world = n * req.node_size
            mbs = req.micro_batch_size or 1
            if any(not check_layout(lay, world, req.shape, gpus_per_node=req.node_size,
                                    global_batch_size=req.global_batch_size,
                                    micro_batch_size=mbs, seq_length=req.seq_length,
                                    sequence_packing=req.sequence_packing)
                   for lay in _candidates(req, world)):
                found.append(n)
                break
            n += step
    return found
