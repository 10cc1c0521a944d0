"""``hpc_mca_packed``: a transformers attention implementation for packed rows, with Ulysses
sequence parallelism when an SP group is set.

The standard backend trains plain transformers models on packed rows ``[1, seq]`` whose
documents are told apart by their ``position_ids`` restarting (transformers' own rule: a new
document wherever a position is not the previous one plus one). This implementation confines
attention to each document with the torch backend's packed kernel
(:func:`hpc_mca.models.packed_attention.packed_attention`), so the two backends compute the
same thing. Under sequence parallelism (:mod:`hpc_mca.runtime.sequence_parallel`) each rank
holds a slice of the row: the layer's query/key/value go through an all-to-all to the whole
sequence on ``heads / sp`` heads, the position ids are gathered to find the documents, and the
output goes back to slices. SP must divide the attention heads and the key/value heads.

Use: ``register()`` once, then build the model with ``attn_implementation="hpc_mca_packed"``.
transformers builds no attention mask for an implementation it does not know, which is what
this one wants; a padding mask given anyway is refused (pack instead).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from hpc_mca.models.packed_attention import Segment, TokenLayout, packed_attention, packed_layout, plan_segments
from hpc_mca.runtime.sequence_parallel import gather_positions, get_sequence_parallel_group
from hpc_mca.runtime.ulysses import heads_to_seq, seq_to_heads

__all__ = ["NAME", "document_bounds", "packed_attention_forward", "register"]

NAME = "hpc_mca_packed"
SEGMENT_TOKENS = 128
"""Query tokens per SDPA call (see hpc_mca.models.packed_attention.DEFAULT_SEGMENT_TOKENS)."""


def register() -> str:
    """Make ``attn_implementation="hpc_mca_packed"`` known to transformers; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_attention_forward)
    return NAME


def document_bounds(positions: Tensor) -> Tensor:
    """``cu_seqlens`` (int64, leading 0) of a row whose documents restart their positions."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = positions[1:] != positions[:-1] + 1
    index = torch.nonzero(starts).flatten()
    return torch.cat([index, index.new_tensor([positions.numel()])])


class _PlanCache:
    """The last row's layout and segment plan: every layer of a forward pass sees the same
    position ids, so they are planned once per micro-batch, not once per layer."""

    def __init__(self) -> None:
        self.positions: Optional[Tensor] = None
        self.plan: Optional[tuple[TokenLayout, list[Segment]]] = None

    def get(self, positions: Tensor) -> tuple[TokenLayout, list[Segment]]:
        positions = positions.detach().cpu()
        if self.plan is None or self.positions is None or not torch.equal(self.positions, positions):
            layout = packed_layout(document_bounds(positions))
            self.positions = positions
            self.plan = (layout, plan_segments(layout, layout, SEGMENT_TOKENS))
        return self.plan


_CACHE = _PlanCache()


def packed_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Optional[Tensor], dropout: float = 0.0,
                             scaling: Optional[float] = None, *, position_ids: Optional[Tensor] = None,
                             **kwargs: object) -> tuple[Tensor, None]:
    """transformers' attention-function contract: ``[b, heads, s, d]`` in, ``[b, s, heads, d]``
    out, causal within each document of ``position_ids``. ``kwargs``: the model's other
    attention settings, none of which apply here."""
    del module, kwargs
    if attention_mask is not None:
        raise ValueError(f"attn_implementation={NAME!r} takes packed rows told apart by "
                         "position_ids, not an attention mask; pack the batch instead")
    positions = position_ids
    if positions is None:
        raise ValueError(f"attn_implementation={NAME!r} needs position_ids")
    group = get_sequence_parallel_group()
    if group is not None:
        positions = gather_positions(positions, group)
        query, key, value = (seq_to_heads(x, group, seq_dim=2, head_dim=1)
                             for x in (query, key, value))
    rows = []
    for row in range(query.size(0)):
        layout, segments = _CACHE.get(positions[row])
        q, k, v = (x[row].transpose(0, 1) for x in (query, key, value))  # [s, heads, d]
        rows.append(packed_attention(q, k, v, layout, layout, causal=True, scale=scaling,
                                     dropout_p=dropout, segments=segments))
    out = torch.stack(rows)  # [b, s, heads, d]
    if group is not None:
        out = heads_to_seq(out, group, seq_dim=1, head_dim=2)
    return out, None
