"""The planner's search: every rule-valid layout that fits with headroom, tuned and ranked.

Each candidate TP·PP·CP·EP split (topology/splits.py) is tried with every recompute level,
every micro-batch size up to MAX_MICRO_BATCH_TOKENS and every interleaving depth up to
MAX_VIRTUAL_STAGES. What passes check_layout and fits the planning budget is
scored by the estimated step time (topology/cost.py); the fastest wins. Options within TIE of
the fastest count as equal, and among those the plainest is taken: least recompute, then
least model parallelism, larger TP (it stays on NVLink), PP before CP, the smallest EP and VP,
then the larger micro-batch.

The budget is the GPU's usable memory (GpuSpec.usable_fraction, which already sets aside the
CUDA context, NCCL buffers and communication staging) less PLAN_HEADROOM.

Not every option is sized and timed: each rule-valid one gets a cheap floor under its step
time (cost.step_time_floor), and they are sized and timed in the order of that floor. Once a
floor is above both the TIE window of the fastest so far and the best times of RANKED_LAYOUTS
layouts, neither that option nor any later one can win, tie with the winner or enter the
ranking ``plan --explain`` prints; the rest are only sized as far as it takes to count the
layouts that fit (the reason line names that count). ``search(req, exhaustive=True)`` sizes and
times them all (tests/test_plan_search_pruning.py compares the two).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .cost import StepTime, estimate_step_time, step_time_floor
from .errors import LayoutError
from .hardware import GiB
from .layout import Layout
from .memory import (
    RECOMPUTE,
    MemoryEstimate,
    Workload,
    block_layers,
    chunk_layers,
    estimate_memory,
    recompute_level,
    recompute_modules,
)
from .rules import check_layout
from .splits import candidates, micro_batch_options, virtual_options

if TYPE_CHECKING:
    from .planner import PlanRequest

# Share of the usable memory a searched plan leaves free. The memory model's own error is a
# few per cent (its activation count follows Korthikanti et al., measured within ~5%), and
# PyTorch's caching allocator strands 5-10% of a long run's reserved memory in fragments that
# no later request fits; a plan at the very edge of the estimate fails on those.
PLAN_HEADROOM = 0.10
# Estimated step times closer than this to the fastest are within the model's own error.
TIE = 0.01
# Layouts whose best options the search ranks exactly (plan --explain shows them); options of
# any other layout are only timed when they might beat one of these.
RANKED_LAYOUTS = 5
# The fewest tokens of a sequence a context-parallel rank may hold unless memory leaves no
# other choice: the shortest CP chunk of any published run in benchmarks/planner_layouts.py
# (Llama3.1-405B at 8k with CP2, Megatron-Bridge; the Llama 3 paper's CP16 at 128k holds 8k a
# rank). Below it a ring step's attention is too short to hide its exchange and runs its
# kernels at a fraction of their speed, and no team that measured it split sequences so far.
MIN_CP_TOKENS = 4096
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
        return (RECOMPUTE.index(recompute_level(self.recompute)),
                block_layers(self.recompute) or len(recompute_modules(self.recompute)),
                lay.model_parallel_size, -lay.tp, lay.cp,
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
        separate_reference=req.separate_reference, grad_reduce_in_fp32=req.grad_reduce_in_fp32,
        tp_comm_overlap=req.tp_comm_overlap, overlap_p2p_comm=req.overlap_p2p_comm,
        moe_comm_overlap=req.moe_comm_overlap, moe_dispatcher=req.moe_dispatcher,
        moe_routing=req.moe_routing, te_layers=req.te_layers,
        image_max_pixels=req.image_max_pixels, vision_trains=frozenset(req.vision_trains))


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
    """Memory of ``layout`` at a recompute that is not the bare block level."""
    return size(req, _resolved(req, layout, mbs, recompute)).memory


@dataclass(frozen=True)
class Candidate:
    """A layout, micro-batch and recompute that pass the rules, not yet sized or timed."""

    layout: Layout
    micro_batch_size: int
    recompute: str
    work: Workload


@dataclass(frozen=True)
class Sized(Candidate):
    """A candidate with its memory estimate; its step time comes from ``timed``."""

    memory: MemoryEstimate


def candidate(req: PlanRequest, layout: Layout, mbs: int, recompute: str,
              budget: int | None = None) -> Candidate | None:
    """``layout`` at ``mbs`` and ``recompute``; the block level becomes ``block:N`` with the
    fewest N that fit ``budget`` (default: the planning budget), or None where block has
    nothing to offer: none fits already, no N fits, or every chunk holds one layer."""
    if recompute == "block":
        blocks = _fewest_blocks(req, layout, mbs, planning_budget(req) if budget is None
                                else budget)
        if blocks is None:
            return None
        recompute = blocks
    return _resolved(req, layout, mbs, recompute)


def _resolved(req: PlanRequest, layout: Layout, mbs: int, recompute: str) -> Candidate:
    """``layout`` at a recompute that names everything (``block:N``, not the bare level)."""
    return Candidate(layout, mbs, recompute, workload(req, layout, mbs, recompute))


def _fewest_blocks(req: PlanRequest, layout: Layout, mbs: int, budget: int) -> str | None:
    """``block:N`` for the fewest recomputed layers a chunk that fit ``budget`` (memory falls
    as N grows: a binary search), or None (see candidate)."""
    def fits(recompute: str) -> bool:
        return size(req, _resolved(req, layout, mbs, recompute)).memory.total <= budget

    top = max(max(chunk_layers(req.shape, layout, r)) for r in range(layout.pp)) - 1
    # A searched block level has nothing to offer where no recompute fits; a forced one does.
    if top < 1 or (req.recompute != "block" and fits("none")) or not fits(f"block:{top}"):
        return None
    low, high = 1, top
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(f"block:{mid}") else (mid + 1, high)
    return f"block:{low}"


def size(req: PlanRequest, cand: Candidate) -> Sized:
    """``cand`` with its memory estimate."""
    memory = estimate_memory(req.shape, cand.layout, memory_workload(req, cand.work))
    return Sized(cand.layout, cand.micro_batch_size, cand.recompute, cand.work, memory)


def timed(req: PlanRequest, sized: Sized) -> Option:
    """``sized`` with its estimated step time."""
    layout = sized.layout
    time = estimate_step_time(req.shape, layout, sized.work, req.gpu_spec, req.node_size,
                              overlap_grad_reduce=overlap_grad_reduce(req, layout),
                              overlap_param_gather=req.overlap_param_gather)
    return Option(layout, sized.micro_batch_size, sized.recompute, sized.memory, time)


def evaluate(req: PlanRequest, layout: Layout, mbs: int, recompute: str) -> Option:
    """Memory and estimated step time of a resolved layout (recompute not the bare block)."""
    return timed(req, size(req, _resolved(req, layout, mbs, recompute)))


def recompute_options(req: PlanRequest) -> list[str]:
    """The recompute levels the search tries, least recompute first: the attention core only
    where attention is unfused (flash attention keeps nothing it would free); the norms, then
    the norms and the MLP (an MoE layer, on mixtures of experts), which free most of a
    layer's activations for a fraction of its forward; the fewest whole layers; all."""
    if req.recompute is not None:
        return [req.recompute]
    return (["none"] + ([] if req.flash_attention else ["selective"])
            + list(MODULE_OPTIONS[req.te_layers, req.shape.is_moe]) + ["block", "full"])


MODULE_OPTIONS = {  # (te_layers, MoE): the selective levels searched, cheapest first
    (False, False): ("selective:layernorm", "selective:layernorm,mlp"),
    (False, True): ("selective:layernorm", "selective:layernorm,moe"),
    # Transformer Engine fuses a dense layer's norms into its linears (nothing to free).
    (True, False): ("selective:mlp",),
    (True, True): ("selective:layernorm,moe_act", "selective:layernorm,moe"),
}


def tunings(req: PlanRequest, layout: Layout, recompute: str, budget: int, *,
            interleave: bool) -> Iterator[Option]:
    """Every micro-batch size (and, when ``interleave``, interleaving depth) of ``layout`` at
    ``recompute`` that passes the rules and fits ``budget``, timed (memory first, so that
    what does not fit is never timed)."""
    for cand in valid_tunings(req, layout, recompute, interleave=interleave, budget=budget):
        sized = size(req, cand)
        if sized.memory.total <= budget:
            yield timed(req, sized)


def valid_tunings(req: PlanRequest, layout: Layout, recompute: str, *, interleave: bool,
                  skip_first: bool = False, budget: int | None = None) -> Iterator[Candidate]:
    """``tunings`` before sizing: every micro-batch size (and interleaving depth) of ``layout``
    that passes the rules. ``skip_first``: leave out ``layout`` itself at the first micro-batch
    size (the search sized it already); ``budget``: what the block level fits (candidate)."""
    shapes = [layout, *(virtual_options(req.shape.num_layers, layout) if interleave else ())]
    for n, mbs in enumerate(micro_batch_options(req, layout)):
        for lay in shapes:
            if skip_first and n == 0 and lay is layout:
                continue
            if not violations(req, lay, mbs):
                cand = candidate(req, lay, mbs, recompute, budget)
                if cand is not None:
                    yield cand


def fastest(options: Iterable[Option]) -> list[Option]:
    """Options best first: the near-fastest (within TIE) by preference, then the rest by time."""
    ranked = sorted(options, key=lambda o: (o.time.total, o.preference()))
    if not ranked:
        return []
    limit = ranked[0].time.total * (1 + TIE)
    near = sorted((o for o in ranked if o.time.total <= limit), key=Option.preference)
    return near + [o for o in ranked if o.time.total > limit]


def top_layouts(ranked: list[Option], count: int = RANKED_LAYOUTS) -> list[Option]:
    """The first option of each of the first ``count`` layouts in ``ranked`` (best first)."""
    seen: dict[Layout, Option] = {}
    for option in ranked:
        if len(seen) == count:
            break
        seen.setdefault(option.layout, option)
    return list(seen.values())


# --- search -----------------------------------------------------------------------------------

@dataclass
class Misses:
    """Candidates that passed the rules but not the budget, for the no-fit message."""

    leanest: tuple[int, Layout, str] | None = None

    def add(self, total: int, layout: Layout, recompute: str) -> None:
        if self.leanest is None or total < self.leanest[0]:
            self.leanest = (total, layout, recompute)


@dataclass(frozen=True)
class Ranking:
    """What the search found: the timed options best first, and how many layouts fit."""

    options: list[Option]
    """Best first (see fastest); with pruning, only the options that could rank."""
    layouts: int
    """Distinct layouts with at least one option that fits, timed or not."""
    short_cp: bool = False
    """True when nothing fit without CP chunks shorter than MIN_CP_TOKENS, so they were
    searched too (the reason line says so)."""


def search(req: PlanRequest, *, exhaustive: bool = False) -> Ranking:
    """The options that fit the planning budget, best first; ``exhaustive`` sizes and times
    every one instead of pruning (same winner and same first RANKED_LAYOUTS layouts; for
    tests).

    Raises LayoutError (one line) when none fits, naming the leanest candidate or the nearest
    node counts with a valid split.
    """
    budget, misses = planning_budget(req), Misses()
    layouts = list(candidates(req, req.world_size))
    short_cp = False
    found = _fitting(req, [lay for lay in layouts if not _short_cp(req, lay)], budget, misses)
    if not found and any(_short_cp(req, lay) for lay in layouts):
        short_cp = True  # memory leaves no other choice
        found = _fitting(req, [lay for lay in layouts if _short_cp(req, lay)], budget, misses)
    if not found:
        raise LayoutError(_no_fit_line(req, misses))
    if not exhaustive:
        return replace(_pruned(req, found, budget), short_cp=short_cp)
    fits = [s for s in (c if isinstance(c, Sized) else size(req, c) for c in found)
            if s.memory.total <= budget]
    return Ranking(fastest(timed(req, s) for s in fits), len({s.layout for s in fits}), short_cp)


def _short_cp(req: PlanRequest, layout: Layout) -> bool:
    """Whether ``layout`` leaves a CP rank fewer than MIN_CP_TOKENS of a sequence."""
    return layout.cp > 1 and req.seq_length < MIN_CP_TOKENS * layout.cp


def _fitting(req: PlanRequest, layouts: list[Layout], budget: int,
             misses: Misses) -> list[Candidate]:
    """Every rule-valid option of ``layouts`` whose layout fits ``budget`` at the first
    micro-batch size (those are Sized; the tunings after them are not sized yet)."""
    found: list[Candidate] = []
    mbs = req.micro_batch_size or 1
    for layout in layouts:
        if violations(req, layout, mbs):
            continue  # the arithmetic pre-filter is not the authority; check_layout is
        for recompute in recompute_options(req):
            cand = candidate(req, layout, mbs, recompute, budget)
            if cand is None:
                continue
            first = size(req, cand)
            if first.memory.total > budget:
                misses.add(first.memory.total, layout, recompute)
                continue
            found.append(first)
            found.extend(valid_tunings(req, layout, recompute, interleave=True, skip_first=True,
                                       budget=budget))
    return found


def _pruned(req: PlanRequest, found: list[Candidate], budget: int) -> Ranking:
    """Size and time ``found`` in the order of their step-time floor until no later one can
    rank; then size (no timing) only what it takes to count the layouts that fit.

    An untimed option is safe to drop when its floor exceeds both the TIE window of the
    fastest time so far (so it cannot tie with the winner) and the RANKED_LAYOUTS-th best time
    among the layouts timed so far (so it cannot displace one of them). Both limits only
    fall as more options are timed, so what is dropped stays dropped.
    """
    gpu = req.gpu_spec
    floors = sorted((step_time_floor(req.shape, c.layout, c.work, gpu, req.node_size), i)
                    for i, c in enumerate(found))
    fit_layouts = {c.layout for c in found if isinstance(c, Sized)}  # sized by the pre-check
    best_by_layout: dict[Layout, float] = {}
    options: list[Option] = []
    for floor, i in floors:
        # The slack covers rounding: the floor sums the same terms in another order.
        if len(best_by_layout) >= RANKED_LAYOUTS and floor > _limit(best_by_layout) * (1 + 1e-9):
            break  # floors are sorted: every later option is out of reach too
        cand = found[i]
        sized = cand if isinstance(cand, Sized) else size(req, cand)
        found[i] = sized  # the count below sizes nothing twice
        if sized.memory.total > budget:
            continue
        fit_layouts.add(sized.layout)
        option = timed(req, sized)
        options.append(option)
        old = best_by_layout.get(option.layout)
        if old is None or option.time.total < old:
            best_by_layout[option.layout] = option.time.total
    for cand in found:  # a layout counts once one of its options fits
        if cand.layout not in fit_layouts and not isinstance(cand, Sized) \
                and size(req, cand).memory.total <= budget:
            fit_layouts.add(cand.layout)
    return Ranking(fastest(options), len(fit_layouts))


def _limit(best_by_layout: dict[Layout, float]) -> float:
    """The time above which an option can neither tie with the fastest nor rank among the
    first RANKED_LAYOUTS layouts."""
    times = heapq.nsmallest(RANKED_LAYOUTS, best_by_layout.values())
    return max(times[0] * (1 + TIE), times[-1])


# --- explaining -------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def search_reason(req: PlanRequest, ranking: Ranking) -> str:
    """One line on why the first option won."""
    ranked, layouts = ranking.options, ranking.layouts
    best = ranked[0]
    lay, gpu = best.layout, req.gpu_spec
    parts = [f"{lay.describe()}: the fastest estimated step of {layouts} layout(s) that fit "
             f"{gpu.name} with {PLAN_HEADROOM:.0%} headroom ({_gib(best.memory.total)} of "
             f"{_gib(gpu.usable_bytes)} usable)"
             + ("" if best.recompute == "none" else f" with {_recompute_words(best)}")]
    other = next((o for o in ranked if o.layout.describe() != lay.describe()), None)
    if other is not None and other.time.total <= best.time.total * (1 + TIE):
        parts.append(f"{other.layout.describe()} is as fast (within {TIE:.0%}); this one is "
                     "plainer")
    elif other is not None:
        slower = other.time.total / best.time.total - 1
        parts.append(f"the runner-up, {other.layout.describe()}, is {slower:.0%} slower")
    if lay.model_parallel_size == 1:
        parts.append("the model fits one GPU, so every GPU does data parallelism")
    if lay.cp > 1 and ranking.short_cp:
        parts.append(f"CP{lay.cp} splits the {req.seq_length}-token sequences into "
                     f"{req.seq_length // lay.cp}-token chunks, below the {MIN_CP_TOKENS} of "
                     "any published run, because no layout with longer chunks fits the memory")
    elif lay.cp > 1:
        parts.append(f"CP{lay.cp} splits the {req.seq_length}-token sequences")
    if lay.ep > 1:
        parts.append(f"EP{lay.ep} spreads the {req.shape.num_experts} experts")
    if lay.vp:
        parts.append(f"VP{lay.vp} cuts the pipeline bubble to "
                     f"{best.time.pipeline_bubble / best.time.total:.0%} of the step")
    return "; ".join(parts)


def _recompute_words(option: Option) -> str:
    n = block_layers(option.recompute)
    if n is None:
        return f"{option.recompute} recompute"
    return (f"full recompute of only the first {n} layer(s) of each pipeline chunk (block), "
            "the fewest that fit")


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
