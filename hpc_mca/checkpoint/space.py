"""Room on disk for the next checkpoint, and a plain message when there is none.

Before each save, rank 0 compares the free bytes of the checkpoint directory's file system
with the size of the newest complete checkpoint (the next one is about as big; a run's first
save has nothing to compare with and relies on the error path below). When that does not fit:

* the checkpoints that keep-last-K (``save_total_limit``) would delete right after this save
  are deleted before it instead, if that makes enough room (never the one ``latest`` names:
  until the new save is durable it is the only good one);
* otherwise the run stops with :class:`CheckpointSpaceError`: one line naming the directory,
  the bytes needed and free, and the last good checkpoint. The rank exits 2 (bad input: the
  batch script does not requeue a job that would fail the same save again).

A save that fails because the disk filled up anyway (ENOSPC or a quota from any layer, or
torch's truncated-record error "unexpected pos") is reported the same way, after its partial
``iter_N.tmp`` is removed. Pure Python (no torch).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from hpc_mca.errors import UserError

from .store import CheckpointError, complete_checkpoints, read_tracker

MARGIN = 1.05
"""The next checkpoint is taken to need the newest one's size plus 5% (metadata, growth)."""
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_MESSAGES = ("No space left on device", "Disk quota exceeded", "unexpected pos")


class CheckpointSpaceError(CheckpointError, UserError):
    """A checkpoint does not fit on its file system; one line, exit 2 (never requeued)."""


def tree_bytes(path: Path) -> int:
    """Bytes of the files below ``path`` (0 when it does not exist)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def make_room(root: Path, keep: int | None, name: str) -> tuple[str | None, list[Path]]:
    """Before saving ``name`` under ``root``: (None, pruned dirs) when it fits (maybe after
    pruning what keep-last-K would prune after the save), else (the one-line reason, [])."""
    complete = complete_checkpoints(root)
    if not complete:
        return None, []
    latest = read_tracker(root)
    newest = root / latest if latest else complete[-1][1]
    needed = int(tree_bytes(newest) * MARGIN)
    free = shutil.disk_usage(root).free
    if free >= needed:
        return None, []
    surplus = complete[:max(0, len(complete) - (keep - 1))] if keep is not None else []
    prunable = [path for _, path in surplus if path.name != latest]
    if prunable and free + sum(tree_bytes(p) for p in prunable) >= needed:
        for path in prunable:
            shutil.rmtree(path, ignore_errors=True)
        return None, prunable
    return space_message(name, root, needed, free, newest), []


def space_message(name: str, root: Path, needed: int | None, free: int,
                  last_good: Path | None) -> str:
    need = f"about {_mb(needed)}" if needed else "more room"
    good = (f"the last good checkpoint is {last_good.name}" if last_good is not None
            else "there is no earlier checkpoint")
    return (f"checkpoint {name} does not fit: {root} needs {need} and its file system has "
            f"{_mb(free)} free; {good}; free space there (or lower save_total_limit), then "
            f"resume (hpc-mca resume JOBID)")


def is_out_of_space(err: BaseException) -> bool:
    """True when ``err`` (or what caused it) says the disk or a quota is full."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL_ERRNOS:
            return True
        if any(text in str(current) for text in _FULL_MESSAGES):
            return True
        stack += [current.__cause__, current.__context__]
        # torch.distributed.checkpoint's CheckpointException keeps each rank's failure as
        # (exception, traceback summary).
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                first = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(first, BaseException):
                    stack.append(first)
    return False


def last_good(root: Path) -> Path | None:
    name = read_tracker(root)
    return root / name if name else None
