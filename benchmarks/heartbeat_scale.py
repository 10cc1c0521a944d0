"""Heartbeats at scale: one file per rank against one file per node on the shared file system.

Simulates ``--nodes`` x ``--ranks-per-node`` ranks in this process (1,024 x 8 = 8,192 by
default) with the ranks' own code: a :class:`hpc_mca.runtime.heartbeat.Heartbeat` per rank,
driven for ``--intervals`` beat intervals as its thread beats (``beats_per_interval`` beats an
interval, the last one rolling the node's beats up where the rank is its node's writer), once
with every rank writing its own file (``HPC_MCA_HEARTBEAT_LOCAL_DIR=none``, the layout before
node files) and once with node files. The calls that reach the shared heartbeat directory are
counted as they happen (``open`` for writing: a create, each ``write``, ``os.replace``: a
rename, ``os.unlink``: a remove), after one untimed interval that creates the files, for the
automatic 30 s interval and for 1 s (a 10 s hang timeout); operations per second are the
counted operations per interval over the interval. Then the watchdog's scan
(:func:`hpc_mca.slurm.watchdog.read_beats` over the directory, median of ``--repeats``) of
each. The shared directory here is this machine's file system with a warm page cache: on a
parallel file system each file opened costs a metadata server round trip, which the file
counts show; the load average printed with the table says how busy this machine was.

Usage:
    .venv/bin/python benchmarks/heartbeat_scale.py [--nodes 1024] [--ranks-per-node 8]
        [--intervals 2] [--repeats 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import builtins
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from hpc_mca.runtime.heartbeat import Heartbeat
from hpc_mca.runtime.node_beats import LOCAL_ROOT_ENV
from hpc_mca.slurm.watchdog import read_beats

MODES = ("per-rank", "per-node")
INTERVALS = {30: None, 1: 10}
"""Beat interval (s) -> the hang timeout that gives it (None: automatic)."""
OPS = ("create", "write", "rename", "remove")


class _CountedFile:
    """A file opened for writing in the shared directory: its writes are counted."""

    def __init__(self, file: TextIO, counts: Counter) -> None:
        self.file, self.counts = file, counts

    def write(self, data: str) -> int:
        self.counts["write"] += 1
        return self.file.write(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.file, name)

    def __enter__(self) -> _CountedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


@contextmanager
def counting(shared: Path) -> Iterator[Counter]:
    """Count the file-system calls into ``shared`` while the block runs."""
    counts: Counter = Counter()
    prefix = str(shared) + os.sep

    def inside(path: object) -> bool:
        return str(path).startswith(prefix)

    real_open, real_replace, real_unlink = builtins.open, os.replace, os.unlink

    def opened(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if inside(file) and any(c in mode for c in "wax+"):
            counts["create"] += 1
            return _CountedFile(handle, counts)
        return handle

    def replaced(src, dst, *args, **kwargs):
        counts["rename"] += inside(dst)
        return real_replace(src, dst, *args, **kwargs)

    def unlinked(path, *args, **kwargs):
        counts["remove"] += inside(path)
        return real_unlink(path, *args, **kwargs)

    builtins.open, os.replace, os.unlink = opened, replaced, unlinked
    try:
        yield counts
    finally:
        builtins.open, os.replace, os.unlink = real_open, real_replace, real_unlink


def one_interval(hbs: list[Heartbeat]) -> None:
    """Every rank's beats of one interval, as its thread writes them."""
    per = hbs[0].beats_per_interval
    for k in range(per):
        for hb in hbs:
            hb.beat(aggregate=k == per - 1)


def simulate(root: Path, local: Path, mode: str, interval: int, nodes: int, per_node: int,
             intervals: int) -> tuple[Path, Counter]:
    """The shared directory after ``intervals`` beat intervals, and the calls counted in it.
    ``local``: where the simulated nodes' local directories go."""
    shared = root / f"{mode}-{interval}s" / "heartbeat"
    shared.mkdir(parents=True)
    os.environ[LOCAL_ROOT_ENV] = "none" if mode == "per-rank" else str(local / f"{interval}s")
    hbs = [Heartbeat(shared, n * per_node + r, hang_timeout=INTERVALS[interval], ddp_timeout=1800.0,
                     node=f"node{n:04d}") for n in range(nodes) for r in range(per_node)]
    for hb in hbs:
        hb.step_done(1, 1.0)
    assert hbs[0].interval == interval and hbs[0].beats_per_interval == (1 if mode == "per-rank" else 2)
    one_interval(hbs)  # the files appear
    with counting(shared) as counts:
        for _ in range(intervals):
            one_interval(hbs)
    return shared, counts


def scan(shared: Path, repeats: int) -> tuple[float, int]:
    """The watchdog's read of the directory: median seconds, beats read."""
    times, beats = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        beats = len(read_beats(shared))
        times.append(time.perf_counter() - start)
    return statistics.median(times), beats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--intervals", type=int, default=2, help="beat intervals counted per setting")
    parser.add_argument("--repeats", type=int, default=5, help="watchdog scans timed per layout")
    parser.add_argument("--dir", type=Path, default=None, help="where to simulate (default: a temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="heartbeat-scale-", dir=args.dir))
    # The nodes' local directories where the ranks would have them: memory (/dev/shm) if here.
    shm = Path("/dev/shm")
    local = Path(tempfile.mkdtemp(prefix="heartbeat-scale-", dir=shm)) if os.access(shm, os.W_OK) else root / "local"
    ranks = args.nodes * args.ranks_per_node
    try:
        ops: dict[tuple[str, int], float] = {}
        files, scans = {}, {}
        for mode in MODES:
            for interval in INTERVALS:
                started = time.perf_counter()
                shared, counts = simulate(root, local, mode, interval, args.nodes, args.ranks_per_node, args.intervals)
                ops[mode, interval] = sum(counts[op] for op in OPS) / args.intervals
                print(f"  {mode:8} at {interval:2d} s: per interval "
                      + ", ".join(f"{counts[op] / args.intervals:,.0f} {op}s" for op in OPS)
                      + f" ({time.perf_counter() - started:.1f} s to simulate)", flush=True)
            files[mode] = len(list(shared.iterdir()))
            scans[mode] = scan(shared, args.repeats)
    finally:
        os.environ.pop(LOCAL_ROOT_ENV, None)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    rows: list[tuple[str, list[float], str]] = [("ranks", [ranks, ranks], "int"),
            ("shared files", [files[m] for m in MODES], "int"),
            ("shared FS ops per interval", [ops[m, 30] for m in MODES], "int"),
            ("shared FS ops/s at 30 s interval", [ops[m, 30] / 30 for m in MODES], "rate"),
            ("shared FS ops/s at 1 s interval", [ops[m, 1] / 1 for m in MODES], "rate"),
            (f"watchdog scan (read_beats, median of {args.repeats})", [scans[m][0] * 1e3 for m in MODES], "ms"),
            ("beats read per scan", [scans[m][1] for m in MODES], "int")]
    print(f"\nheartbeats of {args.nodes:,} nodes x {args.ranks_per_node} ranks = {ranks:,} ranks "
          f"({args.intervals} intervals counted per setting; ops: creates, writes, renames, removes; "
          f"load average {os.getloadavg()[0]:.1f})")
    print(f"{'':42}{'per-rank files':>16}{'per-node files':>16}{'ratio':>9}")
    for name, (a, b), kind in rows:
        cells = {"int": lambda v: f"{v:,.0f}", "rate": lambda v: f"{v:,.1f}", "ms": lambda v: f"{v:,.2f} ms"}[kind]
        ratio = f"{a / b:.1f}x" if name not in ("ranks", "beats read per scan") and b else ""
        print(f"{name:42}{cells(a):>16}{cells(b):>16}{ratio:>9}".rstrip())


if __name__ == "__main__":
    main()
