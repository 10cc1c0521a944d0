"""Where a GPU run's first checkpoint save goes: staging the state in host memory.

Megatron's checkpoint writer (``FileSystemWriterAsync.preload_tensors``, synchronous saves
too) copies every tensor to the host with ``tensor.to("cpu", non_blocking=True)``, which takes
pinned memory from torch's caching host allocator. The first save of a process has to create
those pinned blocks (``cudaHostAlloc``, sizes rounded up to powers of two); later saves reuse
the cached ones. This times that staging alone for a state shaped like the Llama-3.2-1B
trainer's (bf16 weights plus fp32 master weights and two Adam moments per weight, ~17 GB),
three saves in a row per process, one process per way of staging:

* ``cudaHostAlloc``: torch's default;
* ``cudaHostRegister x8``: ``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,
  pinned_num_register_threads:8``: torch mallocs the block, touches its pages with 8 threads
  and registers it;
* ``pageable``: ``non_blocking=False`` copies into plain (unpinned) host memory.

Each line gives the seconds of each save, the GB/s of the last, and the seconds torch spent
creating pinned blocks (``torch.cuda.host_memory_stats``, where this torch has it).

    python benchmarks/pinned_staging.py            # one GPU; ~17 GB of host memory per way
    python benchmarks/pinned_staging.py --gib 2    # a smaller state
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hpc_mca from this checkout

WAYS = {"cudaHostAlloc": {}, "pageable": {},
        "cudaHostRegister x8": {"PYTORCH_CUDA_ALLOC_CONF":
                                "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"}}
LLAMA_1B = dict(hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8, vocab=128256)


def shapes(gib: float | None) -> list[tuple[int, ...]]:
    """The 1B model's weight shapes (Megatron's fused qkv and fc1), scaled down for ``--gib``."""
    h, f = LLAMA_1B["hidden"], LLAMA_1B["ffn"]
    kv = LLAMA_1B["kv_heads"] * h // LLAMA_1B["heads"]
    per_layer = [(h + 2 * kv, h), (h, h), (2 * f, h), (h, f), (h,), (h,)]
    # --gib: fewer layers, same shapes (the embedding is ~1.9 GB of the 17 on its own)
    layers = max(1, int(LLAMA_1B["layers"] * gib / 17)) if gib else LLAMA_1B["layers"]
    return [(LLAMA_1B["vocab"], h), (h,)] + per_layer * layers


def stage_in_this_process(way: str, gib: float | None, saves: int) -> dict:
    import torch

    from hpc_mca.runtime.host_memory import pinned_host_seconds

    state = []
    for shape in shapes(gib):
        state.append(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
        state += [torch.randn(shape, device="cuda", dtype=torch.float32) for _ in range(3)]
    total = sum(t.numel() * t.element_size() for t in state)
    non_blocking = way != "pageable"
    seconds, alloc_seconds = [], []
    for _ in range(saves):
        before = pinned_host_seconds()  # None on a torch without the allocation timer
        torch.cuda.synchronize()
        start = time.perf_counter()
        staged = [t.to("cpu", non_blocking=non_blocking) for t in state]
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        after = pinned_host_seconds()
        alloc_seconds.append(None if before is None or after is None else after - before)
        del staged  # back to the host allocator's cache, as after a save's write
    return {"bytes": total, "seconds": seconds, "alloc_seconds": alloc_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=None, help="a smaller state (about this many GiB)")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--way", help=argparse.SUPPRESS)  # the child process's side
    args = parser.parse_args()
    if args.way:
        print(json.dumps(stage_in_this_process(args.way, args.gib, args.saves)))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("pinned_staging.py: needs a CUDA device (it times GPU-to-host copies)")
    print(f"{'staging':22}{'GB':>6}  seconds per save (first, later...)  GB/s last  "
          f"pinned-block creation s", flush=True)
    for way, env in WAYS.items():
        command = [sys.executable, __file__, "--way", way, "--saves", str(args.saves)]
        if args.gib:
            command += ["--gib", str(args.gib)]
        proc = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{way:22}  failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        alloc = ", ".join("-" if a is None else f"{a:.2f}" for a in r["alloc_seconds"])
        print(f"{way:22}{r['bytes'] / 1e9:6.1f}  {', '.join(f'{s:.2f}' for s in r['seconds']):34}"
              f"{r['bytes'] / 1e9 / r['seconds'][-1]:10.1f}  {alloc}", flush=True)


if __name__ == "__main__":
    main()
