"""The Ulysses all-to-all: re-shard a tensor from one dimension to another across a group.

Ulysses attention turns "my part of the sequence, all heads" into "the whole sequence, my share
of the heads" with one all-to-all (:func:`seq_to_heads`), attends per head, and turns the output
back with the opposite all-to-all (:func:`heads_to_seq`). Both backends do this:

* the standard backend's sequence parallelism (:mod:`hpc_mca.runtime.sequence_parallel`, through
  :mod:`hpc_mca.models.hf_attention`), on contiguous slices of a padded row;
* the Megatron backend's context parallelism with ``cp_comm_type="a2a"``
  (:mod:`hpc_mca.models.context_parallel`), on CP's mirrored chunks of each document.

Each caller keeps its own layout (which slots a rank holds, padding, reordering); this module
only moves data, so its results are bit for bit the inputs rearranged, and its backward is the
same exchange the other way.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["heads_to_seq", "seq_to_heads"]


def _exchange(x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """Split ``x`` along ``scatter_dim`` into one piece per rank, send piece j to rank j, and
    concatenate what arrives along ``gather_dim`` in rank order."""
    size = dist.get_world_size(group)
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if x.size(scatter_dim) % size:
        raise ValueError(f"all-to-all over {size} ranks cannot split dimension {scatter_dim} "
                         f"of {tuple(x.shape)} evenly")
    # The pieces stacked on a new leading dimension make one contiguous buffer, so a single
    # all_to_all_single (which gloo and NCCL both run) moves them all; a per-piece list would
    # cost a copy per piece and the list collective's bookkeeping.
    send = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] is rank j's piece: put the rank dimension just before gather_dim and merge the two,
    # which concatenates the pieces in rank order (a view when gather_dim is 0).
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAllCtx(Protocol):
    """What :class:`_AllToAll`'s forward keeps on autograd's context for its backward."""

    group: dist.ProcessGroup
    dims: tuple[int, int]


class _AllToAll(torch.autograd.Function):
    """:func:`_exchange` forward; backward the opposite exchange, which returns every gradient
    element to the rank and place its input came from."""

    @staticmethod
    def forward(ctx: _AllToAllCtx, x: Tensor, group: dist.ProcessGroup, scatter_dim: int,
                gather_dim: int) -> Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: _AllToAllCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def seq_to_heads(x: Tensor, group: dist.ProcessGroup, *, seq_dim: int, head_dim: int) -> Tensor:
    """This rank's part of the sequence, all heads -> the whole sequence (parts in rank order),
    this rank's ``heads / size`` heads."""
    heads, size = x.size(head_dim), dist.get_world_size(group)
    if heads % size:
        # Said in the group's terms before the exchange, rather than as a shape error inside it.
        raise ValueError(f"{heads} heads cannot be split over {size} sequence-parallel ranks")
    return _AllToAll.apply(x, group, head_dim, seq_dim)


def heads_to_seq(x: Tensor, group: dist.ProcessGroup, *, seq_dim: int, head_dim: int) -> Tensor:
    """The whole sequence, this rank's heads -> this rank's part of the sequence, all heads
    (the inverse of :func:`seq_to_heads`)."""
    return _AllToAll.apply(x, group, seq_dim, head_dim)
