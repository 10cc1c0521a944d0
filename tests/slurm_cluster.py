"""Test helpers for jobs on the local Slurm cluster started by ``bin/local-slurm``.

Submit with :func:`sbatch`, wait with :func:`wait_for_job` (final state from sacct), inspect
requeues with :func:`job_records` / :func:`job_restart_count`. Imports no torch.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCAL_SLURM = REPO / "bin" / "local-slurm"

TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "TIMEOUT",
        "CANCELLED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
    }
)
"""sacct states after which a job does not run again (REQUEUED is not one: the job comes back)."""


class SlurmError(RuntimeError):
    """A Slurm command or the local cluster failed."""


class ClusterNeedsRoot(SlurmError):
    """The cluster is down and this process may not start it."""


@dataclass(frozen=True)
class JobRecord:
    """One sacct record of a job; a requeued job has one per run (``sacct --duplicates``)."""

    state: str
    submit: str
    start: str
    end: str
    exit_code: str


def _run(args: list[str], *, stdin: str | None = None, timeout: float = 60) -> str:
    try:
        done = subprocess.run(
            args, input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError as exc:
        hint = f"is Slurm installed? (sudo {LOCAL_SLURM} start)"
        raise SlurmError(f"{args[0]} not found: {hint}") from exc
    if done.returncode != 0:
        raise SlurmError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def cluster_is_up() -> bool:
    """True when ``bin/local-slurm status`` reports every daemon running and every node usable."""
    done = subprocess.run([str(LOCAL_SLURM), "status"], capture_output=True, text=True, check=False)
    return done.returncode == 0


def ensure_cluster(timeout: float = 900) -> None:
    """Start the local cluster unless it is already up (installs packages on first use)."""
    if cluster_is_up():
        return
    if os.geteuid() != 0:
        raise ClusterNeedsRoot(f"the local Slurm cluster is down; run: sudo {LOCAL_SLURM} start")
    done = subprocess.run(
        [str(LOCAL_SLURM), "start"], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise SlurmError(f"{LOCAL_SLURM} start failed:\n{done.stdout}{done.stderr}")


def sbatch(script: str | Path, *args: str) -> str:
    """Submit a batch script and return its job id.

    ``script`` is a path (a ``Path``, or a one-line ``str`` naming a file) or the script text
    itself (a ``str`` with newlines, passed on stdin). ``args`` go to sbatch before the script.
    """
    if isinstance(script, Path) or "\n" not in script:
        out = _run(["sbatch", "--parsable", *args, str(script)])
    else:
        out = _run(["sbatch", "--parsable", *args], stdin=script)
    return out.strip().split(";")[0]


def job_records(job_id: str) -> list[JobRecord]:
    """Every sacct record of the job's allocation, oldest first (empty until sacct knows it)."""
    fields = "State,Submit,Start,End,ExitCode"
    out = _run(["sacct", "-j", job_id, "--duplicates", "-X", "-n", "-P", "-o", fields])
    records = []
    for line in out.splitlines():
        state, submit, start, end, exit_code = line.split("|")
        # "CANCELLED by 0" -> "CANCELLED"
        records.append(JobRecord(state.split()[0], submit, start, end, exit_code))
    return records


def job_state(job_id: str) -> str | None:
    """The job's current sacct state, or None while sacct does not know the job yet."""
    records = job_records(job_id)
    return records[-1].state if records else None


def wait_for_job(job_id: str, timeout: float = 120, poll: float = 0.5) -> str:
    """Wait until the job reaches a terminal state (see TERMINAL_STATES) and return it."""
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state in TERMINAL_STATES:
            return state
        time.sleep(poll)
    raise TimeoutError(f"job {job_id} not finished after {timeout} s (last sacct state: {state})")


def job_restart_count(job_id: str) -> int:
    """How often the job was requeued: its REQUEUED records (SLURM_RESTART_COUNT in the job)."""
    return sum(record.state == "REQUEUED" for record in job_records(job_id))


def cancel(job_id: str) -> None:
    """scancel the job (no error when it has already ended)."""
    _run(["scancel", job_id])


def submitted_job_id(done: subprocess.CompletedProcess) -> str:
    """The job id ``hpc-mca submit``/``resume`` printed ("submitted job N: ..."), asserting the
    command succeeded."""
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.match(r"submitted job (\d+):", done.stdout)
    assert match, done.stdout
    return match.group(1)


def live_job_ids(under: tuple[Path, ...] = ()) -> set[str]:
    """Ids of the jobs squeue lists now (pending, running, completing), only those whose
    working directory is below one of ``under`` when given; empty when squeue cannot
    answer."""
    try:
        out = _run(["squeue", "-h", "-o", "%A\x1f%Z"], timeout=30)
    except SlurmError:
        return set()
    ids = set()
    for line in out.splitlines():
        job_id, _, work_dir = line.strip().partition("\x1f")
        if job_id and (not under or any(Path(work_dir).is_relative_to(d) for d in under)):
            ids.add(job_id)
    return ids


def cancel_jobs(job_ids: set[str], timeout: float = 90) -> list[str]:
    """scancel ``job_ids`` and wait until squeue lists none of them (a job whose ranks save
    before they exit may take a while); returns the ids that were still queued or running."""
    left = sorted(job_ids & live_job_ids())
    if not left:
        return []
    subprocess.run(["scancel", *left], capture_output=True, check=False)
    deadline = time.monotonic() + timeout
    while job_ids & live_job_ids() and time.monotonic() < deadline:
        # A job requeued meanwhile is pending again: cancel that too.
        subprocess.run(["scancel", *sorted(job_ids & live_job_ids())], capture_output=True,
                       check=False)
        time.sleep(1)
    return left
