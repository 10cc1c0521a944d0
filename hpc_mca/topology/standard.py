"""The standard backend (``training.use_mca: false``) in the planner.

That backend trains the transformers model under transformers' Trainer: a whole model on every
GPU, data parallelism (DDP) over all of them, and Ulysses sequence parallelism (SP) over groups
of SP consecutive ranks that share each packed row (an all-to-all around attention that trades
the sequence split for a head split). So there is nothing to search but SP and the
micro-batch: TP, PP, CP, EP, VP and the distributed optimizer are Megatron-Core's and are
refused, as the trainer's own rules (config/rules.py ``_check_standard``) refuse them.

Memory and step time reuse memory.py and cost.py on ``Layout(cp=SP, dp=world/SP)``: Ulysses
groups are consecutive ranks like Megatron's CP groups (the trainer builds its process groups
from that very layout), each rank holds seq/SP tokens of a row, and the exchange is the
all-to-all of ``cp_comm_type='a2a'``; the gradient all-reduce spans DP·SP, the whole world, as
DDP's does. That layout never leaves the planner: a Plan shows ``DP × SP`` and an all-ones
model-parallel layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import LayoutError
from .hardware import GiB
from .layout import FIELD_NAMES, Layout, divisors
from .rules import check_layout
from .search import PLAN_HEADROOM, TIE, Option, evaluate, fastest, micro_batch_options, planning_budget

if TYPE_CHECKING:
    from .planner import PlanRequest

BACKENDS = ("megatron", "standard")
"""PlanRequest.backend: Megatron-Core (``training.use_mca: true``) or the standard backend."""

_WHOLE_MODEL = ("the standard backend keeps a whole model on every GPU (data and Ulysses "
                "sequence parallelism only)")
_OPTIMIZER = ("the distributed optimizer is Megatron-Core's (the standard backend keeps Adam's "
              "state whole on every GPU)")
_RECOMPUTE = ("the planner sizes the standard backend without activation recompute (its "
              "gradient checkpointing of every layer is the config's gradient_checkpointing=true)")
_MTP = "multi-token prediction layers are Megatron-Core's"


def megatron_only_line(given: str, valid: str, why: str = _WHOLE_MODEL) -> str:
    """One line refusing a Megatron-only setting with the standard backend. ``given`` is the
    setting as the user wrote it (``--tp 2``, ``parallel.tensor_model_parallel_size=2``) and
    ``valid`` what the standard backend takes instead."""
    return f"{given} with training.use_mca=false: {why}; valid: {valid}, or training.use_mca=true"


def sp_with_megatron_line(given: str, cp: str = "context_parallel_size") -> str:
    """One line refusing Ulysses SP > 1 with the Megatron backend (``cp``: how the caller
    names Megatron's own sequence split)."""
    return (f"{given} with training.use_mca=true: Ulysses sequence parallelism is the standard "
            f"backend's; valid: 1 (Megatron splits sequences with {cp}), or "
            "training.use_mca=false")


def ulysses_sizes(req: PlanRequest) -> list[int]:
    """SP sizes the trainer accepts: divisors of the world size, the attention heads and the
    key/value heads (each rank of a group gets whole heads of both); 1 under multi-latent
    attention (config/rules.py refuses Ulysses there)."""
    shape = req.shape
    if shape.is_mla:
        return [1]
    return [n for n in divisors(req.world_size)
            if shape.num_attention_heads % n == 0 and shape.num_query_groups % n == 0]


def ulysses_layout(sp: int, world_size: int) -> Layout:
    """The layout memory.py and cost.py size an SP group with (see the module doc)."""
    return Layout(cp=sp, dp=world_size // sp)


def standard_request_violations(req: PlanRequest) -> list[str]:
    """One line per setting the chosen backend cannot run (empty: none)."""
    sp = req.sequence_parallel_size
    if req.backend not in BACKENDS:
        return [f"backend={req.backend!r} is not valid; valid: {', '.join(BACKENDS)}"]
    if req.backend == "megatron":
        return [] if sp in (None, 1) else [sp_with_megatron_line(f"sequence_parallel_size={sp}")]
    lines = _layout_lines(req.layout)
    if req.use_distributed_optimizer:
        lines.append(megatron_only_line("use_distributed_optimizer=True", "False", _OPTIMIZER))
    if req.recompute not in (None, "none"):
        lines.append(megatron_only_line(f"recompute={req.recompute!r}", "'none'", _RECOMPUTE))
    if req.mtp_num_layers:
        lines.append(megatron_only_line(f"mtp_num_layers={req.mtp_num_layers}", "0", _MTP))
    shape = req.shape
    if shape.is_moe and not shape.moe_router_expert_bias:
        name = f"model {shape.name}" if shape.name else "the model"
        lines.append(f"{name} is a mixture of experts ({shape.num_experts} experts) with "
                     "training.use_mca=false: the standard backend's loss has no router "
                     "load-balancing term; valid: a dense model or one whose router is balanced "
                     "by its bias (glm4_moe, deepseek_v3), or training.use_mca=true")
    elif shape.is_mla and sp not in (None, 1):
        lines.append(f"sequence_parallel_size={sp} with multi-latent attention and "
                     "training.use_mca=false: Ulysses is not built for its query/key and value "
                     "heads of different widths; valid: 1, or training.use_mca=true")
    elif sp is not None and sp not in ulysses_sizes(req):
        lines.append(f"sequence_parallel_size={sp} must divide the world size {req.world_size}, "
                     f"num_attention_heads={shape.num_attention_heads} and num_key_value_heads="
                     f"{shape.num_query_groups} (Ulysses splits heads over the ranks); valid: "
                     + ", ".join(map(str, ulysses_sizes(req))))
    return lines


def _layout_lines(layout: Layout | None) -> list[str]:
    if layout is None:
        return []
    lines = [megatron_only_line(f"{FIELD_NAMES[short]}={getattr(layout, short)}", "1")
             for short in ("tp", "pp", "cp", "ep", "etp") if getattr(layout, short) > 1]
    if layout.vp is not None and layout.vp > 1:
        lines.append(megatron_only_line(f"{FIELD_NAMES['vp']}={layout.vp}", "1"))
    if layout.pipeline_layout is not None:
        lines.append(megatron_only_line(f"pipeline_layout={layout.pipeline_layout}", "None"))
    return lines


# --- search ------------------------------------------------------------------------------------

def standard_options(req: PlanRequest) -> list[Option]:
    """Every (SP, micro-batch) that passes the trainer's batch rule and fits, best first; the
    options' layouts are ulysses_layout()s. A forced SP may use the whole usable memory (the
    headroom is then the user's call, as for a forced Megatron layout).

    Raises LayoutError: the batch rule's line when no size passes it, else one line with the
    leanest estimate when nothing fits one GPU.
    """
    forced_sp = req.sequence_parallel_size
    forced = forced_sp is not None
    sizes = [forced_sp] if forced_sp is not None else ulysses_sizes(req)
    budget = req.gpu_spec.usable_bytes if forced else planning_budget(req)
    options: list[Option] = []
    leanest: Option | None = None
    rule_lines: list[str] = []
    for sp in sizes:
        layout = ulysses_layout(sp, req.world_size)
        for mbs in micro_batch_options(req, layout):
            lines = batch_violations(req, sp, mbs)
            if lines:
                rule_lines = rule_lines or lines
                continue
            option = evaluate(req, layout, mbs, "none")
            if option.memory.total <= budget:
                options.append(option)
            elif leanest is None or option.memory.total < leanest.memory.total:
                leanest = option
    if options:
        return fastest(options)
    if leanest is None:
        raise LayoutError(rule_lines)
    raise LayoutError(_no_fit_line(req, leanest, budget, forced))


def batch_violations(req: PlanRequest, sp: int, mbs: int) -> list[str]:
    """The trainer's batch rule for the standard backend: the global batch splits into
    micro-batches over the world/SP data-parallel ranks."""
    return check_layout(Layout(), req.world_size // sp, req.shape,
                        global_batch_size=req.global_batch_size, micro_batch_size=mbs)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def describe(sp: int, dp: int) -> str:
    """``DP4 × SP2``: the standard backend's layout (DP·SP = world)."""
    return f"DP{dp} × SP{sp}"


def _describe_layout(layout: Layout) -> str:
    # Options' layouts come from ulysses_layout(), which sets dp (1 as the planner's describe).
    return describe(layout.cp, layout.dp or 1)


def _no_fit_line(req: PlanRequest, leanest: Option, budget: int, forced: bool) -> str:
    mem, gpu = leanest.memory, req.gpu_spec
    room = ("usable" if forced else
            f"per GPU: {_gib(gpu.usable_bytes)} usable less {PLAN_HEADROOM:.0%} headroom")
    name = req.shape.name or f"the {req.shape.num_layers}-layer model"
    return (f"{name} does not fit one {gpu.name} with training.use_mca=false: the standard "
            f"backend keeps a whole model on every GPU, and the leanest option "
            f"({_describe_layout(leanest.layout)}, micro-batch "
            f"{leanest.micro_batch_size}) needs {_gib(mem.total)} (params {_gib(mem.params)}, "
            f"grads {_gib(mem.grads)}, optimizer {_gib(mem.optimizer)}, activations "
            f"{_gib(mem.activations)}), more than the {_gib(budget)} {room}; valid: "
            "training.use_mca=true (Megatron-Core model parallelism), LoRA, a shorter "
            "seq_length or a larger GPU")


def standard_reason(req: PlanRequest, ranked: list[Option]) -> str:
    """One line on why the first option won."""
    best, gpu = ranked[0], req.gpu_spec
    lay = best.layout
    fits = f"{_gib(best.memory.total)} of {_gib(gpu.usable_bytes)} usable"
    if req.sequence_parallel_size is not None:
        room = ("" if best.memory.total <= planning_budget(req) else
                f"; inside the {PLAN_HEADROOM:.0%} headroom the search keeps free, so "
                "fragmentation may run it out of memory")
        head = f"user-forced SP{lay.cp} fits {gpu.name} with a whole model per GPU ({fits}){room}"
    else:
        sizes = len({o.layout.cp for o in ranked})
        head = (f"{_describe_layout(lay)}: the fastest estimated step of {sizes} Ulysses "
                f"size(s) that fit {gpu.name} with a whole model per GPU and "
                f"{PLAN_HEADROOM:.0%} headroom ({fits})")
    parts = [head]
    other = next((o for o in ranked if o.layout.cp != lay.cp), None)
    if other is not None:
        slower = other.time.total / best.time.total - 1
        parts.append(f"SP{other.layout.cp} is as fast (within {TIE:.0%}); this one is plainer"
                     if slower <= TIE else f"SP{other.layout.cp} is {slower:.0%} slower")
    if lay.cp > 1:
        parts.append(f"Ulysses SP{lay.cp} splits each {req.seq_length}-token row over "
                     f"{lay.cp} GPUs")
    else:
        parts.append("each row fits one GPU, so every GPU does data parallelism")
    return "; ".join(parts)
