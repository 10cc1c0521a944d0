"""One heartbeat writer per node on the shared file system (:mod:`hpc_mca.runtime.heartbeat`).

Each rank writes its beat into a directory on its own node (``/dev/shm``, else the temp
directory: see :func:`local_directory`), where the node's other ranks see it; the node's
*aggregator*, the lowest rank with a beat there, copies them all into one file of the shared
heartbeat directory every beat interval. At 8 ranks a node that is 8 times fewer creates and
renames on the shared file system, and 8 times fewer files for the watchdog to read
(``benchmarks/heartbeat_scale.py``).

What a stopped process looks like stays the same: a rank frozen (SIGSTOP, a dead driver) stops
rewriting its local beat, and the aggregator copies that stale beat as it is; an aggregator
frozen stops rewriting the node file, so every beat in it goes stale and the watchdog names
the whole node. The lowest rank present aggregates, not a fixed local rank: when it ends, the
next one takes over at its next beat, and every rank that ends rewrites the node file without
its own beat (the last one removes it), under a lock on the node-local directory so that ranks
ending together never leave a file behind.

The node file (``node-<node>.<id>.json``) holds ``node``, ``time`` (when it was written),
``writer`` (the aggregator's rank) and ``beats``: each local rank's beat as the rank wrote it
(the fields of :mod:`hpc_mca.runtime.heartbeat`). ``<id>`` names the node-local directory
(device and inode), so ranks that do not share one (a container with its own ``/dev/shm``)
each write their own file instead of overwriting each other's.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from hpc_mca.rundir import write_atomic

LOCAL_ROOT_ENV = "HPC_MCA_HEARTBEAT_LOCAL_DIR"
"""Where a node's ranks keep their beats (default: ``/dev/shm``, else the temp directory);
``none``: every rank writes its own file in the shared directory (the layout before node files)."""
LOCAL_ROOTS = ("/dev/shm",)
"""Node-local directories tried before the temp directory (memory-backed: no disk traffic)."""
NODE_PREFIX = "node-"
RANK_PREFIX = "rank-"
LOCK_NAME = ".lock"
LOCK_WAIT_S = 2.0
"""How long a beat waits for the node lock; a holder frozen longer than that leaves the node
file unwritten, and it goes stale (that holder is stopped)."""
_RANK_FILE = re.compile(r"rank-(\d+)\.json")


def rank_file(directory: Path, rank: int) -> Path:
    """A rank's own beat: in the node-local directory, or the shared one without it."""
    return Path(directory) / f"{RANK_PREFIX}{rank:05d}.json"


def local_directory(shared: Path, node: str, env: Mapping[str, str] = os.environ) -> Path | None:
    """The node-local directory this node's ranks of this job step share, created; None where
    there is none usable (every rank then writes to the shared directory)."""
    root = env.get(LOCAL_ROOT_ENV, "")
    if root.lower() == "none":
        return None
    roots = [root] if root else [*LOCAL_ROOTS, tempfile.gettempdir()]
    # Ranks of one job step on one node agree on the name; a requeued start or another step
    # (their leftovers: a killed rank removes nothing) and another node sharing the host (the
    # local Slurm's nodes) never do.
    job = env.get("SLURM_JOB_ID", "") or "nojob"
    key = "\0".join([str(Path(shared).resolve()), node, job, env.get("SLURM_RESTART_COUNT", ""),
                     env.get("SLURM_STEP_ID", "")])
    name = f"hpc-mca-heartbeat-{job}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    for candidate in roots:
        path = Path(candidate) / name
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if path.stat().st_uid == os.getuid() and os.access(path, os.W_OK | os.X_OK):
            return path
    return None


def local_ranks(local: Path) -> list[int]:
    """The ranks with a beat in the node-local directory, lowest first."""
    try:
        names = os.listdir(local)
    except OSError:
        return []
    return sorted(int(m[1]) for m in map(_RANK_FILE.fullmatch, names) if m)


def node_file(shared: Path, local: Path, node: str) -> Path:
    """The shared file of the ranks sharing ``local`` (see the module docstring)."""
    stat = os.stat(local)
    ident = hashlib.sha1(f"{stat.st_dev}:{stat.st_ino}".encode()).hexdigest()[:8]
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node)
    return Path(shared) / f"{NODE_PREFIX}{safe}.{ident}.json"


@contextmanager
def node_lock(local: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[bool]:
    """Hold the node-local directory's lock (True), or give up after ``wait_s`` (False)."""
    try:
        fd = os.open(Path(local) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield False
        return
    try:
        yield _acquire(fd, wait_s)
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def local_beats(local: Path) -> list[dict]:
    """The beats in the node-local directory as their ranks wrote them, lowest rank first (a
    file that cannot be read this time is left out)."""
    beats = []
    for rank in local_ranks(local):
        try:
            beats.append(json.loads(rank_file(local, rank).read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return beats


def roll_up(shared: Path, local: Path, node: str, writer: int, previous: Path | None = None) -> Path | None:
    """Under the node lock: every beat in ``local`` into the node file, or, when none is left,
    the node file and the node-local directory removed. Returns the node file as it now stands
    for this process: the one written, None once removed, ``previous`` when the lock was not
    had. ``previous`` (the file this process wrote last) is removed if the name changed (the
    node-local directory was made anew). An OSError of the shared file system goes to the
    caller."""
    with node_lock(local) as held:
        if not held:
            return previous
        beats = local_beats(local)
        path = node_file(shared, local, node)
        if previous is not None and previous != path:
            previous.unlink(missing_ok=True)
        if not beats:
            path.unlink(missing_ok=True)
            for leftover in (Path(local) / LOCK_NAME, Path(local)):
                try:  # a rank starting right now keeps the directory (not empty), and makes it anew
                    leftover.rmdir() if leftover.is_dir() else leftover.unlink()
                except OSError:
                    pass
            return None
        write_atomic(path, json.dumps({"node": node, "time": time.time(), "writer": writer, "beats": beats}))
        return path
