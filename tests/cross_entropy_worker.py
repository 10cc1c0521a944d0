"""Rank program of tests/test_cross_entropy.py: the vocabulary-parallel cross-entropy on TP
ranks over gloo.

Usage (every rank, under torchrun): python tests/cross_entropy_worker.py OUT_DIR

Every rank builds the same logits and targets (:func:`case`), keeps its slice of the
vocabulary, runs hpc_mca.models.cross_entropy forward and backward of a weighted loss sum, and
saves the per-token loss and its slice's gradient to ``OUT_DIR/rank<r>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB = 96  # split in equal slices, as Megatron pads the vocabulary to


def case(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits ``[seq 7, batch 3, VOCAB]``, targets (one outside the vocabulary, as a masked
    label is) and per-token weights of the loss sum."""
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(7, 3, VOCAB, generator=gen)).to(dtype)
    target = torch.randint(0, VOCAB, (7, 3), generator=gen)
    target[2, 1] = -100
    weights = torch.rand(7, 3, generator=gen)
    return logits, target, weights


def main() -> None:
    from hpc_mca.models.cross_entropy import vocab_parallel_cross_entropy

    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    logits, target, weights = case()
    width = VOCAB // size
    mine = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(mine, target, dist.group.WORLD)
    (loss * weights).sum().backward()
    torch.save({"loss": loss.detach(), "grad": mine.grad}, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
