"""Running Slurm's commands, and a job's state joined from squeue and sacct.

squeue knows a job while it is pending or running (and for MinJobAge after); sacct (with
slurmdbd accounting) knows it afterwards, with one record per run of a requeued job
(``--duplicates``). :func:`job_state` takes the live state from squeue when it has one and
the rest from sacct. Fields are separated by ASCII 0x1f, which no job name or path holds in
practice, so names with spaces or ``|`` parse.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

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
    total_elapsed_s: int | None = None
    """Run time of every run of this job id (earlier runs from sacct's records, then this
    one), or None where unknown; ``elapsed`` is this run's only."""

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def runs(self) -> int:
        return self.requeues + 1


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
    requeue count comes from sacct's REQUEUED records and scontrol's Restarts; the exit code
    of an ended job from :func:`batch_exit`, whichever source gave the state.
    """
    live = squeue_row(job_id)
    records = sacct_rows(job_id)
    requeues = sum(r["State"].split()[0] == "REQUEUED" for r in records)
    if live is not None:
        return JobState(job_id, live["name"], live["state"], _reason(live), live["elapsed"],
                        live["time_limit"], live["nodes"], live["node_list"], live["work_dir"],
                        "", requeues, "squeue", _total_elapsed(records, live["elapsed"]))
    info = scontrol_job(job_id)
    if info.get("JobState"):
        restarts = int(info["Restarts"]) if info.get("Restarts", "").isdigit() else 0
        state = JobState(job_id, info.get("JobName", ""), info["JobState"], "",
                         info.get("RunTime", ""), info.get("TimeLimit", ""),
                         info.get("NumNodes", ""), info.get("NodeList", ""),
                         info.get("WorkDir", ""), info.get("ExitCode", ""),
                         max(requeues, restarts), "scontrol",
                         # without sacct's record of every earlier run the total is unknown
                         _total_elapsed(records, info.get("RunTime", "")) if requeues >= restarts
                         else None)
        return _with_batch_exit(state)
    if not records:
        return None
    last = records[-1]
    # "CANCELLED by 0" -> "CANCELLED"
    return _with_batch_exit(JobState(
        job_id, last["JobName"], last["State"].split()[0], "", last["Elapsed"], last["Timelimit"],
        last["NNodes"], last["NodeList"], last["WorkDir"], last["ExitCode"], requeues, "sacct",
        _total_elapsed(records, last["Elapsed"])))


def _with_batch_exit(state: JobState) -> JobState:
    """An ended job with the exit code of its batch step; COMPLETING while that step (the
    batch script) is still ending, so no caller reports an exit code that is not final."""
    if not state.finished:
        return state
    batch = batch_exit(state.job_id)
    if batch is None:
        return state  # no batch step recorded (accounting off, or cancelled while pending)
    code, ended = batch
    if ended:
        return dataclasses.replace(state, exit_code=code)
    # A step whose end accounting never got (its node died) must not hold watch forever.
    if state.state == "NODE_FAIL":
        return state
    return dataclasses.replace(state, state="COMPLETING", exit_code="")


def batch_exit(job_id: str) -> tuple[str, bool] | None:
    """sacct's ExitCode of the newest run's batch step and whether that step has ended, or
    None when the newest run has no batch step (accounting off, cancelled while pending).

    Why the batch step and not the job (``sacct -X``) or scontrol: a job's exit code is what
    its batch script returned. For a cancelled job, sacct's job record keeps the 0:0 written
    when the cancel was accepted, before the script ended (and returned 143 from its TERM
    handler), and scontrol's ExitCode is gone after MinJobAge; the batch step is written when
    the script ends and stays, so ``watch`` at the end and ``status`` at any time later read
    the same value. The price: sacct (22.05 measured) keeps exit codes modulo 128, so a
    script's exit 143 reads ``15:0`` (as exit 15 does), where scontrol said 143:0 for a few
    minutes; one value that never changes beats an exact one that does."""
    done = run(["sacct", "-j", check_job_id(job_id), "--duplicates", "-n", "-P",
                f"--delimiter={SEP}", "-o", "JobID,ExitCode,End"], check=False)
    if done.returncode != 0:
        return None
    newest: tuple[str, bool] | None = None
    # Each run's record comes before its steps: a run without a batch step resets it.
    for fields in (line.split(SEP) for line in done.stdout.splitlines()):
        if len(fields) != 3:
            continue
        if fields[0] == job_id:
            newest = None
        elif fields[0] == f"{job_id}.batch":
            newest = (fields[1], fields[2] not in ("", "Unknown", "None"))
    return newest


def duration_s(text: str) -> int | None:
    """Slurm's ``[D-][H:]M:SS`` (squeue %M, sacct Elapsed, scontrol RunTime) in seconds, or
    None for anything else (``INVALID``, empty)."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if match is None:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def format_duration(seconds: int) -> str:
    """``2:40``, ``1:02:03``, ``2-01:00:00``: Slurm's own way of writing a duration."""
    days, rest = divmod(max(0, int(seconds)), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{hours}:{minutes:02d}:{secs:02d}" if hours or days else f"{minutes}:{secs:02d}"
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}" if days else text


def _total_elapsed(records: Sequence[Mapping[str, str]], current: str) -> int | None:
    """Earlier runs' sacct Elapsed (every record but the newest, which is this run) plus this
    run's ``current`` elapsed; None when this run's is unreadable."""
    now = duration_s(current)
    if now is None:
        return None
    return sum(duration_s(r["Elapsed"]) or 0 for r in records[:-1]) + now


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


def job_log(job_id: str) -> Path | None:
    """Where the job's batch output goes, or None when Slurm knows nothing of the job.

    scontrol's StdOut while slurmctld holds the job; once it forgot it (MinJobAge), the
    accounting record: this sacct has no StdOut field (Slurm < 23.02), so the ``--output``
    of sbatch's command line (SubmitLine), else the raw template's own ``%x_%j.out``,
    relative to the job's WorkDir."""
    info = scontrol_job(job_id)
    if info.get("StdOut"):
        return Path(info["StdOut"])
    records = sacct_rows(job_id)
    if not records:
        return None
    last = records[-1]
    given = _submit_output(job_id)
    path = expand_output(given, job_id, last["JobName"]) if given else None
    if path is None:
        path = Path(f"{last['JobName']}_{job_id}.out")
    return path if path.is_absolute() else Path(last["WorkDir"] or ".") / path


def _submit_output(job_id: str) -> str | None:
    """The ``-o``/``--output`` value on the job's sbatch command line (sacct SubmitLine)."""
    done = run(["sacct", "-j", check_job_id(job_id), "-X", "-n", "-P", "-o", "SubmitLine"],
               check=False)
    lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
    try:
        words = shlex.split(lines[-1]) if lines else []
    except ValueError:
        return None
    for word, after in zip(words, [*words[1:], ""]):
        if word in ("-o", "--output"):
            return after or None
        if word.startswith("--output="):
            return word.split("=", 1)[1]
        if word.startswith("-o") and not word.startswith("--"):
            return word[2:]
    return None


def expand_output(pattern: str, job_id: str, name: str) -> Path | None:
    """sbatch's output file name pattern with ``%j %A %x %u %%`` filled in; None when it holds
    another replacement (``%N``, ``%t``, ...), which names a file only the job itself knew."""
    known = {"j": job_id, "A": job_id, "x": name, "u": current_user(), "%": "%"}
    parts = re.split(r"%(.)", pattern)
    if any(key not in known for key in parts[1::2]):
        return None
    return Path("".join(part if i % 2 == 0 else known[part] for i, part in enumerate(parts)))


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
