"""Ulysses sequence parallelism for plain transformers models: groups, input slicing, and the
collectives around attention and outputs.

A sequence-parallel (SP) group of ``sp`` ranks shares one packed row ``[1, seq]``: each rank
holds a contiguous ``seq_pad / sp`` slice of it (``seq_pad`` is ``seq`` padded up to a multiple of
``sp``) and runs every layer on its slice. Only attention needs the whole sequence; there an
all-to-all turns "my slice of the sequence, all heads" into "the whole sequence, my share of
the heads" (:func:`~hpc_mca.runtime.ulysses.seq_to_heads`, which context parallelism's
``a2a`` shares), attention runs per head, and the inverse all-to-all
(:func:`~hpc_mca.runtime.ulysses.heads_to_seq`) returns to slices. Outputs that a loss needs
whole are gathered with :func:`gather_and_unpad`, whose backward hands each rank the gradient
of its own slice.

The padding added by :func:`slice_and_pad` is a document of its own (positions 0, 1, ...) with
label -100: attention keeps it apart from the real documents, and the loss never sees it.

Groups are consecutive ranks (``[0, sp)``, ``[sp, 2·sp)``, ...), so that the SP ranks of a
replica share a node when ``sp`` divides the ranks per node; data parallelism runs across groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "IGNORE_INDEX",
    "SPSlice",
    "gather_and_unpad",
    "gather_positions",
    "get_sequence_parallel_group",
    "new_sequence_parallel_groups",
    "sequence_parallel_rank",
    "sequence_parallel_size",
    "set_sequence_parallel_group",
    "slice_and_pad",
]

IGNORE_INDEX = -100
"""Label of padding slots (transformers' and torch's cross-entropy ignore index)."""

_GROUP: Optional[dist.ProcessGroup] = None


# --------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------


def new_sequence_parallel_groups(sp: int) -> Optional[dist.ProcessGroup]:
    """Create the SP groups of ``sp`` consecutive ranks (every rank must call this) and return
    this rank's; None when ``sp == 1``. Also makes it the current group."""
    world = dist.get_world_size()
    if sp < 1 or world % sp:
        raise ValueError(f"sequence_parallel_size={sp} does not divide world_size={world}")
    mine = None
    if sp > 1:
        for start in range(0, world, sp):
            group = dist.new_group(list(range(start, start + sp)))
            if start <= dist.get_rank() < start + sp:
                mine = group
    set_sequence_parallel_group(mine)
    return mine


def set_sequence_parallel_group(group: Optional[dist.ProcessGroup]) -> None:
    """The group the attention wrapper and :func:`slice_and_pad` use (None: no SP)."""
    global _GROUP
    _GROUP = group


def get_sequence_parallel_group() -> Optional[dist.ProcessGroup]:
    return _GROUP


def sequence_parallel_size(group: Optional[dist.ProcessGroup] = None) -> int:
    group = group if group is not None else _GROUP
    return 1 if group is None else dist.get_world_size(group)


def sequence_parallel_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    group = group if group is not None else _GROUP
    return 0 if group is None else dist.get_rank(group)


# --------------------------------------------------------------------------------------------
# Input slicing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SPSlice:
    """This rank's slice of a packed row, and how to undo the padding."""

    input_ids: Tensor
    """``[1, seq_pad / sp]``: this rank's tokens."""
    position_ids: Tensor
    """``[1, seq_pad / sp]``: their positions within their documents."""
    labels: Optional[Tensor]
    """``[1, seq_pad / sp]`` (or None): their labels, -100 on padding."""
    pad: int
    """Slots appended to the row to make it divisible by ``sp``."""


def slice_and_pad(input_ids: Tensor, position_ids: Tensor, labels: Optional[Tensor] = None, *,
                  rank: Optional[int] = None, size: Optional[int] = None,
                  pad_token_id: int = 0) -> SPSlice:
    """Pad a ``[1, seq]`` packed row to a multiple of the SP size and keep this rank's slice.

    Padding tokens are ``pad_token_id`` at positions ``0..pad-1`` (a document of their own) with
    label -100. ``rank``/``size`` default to the current SP group.
    """
    size = sequence_parallel_size() if size is None else size
    rank = sequence_parallel_rank() if rank is None else rank
    if input_ids.dim() != 2 or input_ids.size(0) != 1:
        raise ValueError(f"slice_and_pad takes one packed row [1, seq], got {tuple(input_ids.shape)}")
    if position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} do not match input_ids "
                         f"{tuple(input_ids.shape)}")
    pad = -input_ids.size(1) % size

    def padded(tensor: Tensor, fill: Tensor) -> Tensor:
        return torch.cat([tensor, fill.to(tensor)[None]], dim=1) if pad else tensor

    device = input_ids.device
    ids = padded(input_ids, torch.full((pad,), pad_token_id, device=device))
    pos = padded(position_ids, torch.arange(pad, device=device))
    lab = None if labels is None else padded(labels, torch.full((pad,), IGNORE_INDEX,
                                                                device=device))
    width = ids.size(1) // size
    part = slice(rank * width, (rank + 1) * width)
    return SPSlice(ids[:, part], pos[:, part], None if lab is None else lab[:, part], pad)


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


class _GatherSplitCtx(Protocol):
    """What :class:`_GatherSplit`'s forward keeps on autograd's context for its backward."""

    group: dist.ProcessGroup
    dim: int


class _GatherSplit(torch.autograd.Function):
    """All-gather along ``dim`` forward; backward keeps this rank's slice of the gradient (every
    rank computes the same thing from the gathered tensor, so each owns its slice's part)."""

    @staticmethod
    def forward(ctx: _GatherSplitCtx, x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: _GatherSplitCtx, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def gather_and_unpad(x: Tensor, group: Optional[dist.ProcessGroup] = None, *, dim: int = 1,
                     pad: int = 0) -> Tensor:
    """The whole sequence from every rank's slice along ``dim``, without the last ``pad`` slots
    that :func:`slice_and_pad` added; the backward pass returns each rank its slice's gradient."""
    group = group if group is not None else _GROUP
    if group is not None and dist.get_world_size(group) > 1:
        x = _GatherSplit.apply(x, group, dim)
    return x.narrow(dim, 0, x.size(dim) - pad) if pad else x


def gather_positions(position_ids: Tensor, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """The whole row's position ids (integers: no gradient), gathered along the sequence."""
    group = group if group is not None else _GROUP
    if group is None or dist.get_world_size(group) == 1:
        return position_ids
    parts = [torch.empty_like(position_ids) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, position_ids.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
