"""The MTP label roll: hpc_mca's vectorised roll vs Megatron-Core's per-document loop.

A micro-batch of ``--docs`` documents (lengths 4..64, multiples of 2·CP, no padding: the case
where upstream's ``_roll_tensor_packed_seq`` is correct) is rolled left by one slot, on one
process (CP1) and on two gloo ranks (CP2). Each run checks that both rolls give identical
values, then times them (median of ``--iters``):

* ``ours (plan + roll)``: :func:`roll_plan` for the micro-batch and one :func:`roll_left`;
* ``ours (roll)``: :func:`roll_left` with the plan made once (it is reused for labels, loss
  mask, input ids and every MTP depth of the micro-batch);
* ``upstream``: ``megatron.core.transformer.multi_token_prediction._roll_tensor_packed_seq``.

Usage:
    .venv/bin/python benchmarks/mtp_roll.py [--docs 1000] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return parser.parse_args()


def _median_seconds(fn, iters: int, distributed: bool) -> float:
    times = []
    for _ in range(iters):
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.multi_token_prediction import _roll_tensor_packed_seq

    from hpc_mca.data.batch import cp_indices
    from hpc_mca.models.roll import roll_left, roll_plan

    torch.set_num_threads(1)
    distributed = "RANK" in __import__("os").environ
    if distributed:
        dist.init_process_group("gloo")
    cp, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    group = dist.group.WORLD if distributed else None
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 17, (args.docs,), generator=gen) * 4
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    labels = torch.randint(0, 50000, (1, int(cu[-1])), generator=gen)
    local = labels[:, cp_indices(cu, cp, rank)]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu)
    plan = roll_plan(cu, cu, cp, rank)
    ours = roll_left(local, plan, group)[0]
    upstream = _roll_tensor_packed_seq(local, -1, -1, params, group)[0]
    timings = {
        "ours (plan + roll)": _median_seconds(
            lambda: roll_left(local, roll_plan(cu, cu, cp, rank), group), args.iters, distributed),
        "ours (roll)": _median_seconds(lambda: roll_left(local, plan, group), args.iters,
                                       distributed),
        "upstream": _median_seconds(
            lambda: _roll_tensor_packed_seq(local, -1, -1, params, group), args.iters, distributed),
    }
    Path(args.worker, f"rank{rank}.json").write_text(json.dumps(
        {"identical": bool(torch.equal(ours, upstream)), "seconds": timings}))
    if distributed:
        dist.destroy_process_group()


def run(args: argparse.Namespace, cp: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     f"--nproc-per-node={cp}"] if cp > 1 else [sys.executable])
        subprocess.run([*launcher, __file__, f"--docs={args.docs}", f"--iters={args.iters}",
                        "--worker", out], check=True)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    return {"identical": all(r["identical"] for r in ranks),
            "seconds": {k: max(r["seconds"][k] for r in ranks) for k in ranks[0]["seconds"]}}


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    print(f"MTP roll of one packed micro-batch, {args.docs} documents (4..64 tokens), CPU")
    print(f"{'CP':<4} {'identical':<10} {'upstream ms':>12} {'ours ms':>8} {'ratio':>7} "
          f"{'plan+roll ms':>13} {'ratio':>7}")
    for cp in (1, 2):
        result = run(args, cp)
        s = result["seconds"]
        up, roll, both = s["upstream"], s["ours (roll)"], s["ours (plan + roll)"]
        print(f"{cp:<4} {str(result['identical']):<10} {up * 1e3:12.2f} {roll * 1e3:8.3f} "
              f"{up / roll:6.0f}x {both * 1e3:13.3f} {up / both:6.0f}x")
        if not result["identical"]:
            sys.exit(f"CP{cp}: the rolls differ")


if __name__ == "__main__":
    main()
