"""Packed (THD) causal attention in plain PyTorch: layout, mask and kernel.

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
   grouping keeps the Python loop short when there are many short documents. A single
   block-diagonal mask over the whole pack costs O(t^2) and measured 2-5x slower than
   per-document calls at t = 2-4k on CPU. This is the ``sdpa`` kernel; the fused ones
   (torch's ``varlen_attn``, flex attention), and which one runs, are in
   :mod:`hpc_mca.models.packed_kernels`.

Context parallelism (:mod:`hpc_mca.models.context_parallel`) fits in without touching layers
2 and 3. With CP=2 every document is cut into 4 chunks c0..c3 and rank 0 holds [c0, c3], rank 1
holds [c1, c2] (mirrored so causal work is balanced). A CP variant only has to (a) call
:func:`packed_layout`
with the global slot indices its local queries occupy instead of ``arange(t)``, (b) gather the
keys/values of the whole document group with their global slots, and (c) run
:func:`packed_attention` on those layouts: ``attention_allowed`` compares global positions, so
the causal mask for [c0, c3] against the full document comes out right, and the segment planner
only needs each rank's slots sorted by document, which the mirrored layout keeps. The
per-segment fast path never triggers for a non-contiguous chunk pair, so it stays correct.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_SEGMENT_TOKENS = 128
"""Query tokens per packed-attention segment (see benchmarks/attention_packed.py)."""


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
    """``scaled_dot_product_attention`` on ``[batch, heads, seq, dim]`` with grouped keys/values
    (``heads`` a multiple of the key heads) and a bool ``allowed`` mask (True = attend).

    4-D inputs, because the fused CUDA kernels (flash, memory-efficient, cuDNN) refuse anything
    else and leave 3-D calls to the math kernel. Unmasked GQA goes in as it is
    (``enable_gqa``: the flash kernel reads shared key heads without copying them); with a mask
    the keys/values are repeated, since the memory-efficient kernel that takes masks has no
    GQA and would otherwise hand the call to the math kernel.
    """
    q_heads, kv_heads = query.size(-3), key.size(-3)
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} key/value heads")
    gqa = q_heads != kv_heads
    if gqa and allowed is not None:
        key = key.repeat_interleave(q_heads // kv_heads, dim=-3)
        value = value.repeat_interleave(q_heads // kv_heads, dim=-3)
        gqa = False
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=gqa,
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
    segments: list[Segment] | None = None,
) -> Tensor:
    """Attention over packed ``[t, heads, dim]`` tensors confined to each document.

    Returns ``[t_q, heads, dim]`` with zeros at padding query slots. Layouts may live on any
    device; planning reads them on the host. ``segments`` (default: planned here from the
    layouts and ``segment_tokens``) lets every layer of a micro-batch reuse one plan.
    """
    q_dev, kv_dev = q_layout.to(query.device), kv_layout.to(key.device)
    if segments is None:
        segments = plan_segments(q_layout, kv_layout, segment_tokens)
    # The output is assembled by one cat, with zeros for slots no segment covers: writing each
    # segment into a preallocated output would make autograd clone the whole gradient once
    # per segment in backward (segments x tokens).
    pieces, done = [], 0
    for seg in segments:
        # [1, heads, seq, dim]: 4-D, so that fused SDPA kernels accept the call (see sdpa).
        q = query[seg.q_start : seg.q_end].transpose(0, 1)[None]
        k = key[seg.kv_start : seg.kv_end].transpose(0, 1)[None]
        v = value[seg.kv_start : seg.kv_end].transpose(0, 1)[None]
        if seg.plain:
            ctx = sdpa(q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p)
        else:
            qs, ks = q_dev.slice(seg.q_start, seg.q_end), kv_dev.slice(seg.kv_start, seg.kv_end)
            allowed = attention_allowed(qs, ks, causal=causal, bottom_right=bottom_right)
            ctx = sdpa(q, k, v, allowed=allowed, scale=scale, dropout_p=dropout_p)
            ctx = ctx.masked_fill(~qs.valid[None, None, :, None], 0.0)
        pieces += [_zeros(query, value, seg.q_start - done), ctx[0].transpose(0, 1)]
        done = seg.q_end
    pieces.append(_zeros(query, value, query.size(0) - done))
    return torch.cat(pieces)


def _zeros(query: Tensor, value: Tensor, slots: int) -> Tensor:
    return query.new_zeros((slots,) + query.shape[1:-1] + value.shape[-1:])
