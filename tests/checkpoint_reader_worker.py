"""Saves a torch_dist checkpoint with Megatron's dist_checkpointing and loads it back through
the direct reader and through PyTorch's own one, for every case of test_checkpoint_reader.py.

Usage: python tests/checkpoint_reader_worker.py WORKDIR   (writes WORKDIR/loaded.pt: case ->
{"direct": ..., "torch": ...}). A process of its own: the CPU compat layer is process-global.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hpc_mca.checkpoint.reader import direct_reads
from hpc_mca.runtime import cpu_compat


def saved_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(8, 6, generator=g),
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "int64": torch.randint(0, 1 << 40, (9,), generator=g),
        "transposed": torch.randn(6, 4, generator=g).t(),
        "cube": torch.randn(4, 3, 2, generator=g),
    }


def templates() -> dict[str, Any]:
    """case -> a function building a fresh template (destinations filled with -1 / zeros)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    def whole() -> dict:
        state = {key: ShardedTensor.from_rank_offsets(key, torch.full_like(t, -1))
                 for key, t in saved_tensors().items()}
        state["extra"] = ShardedObject("extra", None, (1,), (0,))
        return state

    def part(axis: int, index: int) -> Callable[[], dict]:
        shape = [8, 6]
        shape[axis] //= 2
        return lambda: {"fp32": ShardedTensor.from_rank_offsets(
            "fp32", torch.full(shape, -1.0), (axis, index, 2))}

    def other_destinations() -> dict:
        return {"fp32": ShardedTensor.from_rank_offsets("fp32", torch.zeros(6, 8).t()),
                "bf16": ShardedTensor.from_rank_offsets("bf16", torch.zeros(5, 7))}

    cases = {"whole": whole, "other_destinations": other_destinations}
    cases.update({f"part_axis{axis}_{index}": part(axis, index)
                  for axis in (0, 1) for index in (0, 1)})
    return cases


def main(workdir: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    cpu_compat.activate()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ckpt = workdir / "ckpt"
    ckpt.mkdir()
    state = {key: ShardedTensor.from_rank_offsets(key, t) for key, t in saved_tensors().items()}
    state["extra"] = ShardedObject("extra", {"step": 7, "rng": torch.arange(3)}, (1,), (0,))
    dist_checkpointing.save(state, str(ckpt))
    results = {}
    for case, template in templates().items():
        # One rank holding half a tensor is not a complete sharding: skip that validation.
        load = functools.partial(dist_checkpointing.load, checkpoint_dir=str(ckpt),
                                 validate_access_integrity=False)
        with direct_reads():
            direct = load(template())
        results[case] = {"direct": direct, "torch": load(template())}
    torch.save(results, workdir / "loaded.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
