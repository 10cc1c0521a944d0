"""``hpc-mca logs``: print a job's log, or follow it until the job ends."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from . import commands
from .errors import OpsError
from .manifest import find_run

CHUNK = 1 << 16


def log_path(job_id: str, runs_root: Path) -> Path:
    """Where the job writes its log (stdout and stderr of the batch script and every rank)."""
    run = find_run(job_id, runs_root)
    if run.log is None:
        raise OpsError(f"job {job_id}: no log path known (run dir {run.run_dir})")
    return run.log


def tail_start(path: Path, lines: int | None) -> int:
    """Byte offset at which the last ``lines`` lines begin (0 for the whole file)."""
    if not lines:
        return 0
    with path.open("rb") as f:
        f.seek(0, 2)
        end = f.tell()
        pos, found = end, 0
        while pos > 0 and found <= lines:
            step = min(CHUNK, pos)
            pos -= step
            f.seek(pos)
            block = f.read(step)
            found += block.count(b"\n")
        if found <= lines:
            return 0
        f.seek(pos)
        block = f.read(end - pos)
        cut = len(block)
        for _ in range(lines + 1):
            cut = block.rfind(b"\n", 0, cut)
        return pos + cut + 1


def _copy(f: BinaryIO, out: BinaryIO) -> int:
    total = 0
    while data := f.read(CHUNK):
        out.write(data)
        total += len(data)
    out.flush()
    return total


def show(path: Path, lines: int | None = None, out: BinaryIO | None = None) -> None:
    out = out or sys.stdout.buffer
    if not path.exists():
        raise OpsError(f"log {path} does not exist (yet): the job may still be pending; "
                       "valid: hpc-mca logs JOBID -f waits for it")
    with path.open("rb") as f:
        f.seek(tail_start(path, lines))
        _copy(f, out)


def follow(path: Path, job_id: str, lines: int | None = None, out: BinaryIO | None = None,
           poll_s: float = 0.5, state_every_s: float = 2.0,
           job_finished: Callable[[str], bool] | None = None) -> str | None:
    """Print the log and what is appended to it until the job has ended (then the rest).

    Waits for the file while the job is pending. Returns the job's final state (None if
    Slurm forgot the job)."""
    out = out or sys.stdout.buffer
    finished = job_finished or _job_finished
    while not path.exists():
        if finished(job_id):
            return _final_state(job_id)
        time.sleep(poll_s)
    with path.open("rb") as f:
        f.seek(tail_start(path, lines))
        last_check = 0.0
        while True:
            _copy(f, out)
            if time.monotonic() - last_check >= state_every_s:
                last_check = time.monotonic()
                if finished(job_id):
                    time.sleep(poll_s)  # the last lines may still be on their way
                    _copy(f, out)
                    return _final_state(job_id)
            time.sleep(poll_s)


def _job_finished(job_id: str) -> bool:
    state = commands.job_state(job_id)
    return state is None or state.finished


def _final_state(job_id: str) -> str | None:
    state = commands.job_state(job_id)
    return state.state if state else None
