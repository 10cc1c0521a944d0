"""Plain-text rendering of a Plan for the CLI (no colours, fixed-width labels)."""

from __future__ import annotations

from .hardware import GiB
from .planner import Plan


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _header(plan: Plan) -> str:
    req = plan.request
    name = req.shape.name or f"{req.shape.num_layers}-layer model"
    lora = " LoRA" if req.lora else " freeze" if req.freeze is not None else ""
    packed = " packed" if req.sequence_packing else ""
    return (f"plan for {name}: {req.nodes} node(s) × {req.node_size} {req.gpu_spec.name} "
            f"(world {req.world_size}), {req.stage}{lora} {req.precision}, seq {req.seq_length}"
            f"{packed}, global batch {req.global_batch_size}")


def backend_text(plan: Plan) -> str:
    """Which trainer runs the plan, and why (the config key that picks it)."""
    if plan.backend == "standard":
        return (f"standard (training.use_mca=false): transformers Trainer, DP "
                f"{plan.layout.dp} × Ulysses SP {plan.sequence_parallel_size}")
    return "megatron-core (training.use_mca=true, the default)"


def _layout_text(plan: Plan) -> str:
    source = "forced" if plan.forced else "planned"
    if plan.backend == "standard":
        return f"{plan.describe()}  ({source}; a whole model per GPU: TP, PP, CP and EP are 1)"
    sp = "on" if plan.sequence_parallel else "off"
    cp = f"; CP attention {plan.request.cp_comm_type}" if plan.layout.cp > 1 else ""
    return f"{plan.describe()}  ({source}; sequence parallel {sp}{cp})"


def _optimizer_text(plan: Plan) -> str:
    if plan.use_distributed_optimizer:
        return "distributed (sharded over data-parallel ranks)"
    if plan.backend == "standard":
        return "replicated (the distributed optimizer is Megatron-Core's)"
    return "replicated (not sharded)"


def _rows(plan: Plan) -> list[tuple[str, str]]:
    lay, mem = plan.layout, plan.memory
    return [
        ("backend", backend_text(plan)),
        ("layout", _layout_text(plan)),
        ("batch", f"micro {plan.micro_batch_size} × DP {lay.dp} × {plan.num_microbatches} "
                  f"micro-batches = global {plan.request.global_batch_size}"),
        ("recompute", plan.recompute),
        ("optimizer", _optimizer_text(plan)),
        ("memory/GPU", f"params {_gib(mem.params)} | grads {_gib(mem.grads)} | optimizer "
                       f"{_gib(mem.optimizer)} | activations {_gib(mem.activations)}"),
        ("", f"total {_gib(mem.total)} of {_gib(plan.usable_bytes)} usable "
             f"({plan.request.gpu_spec.name}: {_gib(plan.request.gpu_spec.memory_bytes)})"),
        ("step time", _step_time(plan)),
        ("", _breakdown(plan)),
        *_versus_search(plan),
        ("why", plan.reason),
    ]


def _step_time(plan: Plan) -> str:
    return (f"~{plan.step_time.total:.3g} s estimated "
            f"({plan.tokens_per_second_per_gpu:,.0f} tokens/s per GPU)")


def _breakdown(plan: Plan) -> str:
    """The causes that take at least 1% of the step, largest first."""
    shares = sorted(plan.step_time.shares().items(), key=lambda kv: -kv[1])
    # The standard backend's sequence exchange is Ulysses' all-to-all, estimated as CP's a2a.
    names = {"context_parallel": "Ulysses all-to-all"} if plan.backend == "standard" else {}
    return ", ".join(f"{names.get(name, name.replace('_', ' '))} {share:.0%}"
                     for name, share in shares if share >= 0.01)


def _versus_search(plan: Plan) -> list[tuple[str, str]]:
    """For a forced layout, the planner's own choice for the same job and its estimate."""
    if not plan.forced:
        return []
    if plan.searched is None:
        return [("planner", "no layout of its own fits with its headroom")]
    other = plan.searched
    change = other.step_time.total / plan.step_time.total - 1
    return [("planner", f"would choose {other.describe()}, micro {other.micro_batch_size},"
                        f" recompute {other.recompute}: ~{other.step_time.total:.3g} s "
                        f"({change:+.0%} vs forced)")]


def format_plan_table(plan: Plan) -> str:
    """The plan as a short, aligned text table, header line first."""
    width = max(len(label) for label, _ in _rows(plan))
    lines = [_header(plan)] + [f"  {label:<{width}}  {text}" for label, text in _rows(plan)]
    return "\n".join(lines)
