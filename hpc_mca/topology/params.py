"""Parameters one GPU holds: one layer of each kind (dense-MLP, MoE, MTP) under TP/EP/ETP, and
one pipeline stage's layers, tables and LoRA adapters (:func:`stage_counts`); the memory
model (memory.py) turns them into bytes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from .attention import attention_weights, lora_attention
from .freeze import layer_ids_on_rank
from .layout import Layout
from .model import ModelShape, layer_view


@dataclass(frozen=True)
class ParamCounts:
    """Parameters held by one GPU, split by how they are sharded."""

    dense: int = 0     # TP-sharded (or replicated) weights; optimizer sharded over DP·CP
    expert: int = 0    # routed experts, sharded over EP·ETP; optimizer over expert DP
    adapters: int = 0  # LoRA adapters (the only trainable weights with LoRA)


def padded_vocab(model: ModelShape, tp: int) -> int:
    """Megatron pads the vocabulary so each TP shard is a multiple of 128 rows."""
    step = 128 * tp
    return -(-model.vocab_size // step) * step


def layers_on_rank(model: ModelShape, layout: Layout, rank: int) -> int:
    """Transformer layers a pipeline rank holds (all its virtual chunks)."""
    if layout.pipeline_layout is None:
        return model.num_layers // layout.pp
    return sum(layout.pipeline_layout[rank::layout.pp])


def mlp_matrices(model: ModelShape) -> int:
    return 3 if model.gated_linear_unit else 2


def layer_kinds_on_rank(model: ModelShape, layout: Layout, rank: int) -> tuple[int, int]:
    """(dense-MLP layers, MoE layers) pipeline rank ``rank`` holds; a model that mixes them
    (DeepSeek-V3's first three layers are dense) has its dense ones on the first stages."""
    n = layers_on_rank(model, layout, rank)
    if not model.is_moe:
        return n, 0
    if not model.dense_layer_ids:
        return 0, n
    moe = sum(model.is_moe_layer(i) for i in layer_ids_on_rank(model, layout, rank))
    return n - moe, moe


def mtp_view(model: ModelShape) -> ModelShape:
    """The kind of layer an MTP depth holds: Megatron builds it with the decoder's last layer's
    spec (an MoE layer in an MoE model: DeepSeek-V3's MTP module has 256 experts)."""
    return layer_view(model, model.is_moe)


def layer_counts(model: ModelShape, layout: Layout, lora_rank: int) -> ParamCounts:
    """Parameters of one transformer layer on one GPU (an MoE layer if ``model`` has any: pass
    a layer_view for the other kind)."""
    return _layer_counts_at(layer_view(model, model.is_moe), layout.tp, layout.ep, layout.etp,
                            lora_rank)


# The planner sizes thousands of layouts that share a few TP/EP/ETP splits: remember them.
@lru_cache(maxsize=1024)
def _layer_counts_at(model: ModelShape, tp: int, ep: int, etp: int,
                     lora_rank: int) -> ParamCounts:
    h, mats = model.hidden_size, mlp_matrices(model)
    attn, replicated = attention_weights(model)  # MLA's down-projections are replicated
    # LoRA (models.lora): one (A, B) per HF module (see _lora_attention).
    r = lora_rank
    lora_attn = lora_attention(model, r, tp)
    if not model.is_moe:
        mlp = mats * h * model.ffn_hidden_size
        return ParamCounts(dense=(attn + mlp) // tp + replicated + 2 * h,
                           adapters=lora_attn + _lora_mlp(r, h, model.ffn_hidden_size, mats, tp))
    fe, fs = model.expert_ffn_hidden_size, model.moe_shared_expert_ffn_hidden_size
    local_experts = model.num_experts // ep
    # Replicated on every TP rank: the router, its per-expert score bias (DeepSeek-V3) and a
    # shared expert's 1×h sigmoid gate (Qwen2-MoE; Megatron's SharedExpertMLP keeps it whole).
    router = (h + int(model.moe_router_expert_bias)) * model.num_experts
    router += h * int(model.moe_shared_expert_gate) + replicated
    shared = mats * h * fs  # TP-split like a dense MLP (SharedExpertMLP), never EP-split
    expert = local_experts * mats * h * fe // etp
    # An expert's fused gate/up weight has one A (transformers keeps it as one parameter).
    lora_expert = local_experts * (2 * r * h + r * ((mats - 1) * fe + fe) // etp)
    # A shared expert takes no adapters (topology.lora: peft moves its names onto the experts).
    return ParamCounts(dense=(attn + shared) // tp + router + 2 * h, expert=expert,
                       adapters=lora_attn + lora_expert)


def _lora_mlp(r: int, h: int, ffn: int, mats: int, tp: int) -> int:
    """LoRA parameters of a dense MLP on one GPU: gate and up (column) and down (row)."""
    return (mats - 1) * r * h + r * (mats - 1) * ffn // tp + r * ffn // tp + r * h


def checkpoint_parameters(model: ModelShape) -> tuple[int, int]:
    """(main model, MTP layers) parameters of the HF checkpoint, as transformers counts them
    (buffers such as the router's score bias included): every layer of its kind, the
    embedding, the output layer unless tied, the final norm, a VL model's vision tower; each MTP layer is an MoE (or
    dense) layer plus DeepSeek's eh_proj (2h→h), its three norms and its own copies of the
    embedding and the output head (``embed_tokens``, ``shared_head.head``)."""
    h, v = model.hidden_size, model.vocab_size

    def layer(kind: ModelShape) -> int:
        counts = _layer_counts_at(kind, 1, 1, 1, 0)
        return counts.dense + counts.expert

    moe = model.num_moe_layers
    main = (moe * layer(layer_view(model, True)) if moe else 0) + \
        (model.num_layers - moe) * layer(layer_view(model, False))
    main += v * h * (1 if model.tie_word_embeddings else 2) + h + model.vision_params
    mtp = model.checkpoint_mtp_layers * (layer(mtp_view(model)) + 2 * h * h + 3 * h + 2 * v * h)
    return main, mtp


@lru_cache(maxsize=4096)  # pure; the planner asks for the same stages many times over
def stage_counts(model: ModelShape, layout: Layout, rank: int, lora_rank: int,
                 mtp_layers: int = 0) -> ParamCounts:
    """Parameters on one GPU of pipeline rank ``rank``: its layers plus embedding/output, and
    ``mtp_layers`` MTP depths (each a layer, a 2h→h projection and three norms, and with
    PP > 1 an embedding copy on the last stage)."""
    dense_layers, moe_layers = layer_kinds_on_rank(model, layout, rank)
    dense_kind = layer_counts(layer_view(model, False), layout, lora_rank)
    if model.is_moe:  # an MoE model's dense MLPs take no adapters (topology.lora)
        dense_kind = dataclasses.replace(dense_kind, adapters=lora_attention(model, lora_rank,
                                                                             layout.tp))
    moe_kind = layer_counts(layer_view(model, True), layout, lora_rank) if moe_layers else \
        ParamCounts()
    mtp_kind = layer_counts(mtp_view(model), layout, lora_rank)
    h = model.hidden_size
    table = padded_vocab(model, layout.tp) * h // layout.tp
    first, last = rank == 0, rank == layout.pp - 1
    # The output layer is its own matrix unless tied; with PP > 1 even a tied one is copied to
    # the last stage, which is where Megatron keeps its gradient in sync with the embedding.
    tables = int(first) + int(last and (layout.pp > 1 or not model.tie_word_embeddings))
    # MTP embeds its input tokens itself: a last stage that is not also the first builds its
    # own copy of the embedding (Megatron's mtp_process), beside the output layer.
    tables += int(last and not first and mtp_layers > 0)
    mtp = mtp_layers * (mtp_kind.dense + 2 * h * h // layout.tp + 3 * h)
    return ParamCounts(
        dense=dense_layers * dense_kind.dense + moe_layers * moe_kind.dense + tables * table
        + int(last) * h + mtp + int(first) * model.vision_params,
        expert=moe_layers * moe_kind.expert + mtp_layers * mtp_kind.expert,
        adapters=dense_layers * dense_kind.adapters + moe_layers * moe_kind.adapters)
