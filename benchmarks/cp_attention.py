"""Context-parallel attention: tokens/s and peak memory of CP1 vs CP2 per comm type.

One causal packed stream (by default one 8192-token document, where attention dominates) runs
forward + backward through the torch backend's attention:

* ``CP1 1 thread`` / ``CP1 2 threads``: one process, :func:`packed_attention` over the stream;
* ``CP2 all_gather`` / ``CP2 a2a``: two gloo ranks of one thread each (the same cores as CP1
  with 2 threads), :func:`context_parallel_attention` over each rank's mirrored chunks.

tokens/s counts the stream's tokens once per step (slowest rank's time, median of the timed
steps). Peak memory is the largest rise of a rank's resident set above its level once the
inputs exist, sampled every millisecond: what the attention itself allocates, forward and
backward. Ratios are against CP1 with 1 thread, measured in the same run.

Usage:
    .venv/bin/python benchmarks/cp_attention.py                   # CPU, 8192 tokens
    .venv/bin/python benchmarks/cp_attention.py --tokens 4096 --docs 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

CASES = [("CP1 1 thread", 1, "none", 1), ("CP1 2 threads", 1, "none", 2),
         ("CP2 all_gather", 2, "all_gather", 1), ("CP2 a2a", 2, "a2a", 1)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens in the stream")
    parser.add_argument("--docs", type=int, default=1, help="equal documents in the stream")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--worker", nargs=3, metavar=("COMM", "THREADS", "OUT"),
                        help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class PeakRss:
    """Samples this process's resident set every millisecond; ``peak`` is the highest seen."""

    def __init__(self) -> None:
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args: argparse.Namespace) -> None:
    from hpc_mca.data.batch import cp_indices
    from hpc_mca.models.context_parallel import context_parallel_attention
    from hpc_mca.models.packed_attention import packed_attention, packed_layout

    comm, threads, out = args.worker
    torch.set_num_threads(int(threads))
    distributed = comm != "none"
    if distributed:
        dist.init_process_group("gloo")
    cp, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    cu = torch.arange(args.docs + 1) * (args.tokens // args.docs)
    slots = cp_indices(cu, cp, rank)
    gen = torch.Generator().manual_seed(0)
    shape = (args.tokens, args.heads, args.head_dim)
    kv_shape = (args.tokens, args.kv_heads, args.head_dim)
    q, k, v = (torch.randn(s, generator=gen)[slots].requires_grad_()
               for s in (shape, kv_shape, kv_shape))
    layout = packed_layout(cu)

    def step() -> None:
        if distributed:
            o = context_parallel_attention(q, k, v, cu, cu, dist.group.WORLD, comm_type=comm)
        else:
            o = packed_attention(q, k, v, layout, layout)
        o.sum().backward()
        q.grad = k.grad = v.grad = None

    for _ in range(args.warmup):
        step()
    base, times = _rss(), []
    with PeakRss() as peak:
        for _ in range(args.iters):
            if distributed:
                dist.barrier()
            start = time.perf_counter()
            step()
            if distributed:
                dist.barrier()  # the step ends when the slowest rank is done
            times.append(time.perf_counter() - start)
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"seconds": statistics.median(times), "peak_bytes": peak.peak - base}))
    if distributed:
        dist.destroy_process_group()


def run_case(args: argparse.Namespace, cp: int, comm: str, threads: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        flags = [f"--tokens={args.tokens}", f"--docs={args.docs}", f"--heads={args.heads}",
                 f"--kv-heads={args.kv_heads}", f"--head-dim={args.head_dim}",
                 f"--iters={args.iters}", f"--warmup={args.warmup}",
                 "--worker", comm, str(threads), out]
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     f"--nproc-per-node={cp}"] if cp > 1 else [sys.executable])
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        subprocess.run([*launcher, __file__, *flags], check=True, env=env)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    seconds = max(r["seconds"] for r in ranks)
    return {"tokens_per_s": args.tokens / seconds, "peak_bytes": max(r["peak_bytes"] for r in ranks)}


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    print(f"causal attention fwd+bwd, {args.tokens} tokens in {args.docs} document(s), "
          f"{args.heads} heads ({args.kv_heads} kv) × {args.head_dim}, fp32, CPU")
    results = {name: run_case(args, cp, comm, threads) for name, cp, comm, threads in CASES}
    base = results[CASES[0][0]]
    print(f"{'case':<16} {'tokens/s':>10} {'ratio':>6} {'peak MiB/rank':>14} {'ratio':>6}")
    for name, r in results.items():
        print(f"{name:<16} {r['tokens_per_s']:10.0f} {r['tokens_per_s'] / base['tokens_per_s']:6.2f}"
              f" {r['peak_bytes'] / 2**20:14.1f} {r['peak_bytes'] / base['peak_bytes']:6.2f}")


if __name__ == "__main__":
    main()
