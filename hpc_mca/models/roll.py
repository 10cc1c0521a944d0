"""The multi-token-prediction roll: shift a packed stream left by one slot within each document.

Multi-token prediction trains depth k on the labels k tokens further on, so labels, loss mask
and input ids are shifted left once per depth. In a packed stream the shift must stay inside
each document: slot p of a document takes slot p+1 of the same document, and the document's
last real token (and its padding) takes 0.

Megatron-Core 0.19.2 does this per document in a Python loop
(``_roll_tensor_packed_seq``), exchanging boundary tokens once per document under CP, and
splits the tensor by ``cu_seqlens_q``. That is wrong when documents sit at padded offsets
(``cu_seqlens_q_padded``): the stream is then not laid out on those boundaries. Here:

* :func:`roll_plan` computes, once per micro-batch and on the host, where each local slot's
  value comes from: the next local slot, a chunk head held by some CP rank, or nothing (0).
  It reads the padded boundaries for the layout and the real lengths for the zeros.
* :func:`roll_left` applies a plan with a fixed number of tensor operations whatever the
  number of documents. Under CP it makes one all-gather, over the CP group, of the first slot
  of every chunk each rank holds (two per document). That gives the value across each chunk
  boundary, whichever rank holds the next chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from hpc_mca.data.batch import cp_pieces

__all__ = ["RollPlan", "roll_left", "roll_plan"]


@dataclass(frozen=True)
class RollPlan:
    """Where each of a rank's ``t`` slots takes its left-shifted value from."""

    next_local: Tensor
    """[t] bool: from the next local slot (same chunk, not past the document's real end)."""
    from_head: Tensor
    """[t] bool: from the first slot of the next chunk (the end of a chunk)."""
    head_index: Tensor
    """[t] long: where that head is in the gathered table ``[cp · heads]`` (0 elsewhere)."""
    heads: Tensor
    """[heads] long: local slots of this rank's chunk heads, in table order."""
    cp_size: int

    def to(self, device: torch.device | str) -> RollPlan:
        return RollPlan(self.next_local.to(device), self.from_head.to(device),
                        self.head_index.to(device), self.heads.to(device), self.cp_size)


def roll_plan(cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None = None, cp_size: int = 1,
              cp_rank: int = 0) -> RollPlan:
    """The plan for a packed stream: ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded``
    (document starts in the stream; default ``cu_seqlens``) describe the whole stream; under
    CP this rank holds its chunks in :func:`hpc_mca.data.batch.cp_indices` order.

    Per-slot work is two ``repeat_interleave`` and a comparison; the chunk-boundary logic runs
    on the (2 per document) pieces only.
    """
    cu = cu_seqlens.detach().cpu().long()
    cu_pad = cu if cu_seqlens_padded is None else cu_seqlens_padded.detach().cpu().long()
    docs = cu.numel() - 1
    if cp_size == 1:  # the whole stream, one piece per document
        firsts, piece_len = cu_pad[:-1], cu_pad[1:] - cu_pad[:-1]
    else:
        firsts, piece_len = cp_pieces(cu_pad, cp_size, cp_rank)
    per_doc = firsts.numel() // max(docs, 1)
    doc = torch.arange(docs).repeat_interleave(per_doc)  # each piece's document
    last_real = cu_pad[:-1] + (cu[1:] - cu[:-1]) - 1  # stream slot of each document's last token
    piece_start = piece_len.cumsum(0) - piece_len  # local slot where each piece starts
    slots = int(piece_len.sum())
    # A slot's next slot is a real token of its document iff the slot is before the last one.
    stream_slot = torch.arange(slots) + (firsts - piece_start).repeat_interleave(piece_len)
    valid = stream_slot < last_real[doc].repeat_interleave(piece_len)
    # The last slot of each non-empty piece takes the head of the document's next chunk.
    filled = piece_len > 0
    piece_end = (piece_start + piece_len - 1)[filled]
    end_valid = valid[piece_end]
    from_head = torch.zeros(slots, dtype=torch.bool)
    from_head[piece_end] = end_valid
    next_local = valid & ~from_head
    next_local[piece_end] = False
    head_index = torch.zeros(slots, dtype=torch.long)
    if cp_size > 1:  # (one rank: a piece is a whole document, so no boundary is inside one)
        # The next slot starts chunk k of the document; its owner holds it as its first piece
        # (k < cp: rank k) or its second (k >= cp: rank 2·cp-1-k).
        pieces = filled.nonzero().squeeze(1)[end_valid]
        d = doc[pieces]
        k = (firsts[pieces] + piece_len[pieces] - cu_pad[d]) // piece_len[pieces]
        second = k >= cp_size
        owner = torch.where(second, 2 * cp_size - 1 - k, k)
        head_index[piece_end[end_valid]] = owner * firsts.numel() + d * 2 + second.long()
    # An empty piece (a zero-slot document) is nobody's next slot: any index will do.
    heads = piece_start.clamp(max=max(slots - 1, 0))
    return RollPlan(next_local, from_head, head_index, heads, cp_size)


def roll_left(tensor: Tensor, plan: RollPlan, group: dist.ProcessGroup | None = None
              ) -> tuple[Tensor, Tensor]:
    """``tensor`` ([..., t], this rank's slots) shifted left by one slot within each document,
    0 at each document's last real token and at padding, and the sum of the result (Megatron's
    ``roll_tensor`` contract: the sum normalises a rolled loss mask). Under CP, ``group`` is
    the CP group (one all-gather)."""
    if tensor.size(-1) != plan.next_local.numel():
        raise ValueError(f"the tensor holds {tensor.size(-1)} slots but the roll plan describes "
                         f"{plan.next_local.numel()} (cu_seqlens_padded must cover the stream)")
    plan = plan.to(tensor.device)
    following = torch.cat([tensor[..., 1:], torch.zeros_like(tensor[..., :1])], dim=-1)
    rolled = torch.where(plan.next_local, following, torch.zeros_like(tensor))
    if plan.cp_size > 1:
        mine = tensor[..., plan.heads].contiguous()
        table = [torch.empty_like(mine) for _ in range(plan.cp_size)]
        dist.all_gather(table, mine, group=group)
        heads = torch.cat(table, dim=-1)[..., plan.head_index]
        rolled = torch.where(plan.from_head, heads, rolled)
    return rolled, rolled.sum()
