"""RoPE of an HF config, as transformers computes it: :class:`RopeSpec` and :func:`read_rope`.

Types: default, linear, llama3 and yarn (full rotary; its attention factor becomes the softmax
scale, the same product as transformers scaling cos and sin of q and k), with
``partial_rotary_factor``; multi-latent attention (DeepSeek) takes default or yarn with
DeepSeek's mscale pair, which Megatron's own yarn computes. Anything else is refused in one
:class:`ModelLoadError` line naming the config file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hpc_mca.models.errors import ModelLoadError

if TYPE_CHECKING:  # transformers is imported lazily, where a config is parsed
    from transformers import PreTrainedConfig

__all__ = ["SUPPORTED_ROPE_TYPES", "RopeSpec", "read_rope"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_MLA_ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters in transformers' terms (``rope_parameters``)."""

    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    """yarn: the factor transformers multiplies cos and sin by (so q.k by its square)."""
    partial_rotary_factor: float = 1.0
    """The leading fraction of each head's dimensions that is rotated (the rest passes)."""
    mscale: float = 1.0
    """yarn (multi-latent attention): DeepSeek's ``mscale`` (1.0 unless it and
    ``mscale_all_dim`` are both set, which is when transformers uses them)."""
    mscale_all_dim: float = 0.0
    """yarn (multi-latent attention): DeepSeek's ``mscale_all_dim`` (0: not used)."""

    def rotary_dim(self, head_dim: int) -> int:
        """Dimensions of a head that are rotated, as transformers computes them."""
        return int(head_dim * self.partial_rotary_factor)



def read_rope(cfg: PreTrainedConfig, where: str, *, mla: bool = False) -> RopeSpec:
    """RoPE from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (4.x);
    ``mla``: the model has multi-latent attention, which computes its own rope."""
    params = getattr(cfg, "rope_parameters", None)
    if params is None:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if mla:
        return _mla_rope_spec(params, rope_type, cfg, where)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{where}: rope_scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    partial = 1.0 if partial is None else float(partial)
    spec = RopeSpec(theta=float(params["rope_theta"]), type=rope_type, partial_rotary_factor=partial)
    if rope_type == "linear":
        return replace(spec, factor=float(params["factor"]))
    if rope_type == "llama3":
        return replace(
            spec,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    if rope_type == "yarn":
        return _yarn_spec(spec, params, cfg, where)
    return spec


def _mla_rope_spec(params: Mapping[str, Any], rope_type: str, cfg: PreTrainedConfig, where: str
                   ) -> RopeSpec:
    """Rope of multi-latent attention, which Megatron computes itself (its yarn equals
    transformers' with ``truncate`` on and the attention factor from mscale/mscale_all_dim)."""
    if rope_type not in _MLA_ROPE_TYPES:
        raise ModelLoadError(f"{where}: rope_scaling type {rope_type!r} is not supported with "
                             f"multi-latent attention (supported: {', '.join(_MLA_ROPE_TYPES)})")
    spec = RopeSpec(theta=float(params["rope_theta"]), type=rope_type)
    if rope_type == "default":
        return spec
    for key, fine in (("attention_factor", None), ("truncate", True)):
        if params.get(key, fine) != fine:
            raise ModelLoadError(f"{where}: rope yarn {key}={params[key]} is not supported with "
                                 f"multi-latent attention (supported: {fine})")
    mscale, mscale_all = params.get("mscale") or 0.0, params.get("mscale_all_dim") or 0.0
    both = bool(mscale) and bool(mscale_all)  # transformers uses them only together
    return replace(_yarn_ranges(spec, params, cfg), mscale=float(mscale) if both else 1.0,
                   mscale_all_dim=float(mscale_all) if both else 0.0)


def _yarn_ranges(spec: RopeSpec, params: Mapping[str, Any], cfg: PreTrainedConfig) -> RopeSpec:
    """yarn's factor (default: max over original positions, as transformers takes it), original
    context, correction range and its rounding."""
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or cfg.max_position_embeddings / original
    return replace(spec, factor=float(factor), original_max_position_embeddings=original,
                   beta_fast=float(params.get("beta_fast") or 32),
                   beta_slow=float(params.get("beta_slow") or 1),
                   truncate=bool(params.get("truncate", True)))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_spec(spec: RopeSpec, params: Mapping[str, Any], cfg: PreTrainedConfig, where: str
               ) -> RopeSpec:
    """yarn as transformers reads it (factor defaults to max / original positions; the
    attention factor from mscale / mscale_all_dim when both are set)."""
    if spec.partial_rotary_factor != 1.0:
        # transformers scales cos/sin of the rotated dimensions only: no softmax scale equals it.
        raise ModelLoadError(f"{where}: rope yarn with partial_rotary_factor="
                             f"{spec.partial_rotary_factor} is not supported (supported: 1.0)")
    spec = _yarn_ranges(spec, params, cfg)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(spec.factor, mscale) / _yarn_mscale(spec.factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(spec.factor))
    return replace(spec, attention_factor=float(attention))
