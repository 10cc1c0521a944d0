"""Which part of which Hugging Face tensor each Megatron parameter of this rank holds.

Pure Python (no torch): the same plan drives import (read those slices from safetensors into
the parameter) and export (send those slices of the parameter to rank 0, which writes them at
the same place in the HF tensor), so the two cannot disagree.

Every sharded Megatron parameter is a set of contiguous blocks of HF tensors along one
dimension, which is what a :class:`Piece` describes:

- ``linear_qkv`` (rows): Megatron groups rows per query group, ``[q heads of the group, k, v]``,
  and TP rank r holds query groups ``[r*G/tp, (r+1)*G/tp)``; so per local group three pieces
  (rows of ``q_proj``, ``k_proj``, ``v_proj``), each contiguous in HF. Biases likewise.
- ``linear_fc1`` (rows): TP rank r holds ``[gate rows of r; up rows of r]`` (Megatron's GLU
  chunks the local output in two), so two pieces.
- ``linear_proj``/``linear_fc2`` (columns): one piece of ``o_proj``/``down_proj``.
- word embeddings / output layer (rows): vocabulary rows ``[r*Vp/tp, (r+1)*Vp/tp)`` clipped to
  the real vocabulary; rows past it are Megatron's padding, zero on import, dropped on export.
- experts: local expert j on EP rank e is global expert ``e*E/ep + j``, split over expert-TP
  ranks like the dense MLP.
- norms and the router: whole tensors, replicated over TP.
- a VL model's vision tower (``visual.*``, first stage only): transformers' own module under
  the checkpoint's names, every tensor whole, replicated over TP.
- MTP layer k (``mtp.layers.k``, deepseek_v3/glm4_moe checkpoints): HF layer
  ``num_layers + k``; ``enorm``/``hnorm`` whole, ``eh_proj`` [H, 2H] split by rows like a
  column-parallel linear (both concatenate ``[enorm(embedding); hnorm(hidden)]``),
  ``final_layernorm`` is ``shared_head.norm``, and ``mtp_model_layer`` maps like a decoder
  layer at that index. The module's copies of the vocabulary matrices (``embed_tokens``,
  ``shared_head.head``) are export-only pieces of the main embedding / output layer.

Export ownership: each HF element is sent by exactly one rank, the first data-parallel replica
(expert-data-parallel for experts) and, for TP-replicated tensors, TP rank 0. A tied output
layer on the last pipeline stage is imported from ``embed_tokens`` and never exported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hpc_mca.models.errors import ModelLoadError
from hpc_mca.models.hf_config import MTP_COPIES, HFModelSpec, MlaSpec

__all__ = [
    "MTP_COPIES",
    "ParamPlan",
    "Piece",
    "ShardCoords",
    "hf_tensor_shapes",
    "mtp_prefix",
    "padded_vocab_size",
    "plan_param",
]


@dataclass(frozen=True)
class Piece:
    """HF tensor ``hf_name``, range ``[hf_start, hf_stop)`` along ``dim`` (all of it when
    ``dim`` is None), held at offset ``local_start`` along the same dim of the parameter."""

    hf_name: str
    dim: int | None = None
    hf_start: int = 0
    hf_stop: int = 0
    local_start: int = 0

    @property
    def length(self) -> int:
        return self.hf_stop - self.hf_start


@dataclass(frozen=True)
class ShardCoords:
    """This rank's place in the parallel grid, as far as weights are concerned."""

    padded_vocab_size: int
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    dp_rank: int = 0
    """Data-parallel rank of dense parameters (including context-parallel replicas)."""
    edp_rank: int = 0
    """Data-parallel rank of expert parameters."""


@dataclass(frozen=True)
class ParamPlan:
    """The pieces of one local Megatron parameter."""

    name: str
    pieces: tuple[Piece, ...]
    exported: bool
    """This rank sends the pieces to rank 0 on export (exactly one rank does, per piece)."""
    padded: bool = False
    """Part of the parameter lies outside every piece (vocab padding): zero it on import."""
    copies: tuple[Piece, ...] = ()
    """Export-only pieces: the same elements written again under other HF names (an MTP
    module's copies of the vocabulary matrices); never read on import."""


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of ``divisible_by * TP``."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


# --------------------------------------------------------------------------------------------
# HF names and shapes
# --------------------------------------------------------------------------------------------


def _layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."




def mtp_prefix(spec: HFModelSpec, depth: int) -> str:
    """HF name prefix of MTP module ``depth`` (0-based): the layer after the decoder's."""
    return _layer_prefix(spec.num_layers + depth)


def _mtp_shapes(spec: HFModelSpec, depth: int) -> dict[str, tuple[int, ...]]:
    p, h = mtp_prefix(spec, depth), spec.hidden_size
    embed, head = MTP_COPIES
    shapes: dict[str, tuple[int, ...]] = {}
    if embed in spec.mtp_copies:
        shapes[p + embed] = (spec.vocab_size, h)
    shapes.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,),
                   p + "eh_proj.weight": (h, 2 * h)})
    shapes.update(_layer_shapes(spec, spec.num_layers + depth))
    shapes[p + "shared_head.norm.weight"] = (h,)
    if head in spec.mtp_copies:
        shapes[p + head] = (spec.vocab_size, h)
    return shapes


def _expert_names(spec: HFModelSpec, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) weight names of one routed expert."""
    base = f"{_layer_prefix(layer)}{spec.moe_prefix}.experts.{expert}."
    if spec.model_type == "mixtral":
        return base + "w1.weight", base + "w3.weight", base + "w2.weight"
    return base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"


def _attention_shapes(spec: HFModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    p, h, d = f"{_layer_prefix(layer)}self_attn.", spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_attention_heads * d, spec.num_query_groups * d
    shapes: dict[str, tuple[int, ...]] = {}
    for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
        shapes[f"{p}{proj}_proj.weight"] = (rows, h)
        if spec.qkv_bias:
            shapes[f"{p}{proj}_proj.bias"] = (rows,)
    shapes[p + "o_proj.weight"] = (h, q_rows)
    if spec.qk_norm:
        shapes[p + "q_norm.weight"] = (d,)
        shapes[p + "k_norm.weight"] = (d,)
    return shapes


def _mla_shapes(spec: HFModelSpec, mla: MlaSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Multi-latent attention, in DeepSeek's checkpoint order."""
    p, h, heads = f"{_layer_prefix(layer)}self_attn.", spec.hidden_size, spec.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {}
    if mla.q_lora_rank is None:
        shapes[p + "q_proj.weight"] = (heads * mla.qk_head_dim, h)
    else:
        shapes[p + "q_a_proj.weight"] = (mla.q_lora_rank, h)
        shapes[p + "q_a_layernorm.weight"] = (mla.q_lora_rank,)
        shapes[p + "q_b_proj.weight"] = (heads * mla.qk_head_dim, mla.q_lora_rank)
    shapes[p + "kv_a_proj_with_mqa.weight"] = (mla.kv_lora_rank + mla.qk_rope_head_dim, h)
    shapes[p + "kv_a_layernorm.weight"] = (mla.kv_lora_rank,)
    shapes[p + "kv_b_proj.weight"] = (heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                      mla.kv_lora_rank)
    shapes[p + "o_proj.weight"] = (h, heads * mla.v_head_dim)
    return shapes


def _layer_shapes(spec: HFModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    p, h = _layer_prefix(layer), spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (h,)}
    if spec.mla is not None:
        shapes.update(_mla_shapes(spec, spec.mla, layer))
    else:
        shapes.update(_attention_shapes(spec, layer))
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    if spec.is_moe_layer(layer):
        shapes.update(_moe_shapes(spec, layer))
    else:
        f = spec.ffn_hidden_size
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    return shapes


def _moe_shapes(spec: HFModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    moe, h = f"{_layer_prefix(layer)}{spec.moe_prefix}.", spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {moe + "gate.weight": (spec.num_experts, h)}
    if spec.moe_expert_bias:
        shapes[moe + "gate.e_score_correction_bias"] = (spec.num_experts,)
    f = spec.moe_ffn_hidden_size
    for expert in range(spec.num_experts):
        gate, up, down = _expert_names(spec, layer, expert)
        shapes.update({gate: (f, h), up: (f, h), down: (h, f)})
    f = spec.shared_expert_ffn_hidden_size
    if f:
        shared = moe + spec.shared_expert_prefix + "."
        shapes.update({shared + "gate_proj.weight": (f, h), shared + "up_proj.weight": (f, h),
                       shared + "down_proj.weight": (h, f)})
    if spec.shared_expert_gate:
        shapes[moe + "shared_expert_gate.weight"] = (1, h)
    return shapes


def hf_tensor_shapes(spec: HFModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``spec`` holds, in file order (embeddings, layers, head)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size)}
    for layer in range(spec.num_layers):
        shapes.update(_layer_shapes(spec, layer))
    for depth in range(spec.mtp_layers):
        shapes.update(_mtp_shapes(spec, depth))
    shapes["model.norm.weight"] = (spec.hidden_size,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    if spec.vision is not None:
        shapes.update(spec.vision.shapes())
    return shapes


# --------------------------------------------------------------------------------------------
# Pieces per parameter kind
# --------------------------------------------------------------------------------------------


def _split(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of rank's equal share of ``total``."""
    share = total // size
    return rank * share, (rank + 1) * share


def _qkv_pieces(spec: HFModelSpec, c: ShardCoords, layer: int, kind: str) -> tuple[Piece, ...]:
    p, d = f"{_layer_prefix(layer)}self_attn.", spec.head_dim
    per_group = spec.num_attention_heads // spec.num_query_groups
    first, stop = _split(spec.num_query_groups, c.tp_rank, c.tp_size)
    pieces = []
    for local, group in enumerate(range(first, stop)):
        base = local * (per_group + 2) * d
        q0 = group * per_group * d
        pieces += [
            Piece(f"{p}q_proj.{kind}", 0, q0, q0 + per_group * d, base),
            Piece(f"{p}k_proj.{kind}", 0, group * d, (group + 1) * d, base + per_group * d),
            Piece(f"{p}v_proj.{kind}", 0, group * d, (group + 1) * d, base + (per_group + 1) * d),
        ]
    return tuple(pieces)


def _fc1_pieces(gate: str, up: str, width: int, rank: int, size: int) -> tuple[Piece, ...]:
    start, stop = _split(width, rank, size)
    return (Piece(gate, 0, start, stop, 0), Piece(up, 0, start, stop, stop - start))


def _column_piece(name: str, width: int, rank: int, size: int) -> tuple[Piece, ...]:
    start, stop = _split(width, rank, size)
    return (Piece(name, 1, start, stop, 0),)


def _vocab_pieces(name: str, spec: HFModelSpec, c: ShardCoords) -> tuple[Piece, ...]:
    start, stop = _split(c.padded_vocab_size, c.tp_rank, c.tp_size)
    stop_real = min(stop, spec.vocab_size)
    if stop_real <= start:
        return ()
    return (Piece(name, 0, start, stop_real, 0),)


def _whole(name: str) -> tuple[Piece, ...]:
    return (Piece(name),)


def _vocab_copies(spec: HFModelSpec, c: ShardCoords, copies: tuple[str, ...]) -> tuple[Piece, ...]:
    """The pieces of ``copies`` (names in an MTP module) in every module the spec holds."""
    return tuple(piece for depth in range(spec.mtp_layers) for copy in copies
                 if copy in spec.mtp_copies
                 for piece in _vocab_pieces(mtp_prefix(spec, depth) + copy, spec, c))


_LAYER_PARAM = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MTP_PARAM = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
_EXPERT_PARAM = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")


def plan_param(spec: HFModelSpec, c: ShardCoords, name: str, global_layer: int | None) -> ParamPlan:
    """The plan of parameter ``name`` of a GPTModel chunk; ``global_layer`` is the 0-based
    model-wide index of the transformer layer the name belongs to (None outside layers)."""
    dense_owner = c.dp_rank == 0
    replicated_owner = dense_owner and c.tp_rank == 0
    if name == "embedding.word_embeddings.weight":
        pieces = _vocab_pieces("model.embed_tokens.weight", spec, c)
        copies = MTP_COPIES if spec.tie_word_embeddings else MTP_COPIES[:1]
        return ParamPlan(name, pieces, dense_owner, padded=True,
                         copies=_vocab_copies(spec, c, copies))
    if name == "output_layer.weight":
        hf = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        exported = dense_owner and not spec.tie_word_embeddings
        return ParamPlan(name, _vocab_pieces(hf, spec, c), exported, padded=True,
                         copies=_vocab_copies(spec, c, MTP_COPIES[1:]))
    if name == "decoder.final_layernorm.weight":
        return ParamPlan(name, _whole("model.norm.weight"), replicated_owner)
    if spec.vision is not None and name in spec.vision.shapes():
        return ParamPlan(name, _whole(name), replicated_owner)  # the tower, under its HF names
    mtp = _MTP_PARAM.fullmatch(name)
    if mtp is not None:
        return _plan_mtp_param(spec, c, name, int(mtp.group(1)), mtp.group(2))
    match = _LAYER_PARAM.fullmatch(name)
    if match is None or global_layer is None:
        raise ModelLoadError(f"no Hugging Face tensor maps to Megatron parameter {name}")
    return _plan_layer_param(spec, c, name, global_layer, match.group(2))


def _plan_mtp_param(spec: HFModelSpec, c: ShardCoords, name: str, depth: int,
                    rest: str) -> ParamPlan:
    """A parameter of MTP layer ``depth`` (see the module docstring)."""
    if depth >= spec.mtp_layers:
        raise ModelLoadError(f"Megatron parameter {name}: the checkpoint holds "
                             f"{spec.mtp_layers} MTP modules")
    p, layer = mtp_prefix(spec, depth), spec.num_layers + depth
    if rest.startswith("mtp_model_layer."):
        return _plan_layer_param(spec, c, name, layer, rest.removeprefix("mtp_model_layer."))
    replicated_owner = c.dp_rank == 0 and c.tp_rank == 0
    norms = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
             "final_layernorm.weight": "shared_head.norm.weight"}
    if rest in norms:
        return ParamPlan(name, _whole(p + norms[rest]), replicated_owner)
    if rest == "eh_proj.weight":
        start, stop = _split(spec.hidden_size, c.tp_rank, c.tp_size)
        return ParamPlan(name, (Piece(p + rest, 0, start, stop, 0),), c.dp_rank == 0)
    raise ModelLoadError(f"no Hugging Face tensor maps to Megatron parameter {name}")


def _plan_layer_param(
    spec: HFModelSpec, c: ShardCoords, name: str, layer: int, rest: str
) -> ParamPlan:
    p = _layer_prefix(layer)
    dense_owner = c.dp_rank == 0
    replicated_owner = dense_owner and c.tp_rank == 0
    replicated = {
        "input_layernorm.weight": p + "input_layernorm.weight",
        "pre_mlp_layernorm.weight": p + "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": p + "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": p + "self_attn.k_norm.weight",
        "mlp.router.weight": f"{p}{spec.moe_prefix}.gate.weight",
        "mlp.router.expert_bias": f"{p}{spec.moe_prefix}.gate.e_score_correction_bias",
        "mlp.shared_experts.gate_weight": f"{p}{spec.moe_prefix}.shared_expert_gate.weight",
    }
    if spec.mla is not None and rest.startswith("self_attention."):
        return _plan_mla_param(spec, spec.mla, c, name, layer, rest.removeprefix("self_attention."))
    if rest in replicated:
        return ParamPlan(name, _whole(replicated[rest]), replicated_owner)
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return ParamPlan(name, _qkv_pieces(spec, c, layer, rest.rsplit(".", 1)[1]), dense_owner)
    if rest == "self_attention.linear_proj.weight":
        width = spec.num_attention_heads * spec.head_dim
        return ParamPlan(name, _column_piece(p + "self_attn.o_proj.weight", width, c.tp_rank,
                                             c.tp_size), dense_owner)
    dense = _dense_mlp(spec, layer, rest)
    if dense is not None:
        mlp, width = dense
        if rest.endswith("linear_fc1.weight"):
            pieces = _fc1_pieces(mlp + "gate_proj.weight", mlp + "up_proj.weight", width,
                                 c.tp_rank, c.tp_size)
        else:
            pieces = _column_piece(mlp + "down_proj.weight", width, c.tp_rank, c.tp_size)
        return ParamPlan(name, pieces, dense_owner)
    expert = _EXPERT_PARAM.fullmatch(rest)
    if expert is not None and spec.is_moe_layer(layer):
        return _plan_expert_param(spec, c, name, layer, int(expert.group(1)), expert.group(2))
    raise ModelLoadError(f"no Hugging Face tensor maps to Megatron parameter {name}")


def _plan_mla_param(spec: HFModelSpec, mla: MlaSpec, c: ShardCoords, name: str, layer: int,
                    rest: str) -> ParamPlan:
    """Megatron's local multi-latent attention: every projection is a column-parallel linear
    (rows split over TP: the down projections too, which it gathers before their norms) except
    ``linear_proj`` (columns, per head); the latents' norms are whole."""
    p, heads = f"{_layer_prefix(layer)}self_attn.", spec.num_attention_heads
    dense_owner = c.dp_rank == 0
    norms = {"q_layernorm.weight": "q_a_layernorm.weight",
             "kv_layernorm.weight": "kv_a_layernorm.weight"}
    if rest in norms:
        return ParamPlan(name, _whole(p + norms[rest]), dense_owner and c.tp_rank == 0)
    rows = {
        "linear_q_down_proj.weight": ("q_a_proj.weight", mla.q_lora_rank or 0),
        "linear_q_up_proj.weight": ("q_b_proj.weight", heads * mla.qk_head_dim),
        "linear_q_proj.weight": ("q_proj.weight", heads * mla.qk_head_dim),
        "linear_kv_down_proj.weight": ("kv_a_proj_with_mqa.weight",
                                       mla.kv_lora_rank + mla.qk_rope_head_dim),
        "linear_kv_up_proj.weight": ("kv_b_proj.weight",
                                     heads * (mla.qk_nope_head_dim + mla.v_head_dim)),
    }
    if rest in rows:
        hf, total = rows[rest]
        start, stop = _split(total, c.tp_rank, c.tp_size)
        return ParamPlan(name, (Piece(p + hf, 0, start, stop, 0),), dense_owner)
    if rest == "linear_proj.weight":
        pieces = _column_piece(p + "o_proj.weight", heads * mla.v_head_dim, c.tp_rank, c.tp_size)
        return ParamPlan(name, pieces, dense_owner)
    raise ModelLoadError(f"no Hugging Face tensor maps to Megatron parameter {name}")


def _dense_mlp(spec: HFModelSpec, layer: int, rest: str) -> tuple[str, int] | None:
    """(HF module prefix, width) of a tensor-parallel MLP weight: a dense layer's MLP or an
    MoE layer's shared expert (split over TP like a dense MLP, not over experts)."""
    p = _layer_prefix(layer)
    if rest in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight") and not spec.is_moe_layer(layer):
        return p + "mlp.", spec.ffn_hidden_size
    shared = ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight")
    if rest in shared and spec.is_moe_layer(layer) and spec.shared_expert_ffn_hidden_size:
        return (f"{p}{spec.moe_prefix}.{spec.shared_expert_prefix}.",
                spec.shared_expert_ffn_hidden_size)
    return None


def _plan_expert_param(
    spec: HFModelSpec, c: ShardCoords, name: str, layer: int, local: int, fc: str
) -> ParamPlan:
    per_rank = spec.num_experts // c.ep_size
    gate, up, down = _expert_names(spec, layer, c.ep_rank * per_rank + local)
    width = spec.moe_ffn_hidden_size
    if fc == "1":
        pieces = _fc1_pieces(gate, up, width, c.etp_rank, c.etp_size)
    else:
        pieces = _column_piece(down, width, c.etp_rank, c.etp_size)
    return ParamPlan(name, pieces, c.edp_rank == 0)
