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

Export ownership: each HF element is sent by exactly one rank, the first data-parallel replica
(expert-data-parallel for experts) and, for TP-replicated tensors, TP rank 0. A tied output
layer on the last pipeline stage is imported from ``embed_tokens`` and never exported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hpc_mca.models.errors import ModelLoadError
from hpc_mca.models.hf_config import HFModelSpec

__all__ = [
    "ParamPlan",
    "Piece",
    "ShardCoords",
    "hf_tensor_shapes",
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


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of ``divisible_by * TP``."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


# --------------------------------------------------------------------------------------------
# HF names and shapes
# --------------------------------------------------------------------------------------------


def _layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def _expert_names(spec: HFModelSpec, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) weight names of one routed expert."""
    base = f"{_layer_prefix(layer)}{spec.moe_prefix}.experts.{expert}."
    if spec.model_type == "mixtral":
        return base + "w1.weight", base + "w3.weight", base + "w2.weight"
    return base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"


def _layer_shapes(spec: HFModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    p, h, d = _layer_prefix(layer), spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_attention_heads * d, spec.num_query_groups * d
    shapes: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (h,)}
    for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
        shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, h)
        if spec.qkv_bias:
            shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
    shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
    if spec.qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    if spec.is_moe:
        shapes[f"{p}{spec.moe_prefix}.gate.weight"] = (spec.num_experts, h)
        f = spec.moe_ffn_hidden_size
        for expert in range(spec.num_experts):
            gate, up, down = _expert_names(spec, layer, expert)
            shapes.update({gate: (f, h), up: (f, h), down: (h, f)})
    else:
        f = spec.ffn_hidden_size
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    return shapes


def hf_tensor_shapes(spec: HFModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``spec`` holds, in file order (embeddings, layers, head)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size)}
    for layer in range(spec.num_layers):
        shapes.update(_layer_shapes(spec, layer))
    shapes["model.norm.weight"] = (spec.hidden_size,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
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


_LAYER_PARAM = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_PARAM = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")


def plan_param(spec: HFModelSpec, c: ShardCoords, name: str, global_layer: int | None) -> ParamPlan:
    """The plan of parameter ``name`` of a GPTModel chunk; ``global_layer`` is the 0-based
    model-wide index of the transformer layer the name belongs to (None outside layers)."""
    dense_owner = c.dp_rank == 0
    replicated_owner = dense_owner and c.tp_rank == 0
    if name == "embedding.word_embeddings.weight":
        pieces = _vocab_pieces("model.embed_tokens.weight", spec, c)
        return ParamPlan(name, pieces, dense_owner, padded=True)
    if name == "output_layer.weight":
        hf = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        exported = dense_owner and not spec.tie_word_embeddings
        return ParamPlan(name, _vocab_pieces(hf, spec, c), exported, padded=True)
    if name == "decoder.final_layernorm.weight":
        return ParamPlan(name, _whole("model.norm.weight"), replicated_owner)
    match = _LAYER_PARAM.fullmatch(name)
    if match is None or global_layer is None:
        raise ModelLoadError(f"no Hugging Face tensor maps to Megatron parameter {name}")
    return _plan_layer_param(spec, c, name, global_layer, match.group(2))


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
    }
    if rest in replicated:
        return ParamPlan(name, _whole(replicated[rest]), replicated_owner)
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return ParamPlan(name, _qkv_pieces(spec, c, layer, rest.rsplit(".", 1)[1]), dense_owner)
    if rest == "self_attention.linear_proj.weight":
        width = spec.num_attention_heads * spec.head_dim
        return ParamPlan(name, _column_piece(p + "self_attn.o_proj.weight", width, c.tp_rank,
                                             c.tp_size), dense_owner)
    if rest == "mlp.linear_fc1.weight" and not spec.is_moe:
        pieces = _fc1_pieces(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                             spec.ffn_hidden_size, c.tp_rank, c.tp_size)
        return ParamPlan(name, pieces, dense_owner)
    if rest == "mlp.linear_fc2.weight" and not spec.is_moe:
        pieces = _column_piece(p + "mlp.down_proj.weight", spec.ffn_hidden_size, c.tp_rank,
                               c.tp_size)
        return ParamPlan(name, pieces, dense_owner)
    expert = _EXPERT_PARAM.fullmatch(rest)
    if expert is not None and spec.is_moe:
        return _plan_expert_param(spec, c, name, layer, int(expert.group(1)), expert.group(2))
    raise ModelLoadError(f"no Hugging Face tensor maps to Megatron parameter {name}")


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
