"""Plain-text rendering of a Plan for the CLI (no colours, fixed-width labels)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from .cost import StepTime
from .hardware import GiB
from .memory import block_layers, first_chunk_inflight, recompute_modules, vision_activation_memory
from .model import ModelShape
from .planner import Plan
from .search import TIE, evaluate, memory_workload, workload


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


def recompute_text(recompute: str) -> str:
    """``block:3`` and ``selective:A,B`` as a reader needs them; the other levels as they are."""
    if recompute.startswith("selective:"):
        return (f"selective: {', '.join(sorted(recompute_modules(recompute)))} run again in "
                "backward (recompute_modules)")
    n = block_layers(recompute)
    if n is None:
        return recompute
    return (f"block: full recompute of the first {n} layer(s) of each pipeline chunk "
            "(recompute_method=block)")


def model_structure_text(shape: ModelShape) -> str | None:
    """What the estimate models beyond a plain GPT block, for models that have it: MLA, the
    MoE block with its shared expert, dense-MLP layers, and the checkpoint's MTP layers; None
    for a model that has none of these (a dense GQA model, a plain MoE)."""
    parts = []
    if shape.is_mla:
        q = f"q_lora {shape.q_lora_rank}" if shape.q_lora_rank else "plain q_proj"
        parts.append(f"MLA ({q}, kv_lora {shape.kv_lora_rank}, heads {shape.num_attention_heads}"
                     f" × qk {shape.qk_nope_head_dim}+{shape.qk_rope_head_dim} / v "
                     f"{shape.v_head_dim}; down-projections replicated over TP)")
    fs = shape.moe_shared_expert_ffn_hidden_size
    if shape.is_moe and fs:
        gate = ", sigmoid-gated" if shape.moe_shared_expert_gate else ""
        parts.append(f"shared expert {fs} wide{gate} (TP-split like a dense MLP, not EP)")
    if shape.dense_layer_ids:
        parts.append(f"{len(shape.dense_layer_ids)} dense-MLP layer(s) ({_ranges(shape.dense_layer_ids)}"
                     f", {shape.ffn_hidden_size} wide) beside {shape.num_moe_layers} MoE layers "
                     f"({shape.num_experts} experts, top-{shape.moe_router_topk})")
    if shape.checkpoint_mtp_layers and parts:
        parts.append(f"{shape.checkpoint_mtp_layers} MTP layer(s) in the checkpoint (trained "
                     "only with mtp_num_layers)")
    return "; ".join(parts) or None


def _ranges(ids: tuple[int, ...]) -> str:
    """Layer indices as runs: (0, 1, 2, 5) -> "layers 0-2, 5"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return "layers " + ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _rows(plan: Plan) -> list[tuple[str, str]]:
    lay, mem = plan.layout, plan.memory
    structure = model_structure_text(plan.request.shape)
    return [
        *([("model", structure)] if structure else []),
        ("backend", backend_text(plan)),
        ("layout", _layout_text(plan)),
        ("batch", f"micro {plan.micro_batch_size} × DP {lay.dp} × {plan.num_microbatches} "
                  f"micro-batches = global {plan.request.global_batch_size}"),
        ("recompute", recompute_text(plan.recompute)),
        ("optimizer", _optimizer_text(plan)),
        ("memory/GPU", f"params {_gib(mem.params)} | grads {_gib(mem.grads)} | optimizer "
                       f"{_gib(mem.optimizer)} | activations {_gib(mem.activations)}"),
        ("", f"total {_gib(mem.total)} of {_gib(plan.usable_bytes)} usable "
             f"({plan.request.gpu_spec.name}: {_gib(plan.request.gpu_spec.memory_bytes)})"),
        *_vision(plan),
        ("step time", _step_time(plan)),
        ("", _breakdown(plan)),
        *_routing(plan),
        *_versus_search(plan),
        ("why", plan.reason),
    ]


def _vision(plan: Plan) -> list[tuple[str, str]]:
    """For a VL model: the images a micro-batch holds and what its vision tower keeps on the
    first pipeline stage (topology/vision.py), part of the activations above."""
    req = plan.request
    vision = req.shape.vision
    if vision is None:
        return []
    patches = vision.image_patches(req.image_max_pixels)
    tokens = patches // vision.merge_size ** 2
    images = (f"images of {req.image_max_pixels} px: {patches} patches, {tokens} tokens each, "
              f"up to {req.seq_length // tokens} a row")
    if not req.vision_trains:
        return [("vision", f"{images}; tower and projector frozen: no activations kept")]
    work = memory_workload(req, workload(req, plan.layout, plan.micro_batch_size, plan.recompute))
    kept = vision_activation_memory(req.shape, plan.layout, work)
    inflight = first_chunk_inflight(plan.layout, work)
    return [("vision", f"{images}; {' and '.join(sorted(req.vision_trains))} train: "
                       f"{_gib(kept)} of activations on the first stage ({inflight} "
                       "micro-batch(es) in flight)")]


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


def _routing(plan: Plan) -> list[tuple[str, str]]:
    """For an MoE plan with expert parallelism: what dropless routing, which this trainer runs
    and the estimate leaves out by default, would add (topology/routing.py)."""
    req = plan.request
    if plan.backend != "megatron" or not req.shape.is_moe or plan.layout.ep == 1:
        return []
    if req.moe_routing == "dropless":
        return [("routing", "dropless: the busiest expert-parallel rank's excess is counted")]
    dropless = evaluate(replace(req, moe_routing="dropless"), plan.layout,
                        plan.micro_batch_size, plan.recompute).time.total
    change = dropless / plan.step_time.total - 1
    return [("routing", f"balanced tokens per expert rank assumed; dropless routing (this "
                        f"trainer's) as unevenly as NVIDIA measured it (Qwen3-235B, EP8): "
                        f"~{dropless:.3g} s ({change:+.0%})")]


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


# --- plan --explain ----------------------------------------------------------------------------

def explain_rows(plan: Plan) -> list[dict[str, Any]]:
    """The layouts ``plan --explain`` compares, best first, each with its step time by cost
    term (StepTime's fields, which add up to ``total``): a searched plan's ranking (its own
    pick first); for a forced layout, that layout and then the search's ranking."""
    rows = []
    if plan.forced:
        rows.append(_explain_row("forced", plan.describe(), plan.micro_batch_size,
                                 plan.recompute, plan.memory.total, plan.step_time))
    ranked = plan.searched.ranking if plan.forced and plan.searched else plan.ranking
    for i, option in enumerate(ranked, 1):
        rows.append(_explain_row(str(i), option.layout.describe(), option.micro_batch_size,
                                 option.recompute, option.memory.total, option.time))
    if not rows:  # the standard backend: no layout search, only its own choice
        rows.append(_explain_row("1", plan.describe(), plan.micro_batch_size, plan.recompute,
                                 plan.memory.total, plan.step_time))
    return rows


def _explain_row(rank: str, layout: str, mbs: int, recompute: str, memory: int,
                 time: StepTime) -> dict[str, Any]:
    terms = {f.name: getattr(time, f.name) for f in fields(time)}
    return {"rank": rank, "layout": layout, "micro_batch_size": mbs, "recompute": recompute,
            "memory_gib": round(memory / GiB, 2), "step_time": time.total, "terms": terms}


def format_explain(plan: Plan) -> str:
    """The compared layouts as an aligned table: seconds per step by cost term, the total and
    how much slower than the first row. Terms that are zero in every row are left out."""
    rows = explain_rows(plan)
    names = [n for n in rows[0]["terms"] if any(r["terms"][n] for r in rows)]
    best = rows[0]["step_time"]
    head = ["#", "layout", "mbs", "recompute", "GiB", *names, "total", "vs #" + rows[0]["rank"]]
    table = [head] + [[r["rank"], r["layout"], str(r["micro_batch_size"]), r["recompute"],
                       f"{r['memory_gib']:.1f}", *(f"{r['terms'][n]:.3g}" for n in names),
                       f"{r['step_time']:.4g}", f"{r['step_time'] / best - 1:+.1%}"]
                      for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    left = {1, 3}  # the layout and recompute columns are text
    lines = ["  ".join(cell.ljust(w) if i in left else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
             for line in table]
    left_out = [n for n in rows[0]["terms"] if n not in names]
    note = (f"estimated seconds per step by cost term (topology/cost.py StepTime; they add up "
            f"to the total); times within {TIE:.0%} of the fastest tie, and the plainest of "
            f"those is picked{'; zero in every row: ' + ', '.join(left_out) if left_out else ''}")
    structure = model_structure_text(plan.request.shape)
    if structure:
        note += f"; the model's layers as sized: {structure}"
    return "\n".join(["explain: " + note, *("  " + line for line in lines)])
