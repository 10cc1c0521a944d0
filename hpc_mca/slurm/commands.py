"""Running Slurm's commands, and a job's state joined from squeue and sacct.

squeue knows a job while it is pending or running (and for MinJobAge after); sacct (with
slurmdbd accounting) knows it afterwards, with one record per run of a requeued job
(``--duplicates``). :func:`job_state` takes the live state from squeue when it has one and
the rest from sacct. Fields are separated by ASCII 0x1f, which no job name or path holds in
practice, so names with spaces or ``|`` parse.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .errors import OpsError

SEP = "\x1f"
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL",
                             "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"})
"""States after which a job does not run again (REQUEUED is not one)."""
JOB_ID_RE = re.compile(r"\d+(?:_\d+)?")


def submit_held(script: str, env: Mapping[str, str], record: Callable[[str], None]) -> str:
    """Submit ``script`` held, let ``record(job_id)`` write what must exist before the job can
    start (run directory, manifest, job index), then release it; returns the job id. If
    anything fails in between, the held job is cancelled: nothing is left queued."""
    done = run(["sbatch", "--parsable", "--hold"], stdin=script, env=env)
    job_id = done.stdout.strip().split(";")[0]
    try:
        check_job_id(job_id)
        record(job_id)
        run(["scontrol", "release", job_id])
    except BaseException:
        if job_id:
            run(["scancel", job_id], check=False)
        raise
    return job_id


def check_job_id(job_id: str) -> str:
    """``job_id`` when it looks like a Slurm job id (``123`` or array ``123_4``)."""
    if not JOB_ID_RE.fullmatch(str(job_id)):
        raise OpsError(f"job id {job_id!r} is not a Slurm job id; valid: digits, e.g. 1234")
    return str(job_id)


def run(args: Sequence[str], *, stdin: str | None = None, timeout: float = 60,
        env: Mapping[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run a Slurm command; a missing command or (with ``check``) a failure is an OpsError
    carrying the command's last error line."""
    try:
        done = subprocess.run(list(args), input=stdin, capture_output=True, text=True,
                              timeout=timeout, env=None if env is None else dict(env))
    except FileNotFoundError:
        raise OpsError(f"{args[0]} not found: Slurm's commands are not on PATH (on a cluster: "
                       "module load slurm; locally: sudo bin/local-slurm start)") from None
    except subprocess.TimeoutExpired:
        raise OpsError(f"{args[0]} did not answer within {timeout:.0f} s "
                       "(is slurmctld up? try: scontrol ping)") from None
    if check and done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        raise OpsError(f"{' '.join(args[:2])} failed (exit {done.returncode}): {lines[-1]}")
    return done


@dataclass(frozen=True)
class JobState:
    """One job as squeue and sacct see it."""

    job_id: str
    name: str
    state: str
    """PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, REQUEUED, ..."""
    reason: str
    """squeue's reason for a pending job (e.g. Priority, Resources, JobHeldUser), else ''."""
    elapsed: str
    time_limit: str
    nodes: str
    node_list: str
    work_dir: str
    exit_code: str
    """sacct's ExitCode (``code:signal``) once the job ended, else ''."""
    requeues: int
    """Runs before the current one (sacct REQUEUED records)."""
    source: str
    """squeue (pending/running), scontrol (ended recently) or sacct (older)."""

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES


_SQUEUE_FIELDS = ("%i", "%T", "%r", "%M", "%l", "%D", "%N", "%Z", "%j")
_SACCT_FIELDS = ("JobID", "State", "Elapsed", "Timelimit", "NNodes", "NodeList", "WorkDir",
                 "ExitCode", "JobName")


def squeue_row(job_id: str) -> dict[str, str] | None:
    """The job's squeue row, or None when squeue does not (or no longer) know it."""
    done = run(["squeue", "-h", "-j", check_job_id(job_id), "-o", SEP.join(_SQUEUE_FIELDS)],
               check=False)
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return None
        raise OpsError(f"squeue -j {job_id} failed (exit {done.returncode}): "
                       f"{done.stderr.strip()}")
    for line in done.stdout.splitlines():
        values = line.split(SEP, len(_SQUEUE_FIELDS) - 1)
        if len(values) == len(_SQUEUE_FIELDS) and values[0] == job_id:
            keys = ("job_id", "state", "reason", "elapsed", "time_limit", "nodes", "node_list",
                    "work_dir", "name")
            return dict(zip(keys, values))
    return None


def sacct_rows(job_id: str) -> list[dict[str, str]]:
    """Every accounting record of the job's allocation, oldest first ([] if sacct does not
    know it or accounting is off)."""
    args = ["sacct", "-j", check_job_id(job_id), "-X", "--duplicates", "-n", "-P",
            f"--delimiter={SEP}", "-o", ",".join(_SACCT_FIELDS)]
    done = run(args, check=False)
    if done.returncode != 0:
        return []
    rows = []
    for line in done.stdout.splitlines():
        values = line.split(SEP, len(_SACCT_FIELDS) - 1)
        if len(values) == len(_SACCT_FIELDS):
            rows.append(dict(zip(_SACCT_FIELDS, values)))
    return rows


def job_state(job_id: str) -> JobState | None:
    """The job's state, or None when Slurm does not know the id.

    Sources in order: squeue (pending/running), ``scontrol show job`` (exact for a job that
    ended recently: slurmctld keeps it for MinJobAge), sacct (older jobs; its first record of a
    job can be a placeholder named "allocation", and it stores '"' in names as '`'). The
    requeue count comes from sacct's REQUEUED records and scontrol's Restarts.
    """
    live = squeue_row(job_id)
    records = sacct_rows(job_id)
    requeues = sum(r["State"].split()[0] == "REQUEUED" for r in records)
    if live is not None:
        return JobState(job_id, live["name"], live["state"], _reason(live), live["elapsed"],
                        live["time_limit"], live["nodes"], live["node_list"], live["work_dir"],
                        "", requeues, "squeue")
    info = scontrol_job(job_id)
    if info.get("JobState"):
        restarts = int(info["Restarts"]) if info.get("Restarts", "").isdigit() else 0
        return JobState(job_id, info.get("JobName", ""), info["JobState"], "",
                        info.get("RunTime", ""), info.get("TimeLimit", ""),
                        info.get("NumNodes", ""), info.get("NodeList", ""),
                        info.get("WorkDir", ""), info.get("ExitCode", ""),
                        max(requeues, restarts), "scontrol")
    if not records:
        return None
    last = records[-1]
    # "CANCELLED by 0" -> "CANCELLED"
    return JobState(job_id, last["JobName"], last["State"].split()[0], "", last["Elapsed"],
                    last["Timelimit"], last["NNodes"], last["NodeList"], last["WorkDir"],
                    last["ExitCode"], requeues, "sacct")


def _reason(row: Mapping[str, str]) -> str:
    return "" if row["reason"] in ("None", "(null)") else row["reason"]


def scontrol_job(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict ({} once slurmctld forgot the job). Values may hold
    spaces: a field ends where the next ``Key=`` begins."""
    done = run(["scontrol", "show", "job", "-o", check_job_id(job_id)], check=False)
    if done.returncode != 0 or not done.stdout.strip():
        return {}
    text = done.stdout.strip().splitlines()[0]
    keys = list(re.finditer(r"(?:^| )([A-Za-z][A-Za-z:/_]*)=", text))
    fields = {}
    for here, after in zip(keys, keys[1:] + [None]):
        end = after.start() if after is not None else len(text)
        fields[here.group(1)] = text[here.end():end]
    return fields


def current_user() -> str:
    """The login name (the uid where there is none)."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def sbatch_env(drop: Sequence[str]) -> dict[str, str]:
    """This process's environment for sbatch (which exports it to the job) without the
    variables in ``drop``, so the values baked into the script apply."""
    return {k: v for k, v in os.environ.items() if k not in drop}
