"""Causal masks, position ids and packed-sequence lengths for left-to-right training.

Conventions used throughout:

* A *dense* attention mask is boolean with ``True`` meaning "masked out" (Megatron's
  convention), shaped ``[batch, 1, seq, seq]`` so it broadcasts over heads.
* A *packed label* mask is an integer ``[batch, seq]`` tensor in which every token carries the
  number of the document it belongs to within its row (1, 2, 3, ...) and padding carries 0.
  Documents are contiguous and numbered in order of appearance; the cumulative lengths derived
  from it follow flash-attention's ``cu_seqlens`` format (leading zero, int32), rows
  concatenated in order.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_pack_seq_aligned",
    "document_lengths",
    "get_ltor_masks_and_position_ids",
    "get_seqlens_in_batch",
]


def _require_2d(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be 2-D [batch, seq], got shape {tuple(tensor.shape)}")


def get_ltor_masks_and_position_ids(
    input_ids: torch.Tensor,
    build_attention_mask: bool = True,
    attn_mask_1D: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Causal attention mask and position ids for a ``[batch, seq]`` batch of token ids.

    Returns ``(attention_mask, position_ids)``. ``position_ids`` is ``0..seq-1`` for every row
    (int64, ``[batch, seq]``, contiguous). ``attention_mask`` is ``None`` when
    ``build_attention_mask`` is false, otherwise a bool ``[batch, 1, seq, seq]`` tensor where
    ``True`` marks a query/key pair that must not attend: every key after the query, and, when
    ``attn_mask_1D`` (``[batch, seq]``, nonzero = real token) is given, every pair whose query or
    key is a padding position. With right padding that masks everything beyond each row's valid
    length.
    """
    _require_2d("input_ids", input_ids)
    batch, seq = input_ids.shape
    device = input_ids.device
    position_ids = torch.arange(seq, dtype=torch.long, device=device).repeat(batch, 1)
    if not build_attention_mask:
        return None, position_ids

    allowed = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    allowed = allowed.expand(batch, 1, seq, seq)
    if attn_mask_1D is not None:
        if tuple(attn_mask_1D.shape) != (batch, seq):
            raise ValueError(
                f"attn_mask_1D must have the shape of input_ids {(batch, seq)}, "
                f"got {tuple(attn_mask_1D.shape)}"
            )
        valid = attn_mask_1D.to(device=device) != 0
        allowed = allowed & valid[:, None, :, None] & valid[:, None, None, :]
    return ~allowed, position_ids


def document_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """Lengths of the documents in a packed label mask, rows in order, padding excluded (int64)."""
    _require_2d("attention_mask", attention_mask)
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(
            f"attention_mask must hold integer document labels, got dtype {attention_mask.dtype}"
        )
    labels = attention_mask.long()
    if labels.numel() and int(labels.min()) < 0:
        raise ValueError("attention_mask labels must be >= 0 (0 = padding)")
    num_labels = int(labels.max()) + 1 if labels.numel() else 1
    counts = torch.zeros(labels.size(0), num_labels, dtype=torch.long, device=labels.device)
    counts.scatter_add_(1, labels, torch.ones_like(labels))
    counts = counts[:, 1:].reshape(-1)  # drop padding, keep row-major document order
    return counts[counts > 0]


def get_seqlens_in_batch(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, max_seqlen)`` of a packed label mask, both int32.

    ``cu_seqlens`` has a leading zero and one entry per document, rows concatenated in order:
    ``[[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]`` holds documents of lengths 2, 3, 1, 2, 3 and
    gives ``[0, 2, 5, 6, 8, 11]`` with ``max_seqlen`` 3 (a 0-d tensor; 0 for an empty batch).
    """
    lengths = document_lengths(attention_mask)
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    max_seqlen = lengths.max() if lengths.numel() else lengths.new_zeros(())
    return cu_seqlens, max_seqlen.to(torch.int32)


def check_pack_seq_aligned(attention_mask: torch.Tensor, align_size: int) -> bool:
    """Whether every document in a packed label mask has a length divisible by ``align_size``.

    Context parallelism splits each document into ``2 * cp_size`` equal chunks, so packs fed to
    it must be aligned to that size (padding tokens, label 0, are not a document).
    """
    if isinstance(align_size, bool) or not isinstance(align_size, int) or align_size < 1:
        raise ValueError(f"align_size must be a positive integer, got {align_size!r}")
    lengths = document_lengths(attention_mask)
    return bool((lengths % align_size == 0).all())
