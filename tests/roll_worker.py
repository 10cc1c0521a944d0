"""Rank program of tests/test_roll.py: the MTP roll of a packed stream on CP gloo ranks.

Usage (every rank, under torchrun): python tests/roll_worker.py OUT_DIR

Every rank builds the same random streams (:func:`roll_cases`), keeps its CP slots, rolls
them with :func:`hpc_mca.models.roll.roll_left` (and, for the unpadded cases, with
Megatron-Core's ``_roll_tensor_packed_seq``), and saves the results with its slots to
``OUT_DIR/rank<r>.pt`` for the test to compare with the per-document loop over the stream.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def roll_cases(cp: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Random packed streams: documents of 1..40 tokens (one-token ones included), each padded
    to a multiple of 2·cp (``padded``) or of exactly that length (``unpadded``, real lengths
    multiples of 2·cp, where upstream's roll is correct). Values are token-like ints with
    whole documents of -100 (no labels) among them; a leading batch dimension of 2 rows."""
    gen = torch.Generator().manual_seed(seed)
    align, cases = 2 * cp, []
    for padded in (True, False):
        for _ in range(3):
            docs = int(torch.randint(20, 60, (), generator=gen))
            if padded:
                lengths = torch.randint(1, 41, (docs,), generator=gen)
                lengths[:3] = 1  # one-token documents
            else:
                lengths = torch.randint(1, 8, (docs,), generator=gen) * align
            spans = -(-lengths // align) * align
            values = torch.randint(0, 1000, (2, int(spans.sum())), generator=gen)
            starts = torch.cat([torch.zeros(1, dtype=torch.long), spans.cumsum(0)[:-1]])
            for d in torch.randperm(docs, generator=gen)[:3].tolist():  # no-label documents
                values[:, starts[d]:starts[d] + lengths[d]] = -100
            cases.append({"cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.long),
                                                   lengths.cumsum(0)]),
                          "cu_seqlens_padded": torch.cat([torch.zeros(1, dtype=torch.long),
                                                          spans.cumsum(0)]),
                          "values": values, "padded": torch.tensor(padded)})
    return cases


def main(out_dir: Path) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.multi_token_prediction import _roll_tensor_packed_seq

    from hpc_mca.data.batch import cp_indices
    from hpc_mca.models.roll import roll_left, roll_plan

    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for case in roll_cases(cp):
        slots = cp_indices(case["cu_seqlens_padded"], cp, rank)
        local = case["values"][:, slots]
        plan = roll_plan(case["cu_seqlens"], case["cu_seqlens_padded"], cp, rank)
        ours, total = roll_left(local, plan, dist.group.WORLD)
        result = {"slots": slots, "ours": ours, "sum": total}
        if not case["padded"]:
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=case["cu_seqlens"])
            group = dist.group.WORLD if cp > 1 else None
            result["upstream"] = _roll_tensor_packed_seq(local, -1, -1, params, group)[0]
        results.append(result)
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
