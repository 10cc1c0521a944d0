"""Rank program of tests/test_context_parallel.py: context-parallel packed attention on gloo.

Usage (every rank, under torchrun): python tests/cp_attention_worker.py COMM_TYPE OUT_DIR

Every rank builds the same random packed stream (:func:`cp_case`), keeps its CP slots, runs
:func:`context_parallel_attention` forward and backward with the loss ``sum(out * weight)``,
and saves its output and Q/K/V gradients to ``OUT_DIR/rank<r>.pt`` for the test to compare
with the single-process attention over the whole stream.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

# Query heads, key/value heads, head width; document lengths (some shorter than 2·CP) before
# padding each to a multiple of 2·CP.
HEADS, KV_HEADS, DIM = 8, 4, 16
LENGTHS = [37, 3, 64, 1, 21, 50, 6, 2, 90]


def cp_case(cp: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The stream: cu_seqlens (real), cu_seqlens_padded (multiples of 2·cp), random Q/K/V and
    the loss weight over every slot."""
    align = 2 * cp
    padded = [-(-n // align) * align for n in LENGTHS]
    gen = torch.Generator().manual_seed(seed)
    total = sum(padded)
    return {
        "cu_seqlens": torch.tensor([0, *LENGTHS]).cumsum(0),
        "cu_seqlens_padded": torch.tensor([0, *padded]).cumsum(0),
        "query": torch.randn(total, HEADS, DIM, generator=gen, dtype=torch.float64),
        "key": torch.randn(total, KV_HEADS, DIM, generator=gen, dtype=torch.float64),
        "value": torch.randn(total, KV_HEADS, DIM, generator=gen, dtype=torch.float64),
        "weight": torch.randn(total, HEADS, DIM, generator=gen, dtype=torch.float64),
    }


def main(comm_type: str, out_dir: Path) -> None:
    from hpc_mca.data.batch import cp_indices
    from hpc_mca.models.context_parallel import context_parallel_attention

    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    case = cp_case(cp)
    slots = cp_indices(case["cu_seqlens_padded"], cp, rank)
    q, k, v = (case[name][slots].clone().requires_grad_() for name in ("query", "key", "value"))
    out = context_parallel_attention(q, k, v, case["cu_seqlens"], case["cu_seqlens_padded"],
                                     dist.group.WORLD, comm_type=comm_type, segment_tokens=64)
    (out * case["weight"][slots]).sum().backward()
    torch.save({"slots": slots, "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad},
               out_dir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
