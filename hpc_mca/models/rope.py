"""RoPE on packed (THD) streams in one pass, through the slot Megatron keeps for a fused kernel.

Without Transformer Engine, Megatron-Core rotates a THD stream one document at a time
(``rope_utils._apply_rotary_pos_emb_thd``): it splits the stream, rotates each piece and copies
it into a preallocated output. Autograd records one ``CopySlices`` per document, and each of
those clones the whole stream's gradient in backward, so the backward costs documents × tokens:
measured on the 2-core VM, one q-shaped tensor (16,384 tokens in 31 documents of the
log-normal SFT mix, 8 heads × 64, fp32) took 372 ms forward+backward that way and 106 ms in
one pass (3.5x; ``benchmarks/rope_packed.py``). On a GPU the loop also launches ~8 kernels
per document, for q and k, in every layer.

:func:`packed_rope` gives every token its position inside its own document (the same
positions Megatron's loop gives, context-parallel halves included), gathers the frequency rows
once and rotates the whole stream with Megatron's own bshd function, so the numbers are the
loop's bit for bit (tests/test_rope.py). The positions are computed once per micro-batch: every
layer is handed the same ``cu_seqlens`` tensor.

Megatron calls it when ``TransformerConfig.apply_rope_fusion`` is set, through
``rope_utils.fused_apply_rotary_pos_emb_thd`` (and ``fused_apply_rotary_pos_emb`` for unpacked
batches), the module attributes that hold TE's fused kernels when TE is installed;
:func:`configure` puts these two there, with or without TE (TE's THD kernel wants
``cu_seqlens`` on the GPU, where this trainer keeps them on the host, and it was never
measured here). With ``model.fusions: [rope]`` the rotation itself is compiled by
torch.compile (its elementwise steps fused); without, it runs eagerly with Megatron's unfused
arithmetic. The slots are process-wide: the last model built in a process decides compiled or
eager for all of them.
Megatron's fused THD call passes no attention scale (``mscale``), which only YaRN RoPE sets;
hf_config refuses YaRN, so nothing is lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from torch import Tensor

from hpc_mca.models.errors import ModelLoadError

if TYPE_CHECKING:
    from hpc_mca.models.hf_config import HFModelSpec

__all__ = ["configure", "describe", "packed_rope", "per_token", "thd_positions", "unpacked_rope"]


def thd_positions(cu_seqlens: Tensor, tokens: int, cp_size: int = 1, cp_rank: int = 0) -> Tensor:
    """Each local token's position inside its document, int64 [tokens], on ``cu_seqlens``' device.

    ``cu_seqlens`` are the whole stream's (padded) document boundaries. Under context
    parallelism a rank holds ``len/cp`` tokens of each document: half-chunk ``cp_rank`` from the
    front and half-chunk ``2·cp-1-cp_rank`` from the back (Megatron's load-balanced split).
    """
    cu = cu_seqlens.long()
    full = cu[1:] - cu[:-1]
    local = full // cp_size
    if cu.device.type == "cpu" and int(local.sum()) != tokens:  # on a GPU this would sync
        raise ValueError(f"cu_seqlens {cu.tolist()} (CP {cp_size}) describes {int(local.sum())} "
                         f"local tokens; the tensor holds {tokens}")
    starts = torch.repeat_interleave(cu[:-1] // cp_size, local, output_size=tokens)
    inside = torch.arange(tokens, device=cu.device) - starts
    if cp_size == 1:
        return inside
    half = torch.repeat_interleave(local // 2, local, output_size=tokens)
    length = torch.repeat_interleave(full, local, output_size=tokens)
    front = cp_rank * half + inside
    back = length - (cp_rank + 1) * half + (inside - half)
    return torch.where(inside < half, front, back)


class _PositionCache:
    """The positions of the last ``cu_seqlens`` seen: every layer (q and k) of a micro-batch
    passes the same tensor object, so the host work and the copy to the device happen once.
    The cache holds that tensor, so its id cannot be reused by another while cached."""

    def __init__(self) -> None:
        self.cu_seqlens: Tensor | None = None
        self.layout: tuple[int, int, int, torch.device] | None = None
        self.positions: Tensor | None = None

    # Host work once per micro-batch: a compiled layer (model.fusions: [layer]) runs it eagerly,
    # as dynamo cannot key a cache on a tensor's identity, and inductor (torch 2.13) fails to
    # lower repeat_interleave with a data-dependent output_size.
    @torch.compiler.disable
    def get(self, cu_seqlens: Tensor, tokens: int, cp_size: int, cp_rank: int,
            device: torch.device) -> Tensor:
        layout = (tokens, cp_size, cp_rank, device)
        if self.positions is None or self.cu_seqlens is not cu_seqlens or self.layout != layout:
            positions = thd_positions(cu_seqlens, tokens, cp_size, cp_rank)
            self.positions = positions.to(device, non_blocking=True)
            self.cu_seqlens, self.layout = cu_seqlens, layout
        return self.positions


_positions = _PositionCache()


def _rotate_eager(t: Tensor, freqs: Tensor, interleaved: bool) -> Tensor:
    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


_rotate: Callable[[Tensor, Tensor, bool], Tensor] = _rotate_eager


def packed_rope(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, cp_size: int = 1, cp_rank: int = 0,
                interleaved: bool = False) -> Tensor:
    """RoPE on a THD stream ``t`` [tokens, heads, dim]; ``freqs`` [max_len, 1, 1, rot_dim] are
    Megatron's per-position angles. TE's ``fused_apply_rotary_pos_emb_thd`` signature."""
    if getattr(freqs, _PER_TOKEN, False):  # multimodal rope: already each token's own angles
        return _rotate(t.unsqueeze(1), freqs, interleaved).squeeze(1)
    positions = _positions.get(cu_seqlens, t.size(0), cp_size, cp_rank, t.device)
    return _rotate(t.unsqueeze(1), freqs[positions], interleaved).squeeze(1)


_PER_TOKEN = "hpc_mca_per_token"


def per_token(freqs: Tensor) -> Tensor:
    """Mark ``freqs`` [tokens, 1, 1, rot_dim] as holding every token's own angles, not a table
    indexed by position: multimodal rope computes them from each token's three position rows
    (:mod:`.vl`), so a packed stream is rotated with them as they are, token by token."""
    setattr(freqs, _PER_TOKEN, True)
    return freqs


def unpacked_rope(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """RoPE on ``t`` [seq, batch, heads, dim]; TE's ``fused_apply_rotary_pos_emb`` signature."""
    return _rotate(t, freqs, interleaved)


def describe(fused: bool) -> str:
    """What RoPE runs as, for the start-up line; ``fused`` is ``model.fusions: [rope]``."""
    return "one compiled pass per stream" if fused else "one pass per stream"


def configure(overrides: Mapping[str, Any] | None, spec: HFModelSpec | None = None
              ) -> dict[str, Any]:
    """The config overrides of a model about to be built, with RoPE's slots filled.

    ``overrides["apply_rope_fusion"]`` is the user's ``model.fusions: [rope]``: it decides
    whether the rotation is compiled. Either way Megatron's fused-RoPE slots get
    :func:`packed_rope`/:func:`unpacked_rope` and ``apply_rope_fusion`` is set, so that
    Megatron calls them. A model with multi-latent attention (``spec.mla``) applies its own
    rope, unfused (Megatron's fused MLA rope is a Triton kernel): ``apply_rope_fusion`` off,
    and ``fusions: [rope]`` refused.
    """
    global _rotate
    out = dict(overrides or {})
    if spec is not None and spec.mla is not None:
        if out.get("apply_rope_fusion"):
            raise ModelLoadError(f"{spec.source}: model.fusions 'rope' with multi-latent attention "
                                 f"({spec.model_type}) is not supported; valid: fusions without "
                                 "'rope'")
        return {**out, "apply_rope_fusion": False}
    _rotate = _compiled_rotate() if out.get("apply_rope_fusion") else _rotate_eager
    rope_utils.fused_apply_rotary_pos_emb_thd = packed_rope
    rope_utils.fused_apply_rotary_pos_emb = unpacked_rope
    out["apply_rope_fusion"] = True
    return out


_COMPILED: Callable[[Tensor, Tensor, bool], Tensor] | None = None


def _compiled_rotate() -> Callable[[Tensor, Tensor, bool], Tensor]:
    """The rotation under torch.compile, built once per process; dynamic shapes, as every
    micro-batch's stream length and heads may differ (Megatron compiles its fusions alike)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_rotate_eager, dynamic=True)
    return _COMPILED
