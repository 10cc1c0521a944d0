"""Core attention backends behind one switch: Transformer Engine, flash-attn, or plain PyTorch.

``select_attention_backend("auto")`` picks ``"te"`` when ``transformer_engine`` imports and CUDA
is available, else ``"flash"`` when ``flash_attn`` imports and CUDA is available, else
``"torch"``; ``core_attention_class`` turns the choice into the class a Megatron layer spec
takes as ``SelfAttentionSubmodules.core_attention``.

The torch backend, :class:`TorchCoreAttention`, takes the constructor and ``forward`` arguments
of Megatron's local ``DotProductAttention`` (megatron-core 0.19.2) and adds what that class
lacks: THD packed sequences (``packed_seq_params.qkv_format == "thd"``, tensors ``[t, heads,
dim]``) with attention confined to each document, padded ``cu_seqlens_*_padded`` layouts, and a
bool mask path that never produces empty softmax rows. GQA and ``softmax_scale`` behave as in
Megatron. Sliding windows, softmax offsets, attention bias and context parallelism are refused
with a ValueError rather than silently ignored.

How packed attention is computed, in three independent layers:

1. **Layout** (:class:`TokenLayout`, :func:`packed_layout`): for every token slot a tensor holds,
   which document it belongs to, its position inside that document, and the document's real
   length. It is computed from ``cu_seqlens`` (real lengths), ``cu_seqlens_padded`` (where
   documents start in the stream) and the *global* slot indices the tensor holds.
2. **Mask** (:func:`attention_allowed`): which query slot may attend which key slot, a pure
   function of two layouts: same document, key is a real token, key position not after the
   query position (causal). Nothing in it assumes the slots are contiguous.
3. **Kernel** (:func:`packed_attention`, :func:`sdpa`): groups consecutive documents into
   segments of about ``segment_tokens`` query tokens and runs one ``scaled_dot_product_attention``
   per segment with that segment's mask (a lone, unpadded, contiguous document takes the
   unmasked ``is_causal`` path). One segment per document wins on CPU when documents are long;
   grouping keeps the Python loop short when there are many short documents. On CPU in torch
   2.13 ``flex_attention`` has no backward pass (compiled) or materialises the full score
   matrix (eager), so it is not used; a single block-diagonal mask over the whole pack costs
   O(t^2) and measured 2-5x slower than per-document calls at t = 2-4k.

Context parallelism (not implemented yet) fits in without touching layers 2 and 3. With CP=2
every document is cut into 4 chunks c0..c3 and rank 0 holds [c0, c3], rank 1 holds [c1, c2]
(mirrored so causal work is balanced). A CP variant only has to (a) call :func:`packed_layout`
with the global slot indices its local queries occupy instead of ``arange(t)``, (b) gather the
keys/values of the whole document group with their global slots, and (c) run
:func:`packed_attention` on those layouts: ``attention_allowed`` compares global positions, so
the causal mask for [c0, c3] against the full document comes out right, and the segment planner
only needs each rank's slots sorted by document, which the mirrored layout keeps. The
per-segment fast path never triggers for a non-contiguous chunk pair, so it stays correct.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_SEGMENT_TOKENS",
    "FlashCoreAttention",
    "Segment",
    "TokenLayout",
    "TorchCoreAttention",
    "attention_allowed",
    "available_attention_backends",
    "choose_attention_backend",
    "core_attention_class",
    "packed_attention",
    "packed_layout",
    "plan_segments",
    "sdpa",
    "select_attention_backend",
]

ATTENTION_BACKENDS = ("te", "flash", "torch")
"""Backends in the order ``auto`` prefers them."""

DEFAULT_SEGMENT_TOKENS = 128
"""Query tokens per packed-attention segment (see benchmarks/attention_packed.py)."""

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


# --------------------------------------------------------------------------------------------
# Backend selection
# --------------------------------------------------------------------------------------------


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001 - GPU wheels fail with OSError/RuntimeError on CPU hosts too
        return False
    return True


@functools.lru_cache(maxsize=1)
def available_attention_backends() -> tuple[str, ...]:
    """Backends usable in this process, in preference order; ``"torch"`` is always last."""
    if not torch.cuda.is_available():
        return ("torch",)
    found = []
    if _importable("transformer_engine.pytorch"):
        found.append("te")
    if _importable("flash_attn"):
        found.append("flash")
    return (*found, "torch")


def choose_attention_backend(preference: str, available: Iterable[str]) -> str:
    """Resolve ``preference`` ("auto", "te", "flash" or "torch") against ``available``."""
    available = tuple(available)
    if preference == "auto":
        return next(name for name in ATTENTION_BACKENDS if name in available)
    if preference not in ATTENTION_BACKENDS:
        choices = ", ".join(repr(c) for c in ("auto", *ATTENTION_BACKENDS))
        raise ValueError(f"attention backend {preference!r} is not one of {choices}")
    if preference not in available:
        needs = "transformer_engine" if preference == "te" else "flash_attn"
        raise ValueError(
            f"attention backend {preference!r} is not available here (needs {needs} and CUDA); "
            f"available: {', '.join(available)}"
        )
    return preference


def select_attention_backend(preference: str = "auto") -> str:
    """The backend to use: "te", "flash" or "torch" (see the module docstring for ``auto``).

    An explicit choice that this machine cannot run raises ValueError naming what is available.
    """
    return choose_attention_backend(preference, available_attention_backends())


def core_attention_class(preference: str = "auto") -> type[torch.nn.Module]:
    """The Megatron layer-spec ``core_attention`` class for the selected backend."""
    backend = select_attention_backend(preference)
    if backend == "te":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    if backend == "flash":
        return FlashCoreAttention
    return TorchCoreAttention


# --------------------------------------------------------------------------------------------
# Layer 1: token layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenLayout:
    """Per token slot: document index, position within the document's slot range, and the
    document's real length; slots after the last document have doc -1, length 0 and positions
    counted from the end of the last document.

    A slot is a real token when ``pos < length``; other slots are padding.
    """

    doc: Tensor
    pos: Tensor
    length: Tensor

    @property
    def valid(self) -> Tensor:
        return self.pos < self.length

    def __len__(self) -> int:
        return self.doc.numel()

    def slice(self, start: int, end: int) -> TokenLayout:
        return TokenLayout(self.doc[start:end], self.pos[start:end], self.length[start:end])

    def to(self, device: torch.device | str) -> TokenLayout:
        return TokenLayout(self.doc.to(device), self.pos.to(device), self.length.to(device))


def _check_cu_seqlens(name: str, cu: Tensor) -> None:
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D with a leading 0, got shape {tuple(cu.shape)}")
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must start at 0 and never decrease, got {cu.tolist()}")


def packed_layout(
    cu_seqlens: Tensor,
    cu_seqlens_padded: Tensor | None = None,
    *,
    slots: Tensor | None = None,
    total: int | None = None,
) -> TokenLayout:
    """Layout of a packed stream described by ``cu_seqlens`` (real lengths) and
    ``cu_seqlens_padded`` (document starts in the stream; defaults to ``cu_seqlens``).

    ``slots`` are the global stream indices the tensor holds (default ``arange(total)``, with
    ``total`` defaulting to the padded stream length); a context-parallel rank passes the
    indices of its chunks here. Computed on the device of ``cu_seqlens``.
    """
    cu = cu_seqlens.long()
    cu_pad = cu if cu_seqlens_padded is None else cu_seqlens_padded.to(cu.device).long()
    _check_cu_seqlens("cu_seqlens", cu)
    _check_cu_seqlens("cu_seqlens_padded", cu_pad)
    if cu_pad.numel() != cu.numel():
        raise ValueError(
            f"cu_seqlens_padded has {cu_pad.numel() - 1} documents, cu_seqlens {cu.numel() - 1}"
        )
    lengths = cu[1:] - cu[:-1]
    if bool((lengths > cu_pad[1:] - cu_pad[:-1]).any()):
        raise ValueError("a document is longer than its padded slot range in cu_seqlens_padded")
    if slots is None:
        if total is not None and total < int(cu_pad[-1]):
            raise ValueError(
                f"the packed tensor holds {total} tokens but cu_seqlens describe {int(cu_pad[-1])}"
            )
        slots = torch.arange(int(cu_pad[-1]) if total is None else total, device=cu.device)
    slots = slots.to(cu.device).long()
    if lengths.numel() == 0:
        zeros = torch.zeros_like(slots)
        return TokenLayout(zeros - 1, zeros, zeros)
    doc = torch.searchsorted(cu_pad[1:], slots, right=True)
    inside = doc < lengths.numel()
    doc_safe = doc.clamp(max=lengths.numel() - 1)
    return TokenLayout(
        doc=torch.where(inside, doc, -1),
        pos=torch.where(inside, slots - cu_pad[doc_safe], slots - cu_pad[-1]),
        length=torch.where(inside, lengths[doc_safe], 0),
    )


# --------------------------------------------------------------------------------------------
# Layer 2: mask
# --------------------------------------------------------------------------------------------


def attention_allowed(
    q: TokenLayout, kv: TokenLayout, *, causal: bool, bottom_right: bool = False
) -> Tensor:
    """Bool ``[len(q), len(kv)]``: True where the query slot may attend the key slot.

    Allowed means same document, key is a real token, and (``causal``) the key is not after the
    query, aligned at the documents' starts (top-left) or, with ``bottom_right``, at their ends.
    Query rows left with nothing to attend (padding queries) are opened fully: their outputs are
    meaningless and are zeroed by the caller, and an empty row would turn into NaN in some SDPA
    kernels and their gradients.
    """
    allowed = (q.doc[:, None] == kv.doc[None, :]) & (q.doc[:, None] >= 0) & kv.valid[None, :]
    if causal:
        if bottom_right:
            allowed &= (kv.pos - kv.length)[None, :] <= (q.pos - q.length)[:, None]
        else:
            allowed &= kv.pos[None, :] <= q.pos[:, None]
    return allowed | ~allowed.any(dim=-1, keepdim=True)


# --------------------------------------------------------------------------------------------
# Layer 3: kernels
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """A group of whole documents: query slots ``[q_start, q_end)``, key slots
    ``[kv_start, kv_end)``. ``plain`` marks a single unpadded document whose slots are its
    positions 0..n-1 on both sides, which needs no explicit mask."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int
    plain: bool


def _runs(layout: TokenLayout) -> list[tuple[int, int, int, bool]]:
    """(doc, start, end, contiguous-and-unpadded) for each run of slots of one document."""
    docs, counts = torch.unique_consecutive(layout.doc.cpu(), return_counts=True)
    ends = counts.cumsum(0).tolist()
    pos, length = layout.pos.cpu().tolist(), layout.length.cpu().tolist()
    runs, start = [], 0
    for doc, end in zip(docs.tolist(), ends):
        n = end - start
        plain = pos[start] == 0 and pos[end - 1] == n - 1 and length[start] == n
        runs.append((doc, start, end, plain))
        start = end
    return runs


def plan_segments(q: TokenLayout, kv: TokenLayout, segment_tokens: int) -> list[Segment]:
    """Split two layouts into segments of whole documents holding at most ``segment_tokens``
    query slots (a longer document gets a segment of its own). Each layout must hold its
    slots grouped by document, documents in the same order on both sides, and a document's
    slots in increasing position order (true for a packed stream and for CP chunk pairs).

    Slots after the last document (``doc == -1``) belong to no segment.
    """
    q_runs = [r for r in _runs(q) if r[0] >= 0]
    kv_runs = [r for r in _runs(kv) if r[0] >= 0]
    if [r[0] for r in q_runs] != [r[0] for r in kv_runs]:
        raise ValueError("query and key layouts must hold the same documents in the same order")
    segments: list[Segment] = []
    group: list[tuple[tuple[int, int, int, bool], tuple[int, int, int, bool]]] = []

    def close() -> None:
        (_, qs, _, qplain), (_, ks, _, kplain) = group[0]
        (_, _, qe, _), (_, _, ke, _) = group[-1]
        plain = len(group) == 1 and qplain and kplain and qe - qs == ke - ks
        segments.append(Segment(qs, qe, ks, ke, plain))
        group.clear()

    for q_run, kv_run in zip(q_runs, kv_runs):
        if group and q_run[2] - group[0][0][1] > segment_tokens:
            close()
        group.append((q_run, kv_run))
    if group:
        close()
    return segments


def sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    allowed: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """``scaled_dot_product_attention`` on ``[..., heads, seq, dim]`` with grouped keys/values
    (``heads`` a multiple of the key heads) and a bool ``allowed`` mask (True = attend)."""
    q_heads, kv_heads = query.size(-3), key.size(-3)
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} key/value heads")
    if q_heads != kv_heads:
        key = key.repeat_interleave(q_heads // kv_heads, dim=-3)
        value = value.repeat_interleave(q_heads // kv_heads, dim=-3)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )


def packed_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    q_layout: TokenLayout,
    kv_layout: TokenLayout,
    *,
    causal: bool = True,
    bottom_right: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
) -> Tensor:
    """Attention over packed ``[t, heads, dim]`` tensors confined to each document.

    Returns ``[t_q, heads, dim]`` with zeros at padding query slots. Layouts may live on any
    device; planning reads them on the host.
    """
    out = query.new_zeros(query.shape[:-1] + value.shape[-1:])
    q_dev, kv_dev = q_layout.to(query.device), kv_layout.to(key.device)
    for seg in plan_segments(q_layout, kv_layout, segment_tokens):
        q = query[seg.q_start : seg.q_end].transpose(0, 1)
        k = key[seg.kv_start : seg.kv_end].transpose(0, 1)
        v = value[seg.kv_start : seg.kv_end].transpose(0, 1)
        if seg.plain:
            ctx = sdpa(q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p)
        else:
            qs, ks = q_dev.slice(seg.q_start, seg.q_end), kv_dev.slice(seg.kv_start, seg.kv_end)
            allowed = attention_allowed(qs, ks, causal=causal, bottom_right=bottom_right)
            ctx = sdpa(q, k, v, allowed=allowed, scale=scale, dropout_p=dropout_p)
            ctx = ctx.masked_fill(~qs.valid[None, :, None], 0.0)
        out[seg.q_start : seg.q_end] = ctx.transpose(0, 1)
    return out


# --------------------------------------------------------------------------------------------
# Megatron core-attention modules
# --------------------------------------------------------------------------------------------


class _CoreAttentionBase(MegatronModule):
    """Constructor shared by the non-TE backends; mirrors megatron's DotProductAttention."""

    backend_name = ""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self._refuse_unsupported(config, layer_number)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type
        self.pg_collection = pg_collection
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # scores back inside the softmax in Megatron: the net scale is unchanged.
        self.softmax_scale = (
            1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        )
        self.dropout_p = float(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def _refuse_unsupported(self, config: TransformerConfig, layer_number: int) -> None:
        name = f"{self.backend_name} attention backend"
        if config.context_parallel_size != 1:
            raise ValueError(
                f"config.context_parallel_size={config.context_parallel_size}: the {name} "
                "does not implement context parallelism yet; use the 'te' backend"
            )
        window, skip = config.window_size, config.window_attn_skip_freq
        if is_layer_window_attention(window, skip, layer_number):
            raise ValueError(f"config.window_size={window} is not supported by the {name}")
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"config.softmax_type={config.softmax_type!r} is not supported by the {name} "
                "(only 'vanilla')"
            )

    def _mask_type(self, attn_mask_type: Optional[AttnMaskType]) -> AttnMaskType:
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type == AttnMaskType.arbitrary:
            return AttnMaskType.padding  # "arbitrary" = apply the given mask as it is
        return mask_type

    def _dropout(self) -> tuple[float, contextlib.AbstractContextManager[Any]]:
        """Dropout probability for this call and the RNG context to draw it in.

        Like Megatron, draws from the model-parallel RNG tracker unless sequence parallelism is
        on; if that tracker was never seeded (no model_parallel_cuda_manual_seed), the default
        generator is used instead of failing.
        """
        p = self.dropout_p if self.training else 0.0
        if p == 0.0 or self.config.sequence_parallel:
            return p, contextlib.nullcontext()
        tracker = tensor_parallel.get_cuda_rng_tracker()
        seeded = "model-parallel-rng" in (getattr(tracker, "get_states", dict)() or {})
        if seeded or getattr(tracker, "is_inference_rng_tracker", False):
            return p, tracker.fork()
        return p, contextlib.nullcontext()

    @staticmethod
    def _is_thd(packed_seq_params: Optional[PackedSeqParams]) -> bool:
        return packed_seq_params is not None and packed_seq_params.qkv_format == "thd"


class TorchCoreAttention(_CoreAttentionBase):
    """Pure-PyTorch core attention; a drop-in for Megatron's local ``DotProductAttention``.

    Inputs follow megatron/core/transformer/attention.py: ``[s, b, heads, dim]`` (sbhd) with
    ``attention_mask`` bool, True = masked, broadcastable to ``[b, heads, sq, sk]``; or, for
    ``packed_seq_params.qkv_format == "thd"``, ``[t, heads, dim]`` (a size-1 batch dimension at
    position 1 is accepted too) with documents described by ``cu_seqlens_q/kv`` and optionally
    ``cu_seqlens_q/kv_padded``; ``attention_mask`` is ignored there, as in TE. Keys/values may
    have fewer heads (GQA). Returns ``[s, b, heads * dim]`` or ``[t, heads * dim]``; padding
    slots of a packed stream come back as zeros.

    Causal mask types add causality to any given mask (a causal mask OR-ed with itself is
    unchanged, so Megatron's ltor masks work as before); padding/arbitrary/no_mask apply the
    given mask alone.
    """

    backend_name = "torch"

    def __init__(self, *args: Any, segment_tokens: int = DEFAULT_SEGMENT_TOKENS, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.segment_tokens = segment_tokens

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the torch attention backend")
        mask_type = self._mask_type(attn_mask_type)
        dropout_p, rng = self._dropout()
        with rng:
            if self._is_thd(packed_seq_params):
                return self._forward_thd(query, key, value, mask_type, packed_seq_params, dropout_p)
            return self._forward_sbhd(query, key, value, attention_mask, mask_type, dropout_p)

    def _forward_sbhd(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        mask_type: AttnMaskType,
        dropout_p: float,
    ) -> Tensor:
        sq, sk = query.size(0), key.size(0)
        causal = mask_type in _CAUSAL_TYPES and sq > 1
        bottom_right = mask_type == AttnMaskType.causal_bottom_right and sq != sk
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if attention_mask is None and not bottom_right:
            ctx = sdpa(q, k, v, is_causal=causal, scale=self.softmax_scale, dropout_p=dropout_p)
        else:
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=query.device)
            if causal:
                allowed = allowed.tril(diagonal=sk - sq if bottom_right else 0)
            if attention_mask is not None:
                allowed = allowed & ~attention_mask.to(device=query.device, dtype=torch.bool)
            allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
            ctx = sdpa(q, k, v, allowed=allowed, scale=self.softmax_scale, dropout_p=dropout_p)
        # [b, h, s, d] -> [s, b, h * d]
        return ctx.permute(2, 0, 1, 3).reshape(sq, query.size(1), -1)

    def _forward_thd(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask_type: AttnMaskType,
        params: PackedSeqParams,
        dropout_p: float,
    ) -> Tensor:
        if query.dim() == 4:  # [t, 1, h, d] from a caller that did not squeeze the batch dim
            query, key, value = (x.squeeze(1) for x in (query, key, value))
        cu_q = _first(params.cu_seqlens_q)
        cu_kv = _first(params.cu_seqlens_kv, cu_q)
        # Layouts are planned on the host: one copy of a few ints per call.
        q_layout = packed_layout(cu_q.cpu(), _cpu(params.cu_seqlens_q_padded), total=query.size(0))
        kv_layout = packed_layout(cu_kv.cpu(), _cpu(params.cu_seqlens_kv_padded), total=key.size(0))
        ctx = packed_attention(
            query,
            key,
            value,
            q_layout,
            kv_layout,
            causal=mask_type in _CAUSAL_TYPES,
            bottom_right=mask_type == AttnMaskType.causal_bottom_right,
            scale=self.softmax_scale,
            dropout_p=dropout_p,
            segment_tokens=self.segment_tokens,
        )
        return ctx.reshape(ctx.size(0), -1)


def _cpu(tensor: Optional[Tensor]) -> Optional[Tensor]:
    return None if tensor is None else tensor.cpu()


def _first(*tensors: Optional[Tensor]) -> Tensor:
    found = next((t for t in tensors if t is not None), None)
    if found is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is required for qkv_format 'thd'")
    return found


class FlashCoreAttention(_CoreAttentionBase):
    """Core attention through flash-attn 2 (``flash_attn_func`` / ``flash_attn_varlen_func``).

    Needs CUDA and the flash_attn package; untested on the CPU machines this project is
    developed on. Supports causal or unmasked sbhd attention (a given ``attention_mask`` is
    ignored for causal types, as TE does; padding masks are refused) and THD packed sequences.
    With ``cu_seqlens_*_padded`` the padded ranges are handed to the kernel as the documents:
    causality keeps a document's trailing padding out of its real tokens, so this is refused
    for non-causal attention. Slots after the last document are returned as zeros.
    """

    backend_name = "flash"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        try:
            from flash_attn import flash_attn_func, flash_attn_varlen_func
        except ImportError as err:
            raise ValueError(f"attention backend 'flash' needs flash_attn: {err}") from err
        self._flash_attn_func = flash_attn_func
        self._flash_attn_varlen_func = flash_attn_varlen_func

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the flash attention backend")
        mask_type = self._mask_type(attn_mask_type)
        causal = mask_type in _CAUSAL_TYPES
        dropout_p, rng = self._dropout()
        with rng:
            if self._is_thd(packed_seq_params):
                return self._forward_thd(query, key, value, causal, packed_seq_params, dropout_p)
            if attention_mask is not None and not causal:
                raise ValueError(
                    f"attn_mask_type={mask_type.name} with an attention_mask is not supported by "
                    "the flash attention backend; pack sequences (thd) or use 'torch'/'te'"
                )
            q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s, h, d]
            ctx = self._flash_attn_func(
                q, k, v, dropout_p=dropout_p, softmax_scale=self.softmax_scale, causal=causal
            )
            return ctx.transpose(0, 1).reshape(query.size(0), query.size(1), -1)

    def _forward_thd(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        causal: bool,
        params: PackedSeqParams,
        dropout_p: float,
    ) -> Tensor:
        if query.dim() == 4:
            query, key, value = (x.squeeze(1) for x in (query, key, value))
        cu_q = _first(params.cu_seqlens_q_padded, params.cu_seqlens_q)
        cu_kv = _first(params.cu_seqlens_kv_padded, params.cu_seqlens_kv, cu_q)
        padded = params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None
        if padded and not causal:
            raise ValueError(
                "cu_seqlens_*_padded needs causal attention on the flash backend "
                "(padding would leak into real tokens); use the 'torch' or 'te' backend"
            )
        max_q = params.max_seqlen_q or int((cu_q[1:] - cu_q[:-1]).max())
        max_kv = params.max_seqlen_kv or int((cu_kv[1:] - cu_kv[:-1]).max())
        ctx = self._flash_attn_varlen_func(
            query,
            key,
            value,
            cu_q.to(torch.int32),
            cu_kv.to(torch.int32),
            max_q,
            max_kv,
            dropout_p=dropout_p,
            softmax_scale=self.softmax_scale,
            causal=causal,
        )
        ctx[int(cu_q[-1]) :] = 0
        return ctx.reshape(ctx.size(0), -1)
