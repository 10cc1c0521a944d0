"""``hpc-mca cancel``: end a job for good, whatever signals came before.

A plain ``scancel`` sends TERM to the batch shell; the shell asks Slurm why the job is ending
(see the requeue contract in :mod:`hpc_mca.checkpoint.requeue`) and never requeues a
cancelled job. ``hpc-mca cancel`` also leaves a record in the run directory first
(``cancel_requested``: ``job=<id> time=<unix time> user=<name>``), which the batch shell
reads as the same verdict even if the controller cannot be asked, and re-reads after it
requeued the job (a cancel racing a requeue still wins). Then it waits until Slurm reports the
job ended, cancelling again if the job came back as pending in the meantime.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from hpc_mca.rundir import CANCEL_FILE

from . import commands
from .errors import OpsError
from .manifest import find_run


@dataclass(frozen=True)
class Cancelled:
    job_id: str
    name: str
    was: str
    """The state when the cancel was asked for."""
    cancelled: bool
    """False when the job had already ended (nothing was done)."""
    now: str | None
    """The state after waiting (None when not waited for, or Slurm forgot the job)."""


def record_cancel(run_dir: Path, job_id: str, user: str) -> None:
    """Append this cancel to the run directory's record. Best effort: without it (no run dir
    found, not writable) the batch shell still learns of the cancel from Slurm."""
    try:
        with (run_dir / CANCEL_FILE).open("a", encoding="utf-8") as out:
            out.write(f"job={job_id} time={time.time():.3f} user={user}\n")
    except OSError:
        pass


def cancel_job(job_id: str, runs_root: Path, *, wait_s: float = 120.0,
               poll_s: float = 0.5) -> Cancelled:
    """Cancel ``job_id`` for good (nothing happens when it had already ended). Waits up to
    ``wait_s`` for Slurm to report the end (0: do not wait)."""
    job_id = commands.check_job_id(job_id)
    state = commands.job_state(job_id)
    if state is None:
        raise OpsError(f"job {job_id} is unknown to Slurm (squeue, sacct); valid: a job id "
                       "from hpc-mca status")
    if state.finished:
        return Cancelled(job_id, state.name, state.state, False, state.state)
    try:
        record_cancel(find_run(job_id, runs_root).run_dir, job_id, commands.current_user())
    except OpsError:
        pass  # no run directory known: Slurm's verdict alone stops a requeue
    commands.run(["scancel", job_id])
    now = _wait_ended(job_id, wait_s, poll_s) if wait_s > 0 else None
    return Cancelled(job_id, state.name, state.state, True, now)


def _wait_ended(job_id: str, wait_s: float, poll_s: float) -> str | None:
    """The job's terminal state once Slurm reports one; cancels again if it is pending."""
    deadline = time.monotonic() + wait_s
    while True:
        state = commands.job_state(job_id)
        if state is None or state.finished:
            return state.state if state else None
        if state.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD"):
            commands.run(["scancel", job_id], check=False)
        if time.monotonic() >= deadline:
            raise OpsError(f"job {job_id} is still {state.state} {wait_s:.0f} s after scancel; "
                           f"check: hpc-mca status {job_id}")
        time.sleep(poll_s)
