"""The planner's fixed choices, in a module of their own: the CLI's option lists read them for
``hpc-mca --help``, which must not import the memory model or the planner to print them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the help text imports this module: nothing heavier at run time
    from .model import ModelShape

TORCH_CP_COMM_TYPES = ("all_gather", "a2a")
"""The context-parallel exchanges hpc-mca's own attention runs (models.context_parallel)."""
CP_COMM_TYPES = (*TORCH_CP_COMM_TYPES, "p2p")
"""Context-parallel attention exchanges (Megatron's ``cp_comm_type``); p2p is TE's alone."""
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
RECOMPUTE = ("none", "selective", "block", "full")
"""Activation recompute levels, least first: block is full recompute of the first N layers of
each pipeline chunk (Megatron's block method), N the fewest that fit (``block:N`` forces N)."""
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe")
"""The layer parts a selective recompute may name (Megatron-Core's recompute_modules that this
trainer's layers have): mlp on dense models, moe on mixtures of experts. Not offered: moe_act
(Megatron recomputes it only inside grouped-GEMM experts, which the local spec does not
build), shared_experts, gdn_norm_out (no supported model has those parts); mla_up_proj only
for multi-latent attention (:func:`recompute_parts`)."""


def recompute_parts(shape: ModelShape, te_layers: bool = False) -> tuple[str, ...]:
    """The parts ``selective:A,B`` (parallel.recompute_modules) may name for this model:
    :func:`recompute_modules_for`'s, plus mlp where an MoE model has dense-MLP layers
    (Megatron recomputes those layers' MLP only) and mla_up_proj under multi-latent attention
    (MLA's up-projections, whose Q, K and V Megatron drops after the attention kernel and
    rebuilds for its backward)."""
    parts = recompute_modules_for(shape.is_moe, te_layers)
    if shape.is_moe and shape.dense_layer_ids and "mlp" not in parts:
        parts = ("mlp", *parts)
    return parts + (("mla_up_proj",) if shape.is_mla else ())


def recompute_modules_for(moe: bool, te_layers: bool = False) -> tuple[str, ...]:
    """The parts a selective recompute of a model may name: mlp on dense models, moe on
    mixtures of experts (every layer of a supported one is an MoE layer); and moe_act where
    the layers are Transformer Engine's grouped-GEMM experts (estimates of other trainers'
    runs only)."""
    parts = tuple(m for m in RECOMPUTE_MODULES if m != ("mlp" if moe else "moe"))
    return parts + (("moe_act",) if moe and te_layers else ())


MOE_DISPATCHERS = ("alltoall", "flex")
"""MoE token dispatchers: alltoall (Megatron's MoEAlltoAllTokenDispatcher, what hpc-mca's trainer
runs) sends each of a token's top-k copies to its expert's rank; flex (DeepEP or HybridEP) sends
a token once to each node holding one of its experts and fans it out over NVLink there."""
MOE_ROUTINGS = ("dropless", "balanced")
"""How the step-time estimate spreads tokens over the experts: dropless (every token goes to the
experts its router picks, so the most-chosen experts' ranks get more than their share: what
hpc-mca's trainer runs) or balanced (every rank its share: Megatron's
moe_router_force_load_balancing, or a capacity factor that pads every expert; the estimate's
default, see PlanRequest.moe_routing)."""
