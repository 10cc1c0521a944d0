"""RoPE on packed streams in one pass (hpc_mca.models.rope) against Megatron's own
per-document loop: the same numbers bit for bit, gradients included, for every context-parallel
rank; fresh positions for every micro-batch; the slots Megatron reads filled either way."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from hpc_mca.models import rope

HEADS, DIM = 3, 16


class _Group:
    """What Megatron's THD RoPE reads of a CP group: its size and this rank."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _freqs(max_len: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _stream(lengths: list[int], cp: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = torch.randn(sum(lengths) // cp, HEADS, DIM, generator=gen).to(dtype)
    return cu, t


def _megatron(t, cu, freqs, cp, rank):
    return rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_Group(cp, rank))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_one_pass_equals_megatrons_per_document_loop(cp, dtype):
    lengths = [8 * cp, 2 * cp, 30 * cp, 2 * cp, 12 * cp]  # padded to multiples of 2*cp
    freqs = _freqs(max(lengths) + 1)
    for rank in range(cp):
        cu, t = _stream(lengths, cp, dtype, seed=rank)
        a, b = t.clone().requires_grad_(), t.clone().requires_grad_()
        ours = rope.packed_rope(a, cu, freqs, cp_size=cp, cp_rank=rank)
        theirs = _megatron(b, cu, freqs, cp, rank)
        assert torch.equal(ours, theirs)
        grad = torch.randn_like(ours)
        ours.backward(grad)
        theirs.backward(grad)
        assert torch.equal(a.grad, b.grad)


def test_positions_restart_per_document_and_follow_the_cp_halves():
    cu = torch.tensor([0, 8, 12])
    assert rope.thd_positions(cu, 12).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    # CP2, rank 1: quarters 1 and 2 of each document (the 8-long one: [2, 3] and [4, 5]).
    assert rope.thd_positions(cu, 6, cp_size=2, cp_rank=1).tolist() == [2, 3, 4, 5, 1, 2]


def test_each_micro_batch_gets_its_own_positions():
    """Two micro-batches of the same length but other documents: the second must not reuse
    the first one's positions (the cache follows the cu_seqlens tensor it was given). The
    table is one longer than the stream, as thd_packed_seq_params sizes it: a table exactly
    as long reads, in Megatron's loop, as absolute positions across documents."""
    freqs = _freqs(65)
    for lengths in ([10, 30, 24], [40, 4, 20], [64]):
        cu, t = _stream(lengths, 1, torch.float32)
        assert torch.equal(rope.packed_rope(t, cu, freqs), _megatron(t, cu, freqs, 1, 0))


def test_boundaries_that_do_not_match_the_stream_are_refused():
    cu, t = _stream([8, 8], 1, torch.float32)
    with pytest.raises(ValueError, match=r"cu_seqlens \[0, 8, 20\] .*describes 20 local tokens; "
                                         r"the tensor holds 16"):
        rope.packed_rope(t, torch.tensor([0, 8, 20]), _freqs(32))


def test_unpacked_batches_rotate_as_megatrons_unfused_path():
    t = torch.randn(24, 2, HEADS, DIM)
    freqs = _freqs(24)
    assert torch.equal(rope.unpacked_rope(t, freqs), rope_utils._apply_rotary_pos_emb_bshd(t, freqs))


def test_configure_puts_the_one_pass_in_megatrons_fused_slots(monkeypatch):
    """With or without TE (whose kernels would sit in the slots), a model gets the one pass;
    model.fusions: [rope] (apply_rope_fusion requested) gets it compiled."""
    def te_kernel(*args, **kwargs):  # what TE puts there when it is installed
        raise AssertionError("not called")

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", te_kernel)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    monkeypatch.setattr(rope, "_rotate", rope._rotate_eager)
    assert rope.configure({"bf16": True}) == {"bf16": True, "apply_rope_fusion": True}
    assert rope_utils.fused_apply_rotary_pos_emb_thd is rope.packed_rope
    assert rope_utils.fused_apply_rotary_pos_emb is rope.unpacked_rope
    assert rope._rotate is rope._rotate_eager
    monkeypatch.setattr(rope, "_COMPILED", lambda *args: "compiled")  # not built here: slow
    assert rope.configure({"apply_rope_fusion": True}) == {"apply_rope_fusion": True}
    assert rope._rotate is rope._COMPILED


@pytest.mark.slow
def test_compiled_rotation_equals_the_eager_one():
    """model.fusions: [rope] compiles the rotation (inductor's C++ on CPU): fp32 equal to
    rounding, gradients too, over streams of different lengths (dynamic shapes)."""
    freqs = _freqs(80)
    compiled = rope._compiled_rotate()
    for lengths in ([10, 30, 24], [80, 6]):
        cu, t = _stream(lengths, 1, torch.float32)
        positions = rope.thd_positions(cu, t.size(0))
        a, b = t.clone().requires_grad_(), t.clone().requires_grad_()
        fast = compiled(a.unsqueeze(1), freqs[positions], False)
        slow = rope._rotate_eager(b.unsqueeze(1), freqs[positions], False)
        torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)
        fast.sum().backward()
        slow.sum().backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)
