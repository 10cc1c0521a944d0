"""Rank program of tests/test_ulysses.py: the shared Ulysses all-to-all on gloo.

Usage (every rank, under torchrun): python tests/ulysses_worker.py OUT_DIR

Every rank can rebuild every rank's input and loss weight (:func:`block`), so each checks by
itself, with exact equality, that :func:`seq_to_heads` hands it every rank's sequence part of
its own heads in rank order, that :func:`heads_to_seq` undoes it, and that the backward pass
returns each gradient element to the rank and place its input came from. Ranks that pass write
``OUT_DIR/rank<r>.ok``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

# transformers' attention layout [batch, heads, seq, dim]; heads divisible by the 2 and 3 ranks
# the test runs (3: an odd group, so no power-of-two symmetry can hide a misplaced piece).
BATCH, HEADS, SEQ, DIM = 2, 6, 5, 4


def block(rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``[batch, heads, seq, dim]`` input: distinct values everywhere."""
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(BATCH, HEADS, SEQ, DIM, generator=gen, dtype=torch.float64)


def weight(rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s loss weight over its ``[batch, heads/size, size·seq, dim]`` output."""
    gen = torch.Generator().manual_seed(1000 + rank)
    shape = (BATCH, HEADS // size, size * SEQ, DIM)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def main(out_dir: Path) -> None:
    from hpc_mca.runtime.ulysses import heads_to_seq, seq_to_heads

    dist.init_process_group("gloo")
    size, rank = dist.get_world_size(), dist.get_rank()
    group, mine = dist.group.WORLD, slice(rank * HEADS // size, (rank + 1) * HEADS // size)
    x = block(rank).requires_grad_()
    # Negative seq_dim: the exchange must count dimensions the caller's way.
    whole = seq_to_heads(x, group, seq_dim=-2, head_dim=1)
    want = torch.cat([block(r)[:, mine] for r in range(size)], dim=2)
    assert torch.equal(whole, want), "seq_to_heads: wrong pieces or order"
    assert torch.equal(heads_to_seq(whole, group, seq_dim=2, head_dim=1), x), "no round trip"
    (whole * weight(rank, size)).sum().backward()
    # Rank r's output holds rank q's sequence part of r's heads at q·SEQ: that is where the
    # gradient of x's heads owned by r comes from.
    mine_seq = slice(rank * SEQ, (rank + 1) * SEQ)
    want = torch.cat([weight(r, size)[:, :, mine_seq] for r in range(size)], dim=1)
    assert torch.equal(x.grad, want), "backward: wrong gradient placement"
    try:  # HEADS - 1 = 5 heads: no group of 2 or more divides them
        seq_to_heads(x[:, 1:], group, seq_dim=2, head_dim=1)
    except ValueError as error:
        assert f"{HEADS - 1} heads cannot be split over {size}" in str(error), error
    else:
        raise AssertionError(f"{HEADS - 1} heads over {size} ranks were not refused")
    (out_dir / f"rank{rank}.ok").write_text("ok\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
