"""The planner's search: every rule-valid layout that fits with headroom, tuned and ranked.

Each candidate TP·PP·CP·EP split is tried with every recompute level, every micro-batch size
up to MAX_MICRO_BATCH_TOKENS and every interleaving depth up to MAX_VIRTUAL_STAGES. What passes check_layout and fits the planning budget is
scored by the estimated step time (topology/cost.py); the fastest wins. Options within TIE of
the fastest count as equal, and among those the plainest is taken: least recompute, then
least model parallelism, larger TP (it stays on NVLink), PP before CP, the smallest EP and VP,
then the larger micro-batch.

The budget is the GPU's usable memory (GpuSpec.usable_fraction, which already sets aside the
CUDA context, NCCL buffers and communication staging) less PLAN_HEADROOM.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .cost import StepTime, estimate_step_time
from .errors import LayoutError
from .hardware import GiB
from .layout import Layout, balanced_pipeline_layout, divisors
from .memory import RECOMPUTE, MemoryEstimate, Workload, estimate_memory
from .model import ModelShape
from .rules import check_layout, seq_alignment

if TYPE_CHECKING:
    from .planner import PlanRequest

# Share of the usable memory a searched plan leaves free. The memory model's own error is a
# few per cent (its activation count follows Korthikanti et al., measured within ~5%), and
# PyTorch's caching allocator strands 5-10% of a long run's reserved memory in fragments that
# no later request fits; a plan at the very edge of the estimate fails on those.
PLAN_HEADROOM = 0.10
# Estimated step times closer than this to the fastest are within the model's own error.
TIE = 0.01
# Beyond ~8k tokens per micro-batch the GEMMs are already large; more only costs memory.
MAX_MICRO_BATCH_TOKENS = 8192
# The deepest interleaving tried (published recipes go to 24 chunks of one layer each); the
# cost model weighs each chunk's extra point-to-point traffic against the smaller bubble.
MAX_VIRTUAL_STAGES = 24
# How far the "nearest node counts" hint in a no-layout error looks.
_NODE_SEARCH_SPAN = 64


@dataclass(frozen=True)
class Option:
    """One tuned candidate: a resolved layout with its micro-batch, recompute, memory and time."""

    layout: Layout
    micro_batch_size: int
    recompute: str
    memory: MemoryEstimate
    time: StepTime

    def preference(self) -> tuple[int, ...]:
        """Sort key among near-equal step times (see module doc)."""
        lay = self.layout
        return (RECOMPUTE.index(self.recompute), lay.model_parallel_size, -lay.tp, lay.cp,
                lay.ep, lay.vp or 0, -self.micro_batch_size)


def planning_budget(req: PlanRequest) -> int:
    """Bytes per GPU a searched plan may fill: usable memory less PLAN_HEADROOM."""
    return int(req.gpu_spec.usable_bytes * (1 - PLAN_HEADROOM))


# --- evaluating one candidate -----------------------------------------------------------------

def distributed_optimizer(req: PlanRequest, layout: Layout) -> bool:
    """Sharding optimizer state costs nothing but a reduce-scatter, so use it whenever there is
    more than one data-parallel rank to shard over. LoRA in half precision needs it on any
    count: its float32 adapters in a bf16/fp16 model are checkpointed only by the distributed
    optimizer (Megatron's other mixed-precision optimizer maps half-precision parameters only).
    The standard backend has no distributed optimizer (its trainer refuses one): never."""
    if req.backend == "standard":
        return False
    if req.use_distributed_optimizer is not None:
        return req.use_distributed_optimizer
    return (layout.dp or 1) * layout.cp > 1 or (req.lora and req.precision != "fp32")


def overlap_grad_reduce(req: PlanRequest, layout: Layout) -> bool:
    """Reduce gradients during the last backward whenever there are DP·CP ranks to reduce over
    (Megatron's overlap_grad_reduce); off when the request says so. The standard backend's
    DDP always reduces its buckets during the backward, whatever the config says."""
    if req.overlap_grad_reduce is not None and req.backend != "standard":
        return req.overlap_grad_reduce
    return (layout.dp or 1) * layout.cp > 1


def workload(req: PlanRequest, layout: Layout, mbs: int, recompute: str) -> Workload:
    """What one step computes: the step-time estimate's input (see memory_workload)."""
    # The standard backend's SP is Ulysses: the all-to-all exchange (see topology/standard.py).
    cp_comm_type = "a2a" if req.backend == "standard" else req.cp_comm_type
    return Workload(
        seq_length=req.seq_length, micro_batch_size=mbs,
        num_microbatches=req.global_batch_size // (mbs * (layout.dp or 1)),
        stage=req.stage, precision=req.precision, lora=req.lora, lora_rank=req.lora_rank,
        recompute=recompute, use_distributed_optimizer=distributed_optimizer(req, layout),
        flash_attention=req.flash_attention, cp_comm_type=cp_comm_type,
        mtp_num_layers=req.mtp_num_layers, freeze=req.freeze, reference=req.reference,
        separate_reference=req.separate_reference)


def memory_workload(req: PlanRequest, work: Workload) -> Workload:
    """``work`` as the memory estimate sees it. The standard backend builds its model in
    float32 and runs bf16/fp16 under autocast, so its weights, gradients and Adam state are
    memory.py's fp32 case (4 + 4 + 8 B per trainable parameter, no separate master copy; the
    frozen LoRA base and a DPO reference also take 4 B); the compute stays at ``precision``."""
    return replace(work, precision="fp32") if req.backend == "standard" else work


def violations(req: PlanRequest, layout: Layout, mbs: int) -> list[str]:
    return check_layout(layout, req.world_size, req.shape, gpus_per_node=req.node_size,
                        global_batch_size=req.global_batch_size, micro_batch_size=mbs,
                        seq_length=req.seq_length, sequence_packing=req.sequence_packing,
                        cp_comm_type=req.cp_comm_type, mtp_num_layers=req.mtp_num_layers)


def memory(req: PlanRequest, layout: Layout, mbs: int, recompute: str) -> MemoryEstimate:
    work = memory_workload(req, workload(req, layout, mbs, recompute))
    return estimate_memory(req.shape, layout, work)


def evaluate(req: PlanRequest, layout: Layout, mbs: int, recompute: str) -> Option:
    """Memory and estimated step time of a resolved layout."""
    work = workload(req, layout, mbs, recompute)
    time = estimate_step_time(req.shape, layout, work, req.gpu_spec, req.node_size,
                              overlap_grad_reduce=overlap_grad_reduce(req, layout),
                              overlap_param_gather=req.overlap_param_gather)
    return Option(layout, mbs, recompute,
                  estimate_memory(req.shape, layout, memory_workload(req, work)), time)


def recompute_options(req: PlanRequest) -> list[str]:
    if req.recompute is not None:
        return [req.recompute]
    return ["none"] + ([] if req.flash_attention else ["selective"]) + ["full"]


def tunings(req: PlanRequest, layout: Layout, recompute: str, budget: int, *,
            interleave: bool) -> Iterator[Option]:
    """Every micro-batch size (and, when ``interleave``, interleaving depth) of ``layout`` at
    ``recompute`` that passes the rules and fits ``budget``."""
    for mbs in micro_batch_options(req, layout):
        shapes = [layout, *(virtual_options(req.shape.num_layers, layout) if interleave else ())]
        for lay in shapes:
            if violations(req, lay, mbs):
                continue
            option = evaluate(req, lay, mbs, recompute)
            if option.memory.total <= budget:
                yield option


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


def fastest(options: Iterable[Option]) -> list[Option]:
    """Options best first: the near-fastest (within TIE) by preference, then the rest by time."""
    ranked = sorted(options, key=lambda o: (o.time.total, o.preference()))
    if not ranked:
        return []
    limit = ranked[0].time.total * (1 + TIE)
    near = sorted((o for o in ranked if o.time.total <= limit), key=Option.preference)
    return near + [o for o in ranked if o.time.total > limit]


# --- search -----------------------------------------------------------------------------------

@dataclass
class Misses:
    """Candidates that passed the rules but not the budget, for the no-fit message."""

    leanest: tuple[int, Layout, str] | None = None

    def add(self, total: int, layout: Layout, recompute: str) -> None:
        if self.leanest is None or total < self.leanest[0]:
            self.leanest = (total, layout, recompute)


def search(req: PlanRequest) -> list[Option]:
    """Every tuned option that fits the planning budget, best first.

    Raises LayoutError (one line) when none does, naming the leanest candidate or the nearest
    node counts with a valid split.
    """
    budget, misses, options = planning_budget(req), Misses(), []
    mbs = req.micro_batch_size or 1
    for layout in candidates(req, req.world_size):
        if violations(req, layout, mbs):
            continue  # the arithmetic pre-filter is not the authority; check_layout is
        for recompute in recompute_options(req):
            total = memory(req, layout, mbs, recompute).total
            if total > budget:
                misses.add(total, layout, recompute)
                continue
            options.extend(tunings(req, layout, recompute, budget, interleave=True))
    if not options:
        raise LayoutError(_no_fit_line(req, misses))
    return fastest(options)


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


# --- explaining -------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def search_reason(req: PlanRequest, ranked: list[Option]) -> str:
    """One line on why the first option won."""
    best = ranked[0]
    lay, gpu = best.layout, req.gpu_spec
    layouts = len({o.layout for o in ranked})
    parts = [f"{lay.describe()}: the fastest estimated step of {layouts} layout(s) that fit "
             f"{gpu.name} with {PLAN_HEADROOM:.0%} headroom ({_gib(best.memory.total)} of "
             f"{_gib(gpu.usable_bytes)} usable)"
             + ("" if best.recompute == "none" else f" with {best.recompute} recompute")]
    other = next((o for o in ranked if o.layout.describe() != lay.describe()), None)
    if other is not None and other.time.total <= best.time.total * (1 + TIE):
        parts.append(f"{other.layout.describe()} is as fast (within {TIE:.0%}); this one is "
                     "plainer")
    elif other is not None:
        slower = other.time.total / best.time.total - 1
        parts.append(f"the runner-up, {other.layout.describe()}, is {slower:.0%} slower")
    if lay.model_parallel_size == 1:
        parts.append("the model fits one GPU, so every GPU does data parallelism")
    if lay.cp > 1:
        parts.append(f"CP{lay.cp} splits the {req.seq_length}-token sequences")
    if lay.ep > 1:
        parts.append(f"EP{lay.ep} spreads the {req.shape.num_experts} experts")
    if lay.vp:
        parts.append(f"VP{lay.vp} cuts the pipeline bubble to "
                     f"{best.time.pipeline_bubble / best.time.total:.0%} of the step")
    return "; ".join(parts)


def _no_fit_line(req: PlanRequest, misses: Misses) -> str:
    where = f"{req.nodes} node(s) × {req.node_size} {req.gpu_spec.name}"
    if misses.leanest is not None:
        total, layout, recompute = misses.leanest
        return (f"no layout fits {where} ({_gib(planning_budget(req))} per GPU: "
                f"{_gib(req.gpu_spec.usable_bytes)} usable less {PLAN_HEADROOM:.0%} headroom): "
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
    mbs = req.micro_batch_size or 1
    for step in (-1, 1):
        n = req.nodes + step
        while n >= 1 and abs(n - req.nodes) <= _NODE_SEARCH_SPAN:
            world = n * req.node_size
            if any(not check_layout(lay, world, req.shape, gpus_per_node=req.node_size,
                                    global_batch_size=req.global_batch_size,
                                    micro_batch_size=mbs, seq_length=req.seq_length,
                                    sequence_packing=req.sequence_packing,
                                    cp_comm_type=req.cp_comm_type,
                                    mtp_num_layers=req.mtp_num_layers)
                   for lay in candidates(req, world)):
                found.append(n)
                break
            n += step
    return found
