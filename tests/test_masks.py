"""Contracts of hpc_mca.data.masks: causal masks, position ids, packed sequence lengths."""

import pytest
import torch

from hpc_mca.data.masks import (
    check_pack_seq_aligned,
    get_ltor_masks_and_position_ids,
    get_seqlens_in_batch,
)


def _reference_mask(valid_lengths: list[int], seq: int) -> torch.Tensor:
    """Masked (True) unless key <= query and both lie inside the row's valid length."""
    mask = torch.ones(len(valid_lengths), 1, seq, seq, dtype=torch.bool)
    for row, length in enumerate(valid_lengths):
        for q in range(length):
            for k in range(q + 1):
                mask[row, 0, q, k] = False
    return mask


def test_causal_mask_and_positions_for_full_rows():
    input_ids = torch.randint(0, 100, (3, 5))
    mask, position_ids = get_ltor_masks_and_position_ids(input_ids)
    assert mask.dtype == torch.bool and mask.shape == (3, 1, 5, 5)
    assert torch.equal(mask, _reference_mask([5, 5, 5], 5))
    assert position_ids.shape == (3, 5) and position_ids.dtype == torch.long
    assert torch.equal(position_ids, torch.arange(5).repeat(3, 1))


def test_padding_beyond_valid_length_is_masked_both_ways():
    input_ids = torch.zeros(2, 6, dtype=torch.long)
    valid = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    mask, _ = get_ltor_masks_and_position_ids(input_ids, attn_mask_1D=valid)
    assert torch.equal(mask, _reference_mask([4, 6], 6))
    assert mask[0, 0, 4:].all() and mask[0, 0, :, 4:].all()


def test_mask_can_be_skipped():
    mask, position_ids = get_ltor_masks_and_position_ids(
        torch.zeros(2, 4, dtype=torch.long), build_attention_mask=False
    )
    assert mask is None and position_ids.shape == (2, 4)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="input_ids"):
        get_ltor_masks_and_position_ids(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="attn_mask_1D"):
        get_ltor_masks_and_position_ids(torch.zeros(2, 4), attn_mask_1D=torch.ones(2, 3))


def test_seqlens_example_from_the_description():
    packed = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])
    cu_seqlens, max_seqlen = get_seqlens_in_batch(packed)
    assert cu_seqlens.dtype == torch.int32 and max_seqlen.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 2, 5, 6, 8, 11]
    assert int(max_seqlen) == 3


def test_seqlens_single_sequence_and_padding_only():
    cu_seqlens, max_seqlen = get_seqlens_in_batch(torch.tensor([[1, 1, 1, 1, 0, 0]]))
    assert cu_seqlens.tolist() == [0, 4] and int(max_seqlen) == 4
    cu_seqlens, max_seqlen = get_seqlens_in_batch(torch.zeros(2, 3, dtype=torch.long))
    assert cu_seqlens.tolist() == [0] and int(max_seqlen) == 0


def test_seqlens_several_rows_match_a_loop():
    generator = torch.Generator().manual_seed(0)
    rows, expected = [], []
    for _ in range(4):
        lengths = torch.randint(1, 7, (3,), generator=generator).tolist()
        row = [label for label, n in enumerate(lengths, start=1) for _ in range(n)]
        rows.append(row + [0] * (20 - len(row)))
        expected += lengths
    cu_seqlens, max_seqlen = get_seqlens_in_batch(torch.tensor(rows))
    assert cu_seqlens.tolist() == [0] + torch.tensor(expected).cumsum(0).tolist()
    assert int(max_seqlen) == max(expected)


def test_seqlens_rejects_non_label_masks():
    with pytest.raises(ValueError, match="integer"):
        get_seqlens_in_batch(torch.ones(1, 3))
    with pytest.raises(ValueError, match=">= 0"):
        get_seqlens_in_batch(torch.tensor([[1, -1]]))


def test_pack_alignment():
    aligned = torch.tensor([[1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 2, 2, 0]])
    assert check_pack_seq_aligned(aligned, 2) is True
    assert check_pack_seq_aligned(aligned, 4) is False
    misaligned = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])
    assert check_pack_seq_aligned(misaligned, 2) is False
    assert check_pack_seq_aligned(misaligned, 1) is True


@pytest.mark.parametrize("align_size", [0, -2, 1.5, True])
def test_pack_alignment_rejects_bad_align_size(align_size):
    with pytest.raises(ValueError, match="align_size"):
        check_pack_seq_aligned(torch.tensor([[1, 1]]), align_size)
