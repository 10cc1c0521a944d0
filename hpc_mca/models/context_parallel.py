"""Context-parallel packed attention in plain PyTorch: all-gather and all-to-all (Ulysses).

Every CP rank holds, for each document of a packed stream, chunks ``r`` and ``2·cp-1-r`` of
its padded span (:func:`hpc_mca.data.batch.cp_indices`). Two ways to attend over the whole
document from there, named as Megatron's ``cp_comm_type``:

* ``all_gather``: gather every rank's keys and values (their gradients are summed back to the
  owner in backward), put them in stream order, and let the local queries attend with the
  document/causal mask of their *global* slots. Memory: the whole stream's K/V on each rank;
  traffic: (CP−1)/CP of K and V forward, of their gradients backward.
* ``a2a`` (Ulysses): an all-to-all turns sequence-sharded Q/K/V into head-sharded ones, each
  rank attends over the whole stream with heads/CP heads, and a second all-to-all turns the
  output back. Needs the key/value heads (and so the query heads) divisible by CP. The
  exchange is :mod:`hpc_mca.runtime.ulysses`, the one the standard backend's sequence
  parallelism uses; the mirrored-chunk order stays here.

Both reduce to :func:`~hpc_mca.models.packed_attention.packed_attention` on global layouts,
so the mask logic is the one the single-rank path uses (and is tested against). Collectives
run on whatever backend the group has: gloo lacks reduce-scatter, so the all-gather's backward
all-reduces and keeps its own slice there.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from hpc_mca.data.batch import cp_indices
from hpc_mca.runtime.ulysses import heads_to_seq, seq_to_heads
from hpc_mca.topology.memory import TORCH_CP_COMM_TYPES

from .packed_attention import DEFAULT_SEGMENT_TOKENS, packed_attention, packed_layout

# torch 2.13 renamed the tensor-to-tensor collectives (the old names warn); older torch has
# only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GroupCtx(Protocol):
    """The autograd context of :class:`_GatherSequence`: torch's, carrying the group."""

    group: dist.ProcessGroup


class _GatherSequence(torch.autograd.Function):
    """[t, ...] on each rank → [cp·t, ...] in rank order; backward sums each rank's share."""

    @staticmethod
    def forward(ctx: _GroupCtx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.size(0),) + tuple(x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: _GroupCtx, grad: Tensor) -> tuple[Tensor, None]:
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "gloo":  # no reduce-scatter in gloo
            dist.all_reduce(grad, group=group)
            return grad.chunk(size)[rank].clone(), None
        out = grad.new_empty((grad.size(0) // size,) + tuple(grad.shape[1:]))
        _reduce_scatter_single(out, grad, group=group)
        return out, None


def cp_comm_violations(comm_type: str, cp_size: int, num_query_groups: int) -> list[str]:
    """One line per reason ``comm_type`` cannot run at ``cp_size`` for this model."""
    if comm_type not in TORCH_CP_COMM_TYPES:
        return [f"cp_comm_type={comm_type!r} is not valid; valid: "
                f"{', '.join(TORCH_CP_COMM_TYPES)}"]
    if comm_type == "a2a" and num_query_groups % cp_size:
        fits = [c for c in range(1, num_query_groups + 1) if num_query_groups % c == 0]
        return [f"cp_comm_type='a2a' needs context_parallel_size={cp_size} to divide the "
                f"{num_query_groups} key/value heads; valid: context_parallel_size in "
                f"{', '.join(map(str, fits))}, or cp_comm_type='all_gather'"]
    return []


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens: Tensor,
    cu_seqlens_padded: Tensor,
    group: dist.ProcessGroup,
    *,
    comm_type: str = "all_gather",
    scale: float | None = None,
    dropout_p: float = 0.0,
    segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
) -> Tensor:
    """Causal packed attention of this rank's ``[t, heads, dim]`` slots over whole documents.

    ``cu_seqlens``/``cu_seqlens_padded`` describe the whole (unsharded) stream; the tensors
    hold this rank's slots in :func:`cp_indices` order. Returns ``[t, heads, dim]`` in the same
    order, zeros at padding slots.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    cu_pad = cu_seqlens_padded.cpu()
    shards = [cp_indices(cu_pad, size, r) for r in range(size)]
    everyone = torch.cat(shards)
    order = torch.argsort(everyone)  # rank-order positions → stream order
    stream = everyone[order]
    whole = packed_layout(cu_seqlens.cpu(), cu_pad, slots=stream)
    device_order = order.to(query.device)
    if comm_type == "all_gather":
        mine = packed_layout(cu_seqlens.cpu(), cu_pad, slots=shards[rank])
        k = _GatherSequence.apply(key, group)[device_order]
        v = _GatherSequence.apply(value, group)[device_order]
        return packed_attention(query, k, v, mine, whole, causal=True, scale=scale, dropout_p=dropout_p,
                                segment_tokens=segment_tokens)
    if comm_type == "a2a":
        # The exchange puts the ranks' chunks in rank order; reorder them to stream order for
        # the attention and back before returning each rank its own chunks.
        q, k, v = (seq_to_heads(x, group, seq_dim=0, head_dim=1)[device_order]
                   for x in (query, key, value))
        out = packed_attention(q, k, v, whole, whole, causal=True, scale=scale, dropout_p=dropout_p,
                               segment_tokens=segment_tokens)
        back = out[torch.argsort(device_order)]  # stream order → rank order
        return heads_to_seq(back, group, seq_dim=0, head_dim=1)
    raise ValueError(cp_comm_violations(comm_type, size, key.size(1))[0])
