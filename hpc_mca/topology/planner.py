"""plan(): choose a layout, micro-batch size and recompute policy for a job.

The search (topology/search.py) tries every rule-valid TP·PP·CP·EP split with every recompute
level, micro-batch size and interleaving depth, keeps what fits the GPU with a memory headroom,
and takes the fastest by estimated step time (topology/cost.py). A forced layout is checked,
not searched: it gets the fastest micro-batch and recompute that fit, and the plan carries the
search's own choice for the same job, so a report can show both estimates side by side.

A PP size that does not divide the layers gets a balanced explicit ``pipeline_layout``. Every
plan passes check_layout, so the planner never emits a layout the rules reject.

``backend="standard"`` (the trainer's ``training.use_mca: false``) plans a whole model per GPU
instead: only the Ulysses sequence-parallel size and the micro-batch are chosen
(topology/standard.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, TypedDict, Unpack

from hpc_mca.stages import STAGE_NAMES

from .choices import MOE_DISPATCHERS, MOE_ROUTINGS, recompute_parts
from .cost import StepTime
from .errors import LayoutError, raise_if
from .freeze import FreezeSizing
from .hardware import GPU_PRESETS, GiB, GpuSpec, get_gpu
from .layout import FIELD_NAMES, Layout, balanced_pipeline_layout
from .memory import CP_COMM_TYPES, PRECISIONS, RECOMPUTE, MemoryEstimate
from .model import ModelShape
from .search import (
    PLAN_HEADROOM,
    Option,
    distributed_optimizer,
    fastest,
    memory,
    overlap_grad_reduce,
    planning_budget,
    recompute_options,
    search,
    search_reason,
    top_layouts,
    tunings,
    violations,
)
from .standard import describe as describe_standard
from .standard import standard_options, standard_reason, standard_request_violations
from .vision import DEFAULT_IMAGE_MAX_PIXELS, VISION_PARTS


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
    reference: bool = True
    """Whether the stage's frozen reference runs (false: reference-free dpo; see
    :func:`hpc_mca.stages.reference_runs`)."""
    separate_reference: bool = False
    """The reference is a model of its own even with ``lora`` (``finetuning.ref_model``)."""
    freeze: FreezeSizing | None = None
    """finetuning_type freeze: what trains (gradients and optimizer state for it only);
    None = every weight (or LoRA's adapters)."""
    sequence_packing: bool = False
    """Pack several documents per sequence (CP then needs 2·CP-aligned documents)."""
    flash_attention: bool = True
    """Fused attention (no s×s score matrix in memory)."""
    layout: Layout | None = None
    """Force this layout (checked, not searched)."""
    micro_batch_size: int | None = None
    """Force the micro-batch size."""
    recompute: str | None = None
    """Force none, selective, block (the fewest layers a chunk that fit), ``block:N`` or full
    activation recompute."""
    use_distributed_optimizer: bool | None = None
    """Force the distributed optimizer on or off; None = on whenever there is DP·CP to shard."""
    cp_comm_type: str = "all_gather"
    """How CP attention exchanges the sequence (p2p needs TE; a2a needs CP to divide the
    key/value heads per TP rank): sized in memory and step time, checked as a rule."""
    mtp_num_layers: int = 0
    """Multi-token prediction depths the run trains (on the last pipeline stage)."""
    max_context_parallel: int | None = None
    """The largest CP the trainer that runs the plan supports (None = no limit): the search
    stays below it and a forced layout above it is refused."""
    overlap_grad_reduce: bool | None = None
    """Force Megatron's overlap_grad_reduce on or off; None = on whenever there are DP·CP ranks
    to reduce over (the step-time estimate assumes what the plan says)."""
    overlap_param_gather: bool = False
    """The run overlaps the distributed optimizer's parameter all-gather with the next
    forward (estimated as hidden); the planner does not turn it on by itself."""
    grad_reduce_in_fp32: bool = True
    """Size and time gradients in fp32 (this trainer's DDP); false: in bf16, as other trainers'
    runs may (benchmarks/planner_layouts.py). hpc-mca never plans with false."""
    tp_comm_overlap: bool = False
    """Estimate TP collectives as pipelined with their GEMMs (Transformer Engine's
    userbuffers). hpc-mca's trainer does not run it and never plans with it: it is for
    estimating other trainers' runs (benchmarks/planner_layouts.py)."""
    overlap_p2p_comm: bool = False
    """Estimate an interleaved pipeline's sends as overlapped with compute (Megatron-LM's
    default); as tp_comm_overlap, for other trainers' runs only."""
    moe_comm_overlap: bool = False
    """Estimate MoE all-to-alls as overlapped with another micro-batch's compute (Megatron's
    overlap_moe_expert_parallel_comm); as tp_comm_overlap, for other trainers' runs only."""
    moe_dispatcher: str = "alltoall"
    """Estimate the MoE dispatch as ``alltoall`` (hpc-mca's trainer) or ``flex`` (DeepEP or
    HybridEP, choices.MOE_DISPATCHERS); flex as tp_comm_overlap, for other trainers' runs."""
    moe_routing: str = "balanced"
    """Estimate MoE layers' token loads as ``balanced`` or ``dropless`` (choices.MOE_ROUTINGS:
    the busiest expert-parallel rank waits on more than its share, routing.py). hpc-mca's
    trainer routes dropless, but its plans take routing as balanced: the one published
    measurement of dropless routing's cost is at a single EP size (8), and extrapolating it to
    choose EP moves plans to sizes no published run uses. Dropless is for estimates of runs
    known to route that way (benchmarks/planner_layouts.py), or for a caller of plan() who
    wants the penalty counted."""
    te_layers: bool = False
    """Estimate the layers as Transformer Engine's (Megatron's TE layer spec): the norms before
    QKV and a dense MLP fused into those linears, grouped-GEMM experts; as tp_comm_overlap,
    for other trainers' runs only (hpc-mca builds Megatron's local spec)."""
    backend: str = "megatron"
    """megatron (Megatron-Core: TP/PP/CP/EP layouts) or standard (``training.use_mca: false``:
    a whole transformers model per GPU, data and Ulysses sequence parallelism only)."""
    sequence_parallel_size: int | None = None
    """Standard backend: force the Ulysses SP size (ranks sharing each row); None = planned.
    The Megatron backend takes only None or 1 (it splits sequences with CP)."""
    image_max_pixels: int = DEFAULT_IMAGE_MAX_PIXELS
    """A VL model: the largest image's pixels (data.image_max_pixels), for the vision tower's
    activations."""
    vision_trains: frozenset[str] = frozenset()
    """A VL model: what of its vision side trains (``tower``, ``projector``: the config's
    freeze_vision_tower/freeze_multi_modal_projector false); empty keeps no vision activations."""
    shape: ModelShape = field(init=False, repr=False, compare=False)
    """The model as a ModelShape (filled from ``model``)."""

    def __post_init__(self) -> None:
        model = self.model
        shape = model if isinstance(model, ModelShape) else ModelShape.from_hf_config(model)
        object.__setattr__(self, "shape", shape)
        raise_if(_request_violations(self))

    @cached_property
    def gpu_spec(self) -> GpuSpec:
        # Cached: the search reads it for every option it sizes (fields are frozen).
        return get_gpu(self.gpu, self.gpu_memory_gib)

    @property
    def node_size(self) -> int:
        return self.gpus_per_node or self.gpu_spec.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.node_size


class PlanFields(TypedDict, total=False):
    """:class:`PlanRequest`'s fields by name, as ``plan(**fields)`` takes them."""

    model: ModelShape | Mapping[str, Any] | str | os.PathLike[str]
    nodes: int
    seq_length: int
    global_batch_size: int
    gpus_per_node: int | None
    gpu: str
    gpu_memory_gib: float | None
    stage: str
    precision: str
    lora: bool
    lora_rank: int
    reference: bool
    separate_reference: bool
    freeze: FreezeSizing | None
    sequence_packing: bool
    flash_attention: bool
    layout: Layout | None
    micro_batch_size: int | None
    recompute: str | None
    use_distributed_optimizer: bool | None
    cp_comm_type: str
    mtp_num_layers: int
    max_context_parallel: int | None
    overlap_grad_reduce: bool | None
    overlap_param_gather: bool
    grad_reduce_in_fp32: bool
    tp_comm_overlap: bool
    overlap_p2p_comm: bool
    moe_comm_overlap: bool
    moe_dispatcher: str
    moe_routing: str
    te_layers: bool
    backend: str
    sequence_parallel_size: int | None
    image_max_pixels: int
    vision_trains: frozenset[str]


@dataclass(frozen=True)
class Plan:
    """A layout that passes check_layout, with its memory estimate and the reason for it."""

    layout: Layout
    """Resolved layout (dp filled in)."""
    micro_batch_size: int
    num_microbatches: int
    """Micro-batches per step per DP rank: global / (micro · DP)."""
    recompute: str
    """none, selective, ``block:N`` (full recompute of the first N layers of each pipeline
    chunk: Megatron's block method) or full."""
    use_distributed_optimizer: bool
    sequence_parallel: bool
    """On whenever TP > 1 (required for MoE with TP, and what the activation estimate
    assumes), except for dense models on the CPU preset (see GpuSpec.sequence_parallel)."""
    overlap_grad_reduce: bool
    """Reduce gradients during the last micro-batch's backward (Megatron DDP)."""
    memory: MemoryEstimate
    """Per-GPU bytes on the busiest pipeline stage."""
    step_time: StepTime
    """Estimated seconds of one optimizer step, by cause."""
    usable_bytes: int
    """Device memory the estimate may fill (GpuSpec.usable_fraction); a searched plan also
    leaves PLAN_HEADROOM of it free."""
    reason: str
    """One line on why this layout."""
    request: PlanRequest
    forced: bool = False
    """True when the layout came from the request rather than the search."""
    searched: Plan | None = None
    """For a forced layout: the search's own plan for the same job (None when nothing else
    fits), to set the two estimates side by side."""
    backend: str = "megatron"
    """The request's backend; with standard, ``layout`` is all ones but ``dp``."""
    sequence_parallel_size: int = 1
    """Standard backend: Ulysses SP ranks per row (DP·SP = world); always 1 with Megatron."""
    ranking: tuple[Option, ...] = field(default=(), repr=False)
    """A searched Megatron plan: the best option of each of the RANKED_LAYOUTS fastest layouts,
    in the search's order (the first is this plan's own), for ``plan --explain``; empty for a
    forced layout (see ``searched``) and the standard backend."""

    def describe(self) -> str:
        """Compact layout for reports: ``TP4 PP2 CP1 DP2``, or ``DP4 × SP2`` (standard)."""
        if self.backend == "standard":
            return describe_standard(self.sequence_parallel_size, self.layout.dp or 1)
        return self.layout.describe()

    @property
    def tokens_per_second_per_gpu(self) -> float:
        """Estimated training throughput: global batch tokens over step time and GPUs."""
        req = self.request
        return req.global_batch_size * req.seq_length / self.step_time.total / req.world_size


def plan(request: PlanRequest | None = None, /, **fields: Unpack[PlanFields]) -> Plan:
    """Plan a job: ``plan(PlanRequest(...))`` or ``plan(model=..., nodes=..., ...)``.

    Raises LayoutError (one line per problem) for bad input, a forced layout that breaks a rule
    or does not fit, or when no layout fits at all.
    """
    req = PlanRequest(**fields) if request is None else replace(request, **fields)
    if req.backend == "standard":
        return _plan_standard(req)
    if req.layout is not None:
        return _plan_forced(req, req.layout)
    ranking = search(req)
    return _make_plan(req, ranking.options[0], search_reason(req, ranking), forced=False,
                      ranking=top_layouts(ranking.options))


def _request_violations(req: PlanRequest) -> list[str]:
    lines = []
    if not isinstance(req.mtp_num_layers, int) or req.mtp_num_layers < 0:
        lines.append(f"mtp_num_layers={req.mtp_num_layers!r} must be a non-negative integer")
    if not set(req.vision_trains) <= set(VISION_PARTS):
        lines.append(f"vision_trains={sorted(req.vision_trains)!r} is not valid; valid: parts "
                     f"from {', '.join(VISION_PARTS)}")
    for name in ("nodes", "seq_length", "global_batch_size", "gpus_per_node", "lora_rank",
                 "image_max_pixels",
                 "micro_batch_size", "max_context_parallel", "sequence_parallel_size"):
        value = getattr(req, name)
        optional = name in ("gpus_per_node", "micro_batch_size", "max_context_parallel",
                            "sequence_parallel_size")
        if (value is not None or not optional) and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1):
            lines.append(f"{name}={value!r} must be a positive integer")
    for name, choices in (("stage", STAGE_NAMES), ("precision", PRECISIONS),
                          ("recompute", RECOMPUTE), ("cp_comm_type", CP_COMM_TYPES),
                          ("moe_dispatcher", MOE_DISPATCHERS),
                          ("moe_routing", MOE_ROUTINGS)):
        value = getattr(req, name)
        if value is not None and value not in choices and not (
                name == "recompute" and (_block_n(value) is not None
                                         or _modules_problem(req, value) == "")):
            problem = _modules_problem(req, value) if name == "recompute" else None
            lines.append(problem or f"{name}={value!r} is not valid; valid: {', '.join(choices)}"
                         + (" (or block:N, N ≥ 1, or selective:A,B with A, B from "
                            f"{', '.join(_recompute_parts(req))})"
                            if name == "recompute" else ""))
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
    # The backend's rules need a valid world size (the SP rule divides it).
    return lines or standard_request_violations(req)


def _modules_problem(req: PlanRequest, value: object) -> str | None:
    """For ``selective:A,B``: "" when every part is one this model has (each once), else the
    one-line problem; None when ``value`` is not of that form."""
    if not isinstance(value, str) or not value.startswith("selective:"):
        return None
    named = value.split(":", 1)[1].split(",")
    valid = _recompute_parts(req)
    if len(set(named)) == len(named) and all(m in valid for m in named):
        return ""
    return (f"recompute={value!r} names a layer part twice or one this model has not; valid: "
            f"selective:A,B with each of A, B once from {', '.join(valid)}")


def _recompute_parts(req: PlanRequest) -> tuple[str, ...]:
    """The parts ``selective:A,B`` may name for this model (choices.recompute_parts)."""
    return recompute_parts(req.shape, req.te_layers)


def _block_n(value: object) -> int | None:
    """N of a well-formed ``block:N`` (N ≥ 1), else None."""
    if not isinstance(value, str) or not value.startswith("block:"):
        return None
    digits = value[len("block:"):]
    return int(digits) if digits.isdigit() and int(digits) >= 1 else None


def _make_plan(req: PlanRequest, option: Option, reason: str, *, forced: bool,
               searched: Plan | None = None, ranking: list[Option] | None = None) -> Plan:
    layout = option.layout
    mbs = option.micro_batch_size
    sp = 1
    if req.backend == "standard":
        # The option's layout is the Ulysses stand-in (CP = SP) that memory.py and cost.py
        # size; the plan shows what the trainer runs: no model parallelism at all.
        layout, sp = Layout(dp=layout.dp), layout.cp
    return Plan(layout=layout, micro_batch_size=mbs,
                num_microbatches=req.global_batch_size // (mbs * (layout.dp or 1)),
                recompute=option.recompute,
                use_distributed_optimizer=distributed_optimizer(req, layout),
                sequence_parallel=_sequence_parallel(req, layout),
                overlap_grad_reduce=overlap_grad_reduce(req, option.layout),
                memory=option.memory, step_time=option.time,
                usable_bytes=req.gpu_spec.usable_bytes, reason=reason, request=req,
                forced=forced, searched=searched, backend=req.backend, sequence_parallel_size=sp,
                ranking=tuple(ranking or ()))


def _sequence_parallel(req: PlanRequest, layout: Layout) -> bool:
    """Megatron sequence parallelism for ``layout``: with TP > 1 where the hardware preset
    wants it, and always for MoE models (Megatron's MoE layer refuses TP without it)."""
    return layout.tp > 1 and (req.gpu_spec.sequence_parallel or req.shape.is_moe)


def _plan_standard(req: PlanRequest) -> Plan:
    """A whole model per GPU: the fastest SP and micro-batch that fit (a forced SP gets the
    search's own choice beside it, as a forced layout does)."""
    ranked = standard_options(req)
    forced = req.sequence_parallel_size is not None
    searched = None
    if forced:
        try:
            searched = plan(replace(req, sequence_parallel_size=None))
        except LayoutError:
            searched = None
    return _make_plan(req, ranked[0], standard_reason(req, ranked), forced=forced,
                      searched=searched)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


# --- forced layout ----------------------------------------------------------------------------

def _plan_forced(req: PlanRequest, forced: Layout) -> Plan:
    """Check a user's layout and give it the fastest micro-batch and recompute that fit the
    usable memory (the search's headroom is the user's call here; the reason says so)."""
    forced = _with_uneven_split(req, forced)
    raise_if(violations(req, forced, req.micro_batch_size or 1))  # field lines beat the product
    layout = forced.resolved(req.world_size)
    usable = req.gpu_spec.usable_bytes
    ranked = fastest(option for recompute in recompute_options(req)
                     for option in tunings(req, layout, recompute, usable, interleave=False))
    if not ranked:
        raise LayoutError(_forced_no_fit_line(req, layout))
    try:
        searched = plan(replace(req, layout=None))
    except LayoutError:
        searched = None
    return _make_plan(req, ranked[0], _forced_reason(req, ranked[0]), forced=True,
                      searched=searched)


def _with_uneven_split(req: PlanRequest, forced: Layout) -> Layout:
    """A forced PP (×VP) that does not divide the layers gets the balanced uneven split the
    search would use (``--pp 8`` on 126 layers: 15,16×6,15), unless a split was given."""
    stages = forced.num_virtual_stages
    if forced.pipeline_layout is not None or req.shape.num_layers % stages == 0:
        return forced
    split = balanced_pipeline_layout(req.shape.num_layers, stages)
    return forced if split is None else replace(forced, pipeline_layout=split)


def _forced_no_fit_line(req: PlanRequest, layout: Layout) -> str:
    mbs, recompute = req.micro_batch_size or 1, recompute_options(req)[-1]
    total = memory(req, layout, mbs, recompute).total
    return (f"layout {layout.describe()} needs {_gib(total)} per GPU with "
            f"recompute={recompute}, more than the {_gib(req.gpu_spec.usable_bytes)} usable on "
            f"{req.gpu_spec.name}; valid: drop the forced layout to let the planner choose, "
            "add nodes, or use LoRA")


def _forced_reason(req: PlanRequest, option: Option) -> str:
    total, usable = option.memory.total, req.gpu_spec.usable_bytes
    room = ("" if total <= planning_budget(req) else
            f"; inside the {PLAN_HEADROOM:.0%} headroom the search keeps free, so "
            "fragmentation may run it out of memory")
    return (f"user-forced {option.layout.describe()} passes every rule and fits "
            f"{req.gpu_spec.name} ({_gib(total)} of {_gib(usable)} usable, "
            f"recompute={option.recompute}){room}")
