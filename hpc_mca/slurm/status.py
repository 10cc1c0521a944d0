"""``hpc-mca status``: Slurm's view of a job joined with the progress its run dir reports."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_mca.rundir import HANGS_FILE, REQUEUES_FILE, read_bad_input
from hpc_mca.runtime.preflight_records import read_state

from . import commands
from .commands import JobState
from .errors import OpsError
from .exclusion import read_excluded
from .manifest import Run, current_job_id, find_run, iter_manifests, run_from_manifest
from .progress import Progress, read_progress


@dataclass(frozen=True)
class Note:
    """Why a job is where it is, as status and watch both say it."""

    label: str
    """status's name for the line: ``pending`` (why it went back to the queue) or
    ``preflight`` (its nodes are being checked)."""
    text: str


@dataclass(frozen=True)
class RunStatus:
    job_id: str | None
    job: JobState | None
    """None when Slurm no longer (or not yet) knows the job."""
    run: Run | None
    progress: Progress | None
    current_job_id: str | None = None
    """The run's newest job when it is not ``job_id`` (a continuation from hpc-mca resume)."""
    current_job: JobState | None = None
    bad_input: str | None = None
    """Why a rank stopped on bad input (the run directory's record), if one did."""
    total_elapsed_s: int | None = None
    """Run time of every run of the run: each job's requeues and the continuations (None
    where Slurm's records do not cover them all)."""
    runs: int | None = None
    """How many runs that total covers (restarts + 1)."""
    hangs: tuple[dict, ...] = ()
    """The hang watchdog's records (hangs.jsonl), oldest first."""
    excluded: tuple[dict, ...] = ()
    """The nodes the run excluded from its next starts, with why (excluded_nodes.json)."""
    note: Note | None = None
    """Why the job is where it is (:func:`job_note`): watch shows the same text."""

    @property
    def state(self) -> str:
        if self.job is not None:
            return self.job.state
        return "FINISHED?" if self.progress and self.progress.finished else "UNKNOWN"

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id, "state": self.state,
            "job": dataclasses.asdict(self.job) if self.job else None,
            "run_dir": str(self.run.run_dir) if self.run else None,
            "log": str(self.run.log) if self.run and self.run.log else None,
            "progress": dataclasses.asdict(self.progress) if self.progress else None,
            "current_job_id": self.current_job_id,
            "current_state": self.current_job.state if self.current_job else None,
            "bad_input": self.bad_input,
            "total_elapsed_s": self.total_elapsed_s, "runs": self.runs,
            "hangs": list(self.hangs), "excluded_nodes": list(self.excluded),
            "note": self.note.text if self.note else None,
        }


def job_status(job_id: str, runs_root: Path) -> RunStatus:
    """Status of one job (its run found by manifest, else from Slurm's record)."""
    job_id = commands.check_job_id(job_id)
    job = commands.job_state(job_id)
    try:
        run = find_run(job_id, runs_root)
    except OpsError:
        if job is None:
            raise OpsError(f"job {job_id} is unknown to Slurm (squeue, sacct) and no run "
                           f"manifest under {runs_root} names it") from None
        run = None
    progress = read_progress(run.run_dir) if run is not None else None
    bad = read_bad_input(run.run_dir) if run is not None else None
    current = current_job_id(run.manifest) if run is not None and run.manifest else None
    total, runs = run_totals(job_id, job, run)
    hangs = tuple(read_hangs(run.run_dir)) if run else ()
    excluded = tuple(read_excluded(run.run_dir)) if run else ()
    note = job_note(run.run_dir, job_id, job, progress) if run else None
    if current is None or current == job_id:
        return RunStatus(job_id, job, run, progress, bad_input=bad, total_elapsed_s=total, runs=runs,
                         hangs=hangs, excluded=excluded, note=note)
    return RunStatus(job_id, job, run, progress, current, commands.job_state(current), bad,
                     total, runs, hangs=hangs, excluded=excluded, note=note)


PENDING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})


def read_requeues(run_dir: Path) -> list[dict[str, str]]:
    """The batch shell's requeue records (``time= job= restart= why=`` lines), oldest first."""
    try:
        lines = (Path(run_dir) / REQUEUES_FILE).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    records = []
    for line in lines:
        head, sep, why = line.partition(" why=")
        fields = dict(part.split("=", 1) for part in head.split() if "=" in part)
        if sep and {"time", "job", "restart"} <= fields.keys():
            records.append({**fields, "why": why})
    return records


def job_note(run_dir: Path, job_id: str, job: JobState | None,
             progress: Progress | None) -> Note | None:
    """Pending after a requeue: the newest requeue of this job and why (a hang and its node,
    a failed preflight and its nodes, a time limit, an outside requeue...). Running its
    preflight: the batch node's line on it (whom it waits for, then the verdict), until
    training has made progress since."""
    if job is None:
        return None
    if job.state in PENDING_STATES:
        mine = [r for r in read_requeues(run_dir) if r["job"] == job_id]
        if not mine:
            return None
        last = mine[-1]
        try:
            when = time.strftime("%H:%M:%S", time.localtime(float(last["time"])))
        except (ValueError, OverflowError):
            when = "?"
        return Note("pending", f"requeued at {when} (restart {last['restart']}): {last['why']}")
    state = read_state(run_dir)
    if job.state != "RUNNING" or state is None or state.get("job") != job_id:
        return None
    trained_since = progress is not None and (progress.updated or 0) >= state["time"]
    return None if state.get("passed") and trained_since else Note("preflight", state["line"])


def read_hangs(run_dir: Path) -> tuple[dict, ...]:
    """The watchdog's records of the run (hangs.jsonl; a torn last line is skipped)."""
    try:
        lines = (Path(run_dir) / HANGS_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return ()
    hangs = []
    for line in lines:
        try:
            hangs.append(json.loads(line))
        except ValueError:
            continue
    return tuple(h for h in hangs if isinstance(h, dict))


def run_totals(job_id: str, job: JobState | None, run: Run | None) -> tuple[int | None, int | None]:
    """Run time and number of runs over every job of the run (the first and each
    continuation, each with its requeues), or (None, None) when one of them is unknown."""
    manifest = run.manifest if run is not None and run.manifest else {}
    ids = [str(i) for i in [manifest.get("job_id"), *(manifest.get("job_ids") or [])] if i]
    total, runs = 0, 0
    for other in dict.fromkeys(ids or [job_id]):
        state = job if other == job_id else commands.job_state(other)
        if state is None or state.total_elapsed_s is None:
            return None, None
        total, runs = total + state.total_elapsed_s, runs + state.runs
    return total, runs


def recent_statuses(runs_root: Path, limit: int = 10) -> list[RunStatus]:
    """The newest ``limit`` runs under ``runs_root`` (by submit time), with their jobs."""
    found = []
    for run_dir, manifest in iter_manifests(runs_root):
        found.append((str(manifest.get("submit_time", "")), run_dir, manifest))
    found.sort(key=lambda item: item[0], reverse=True)
    out = []
    for _, run_dir, manifest in found[:limit]:
        # One row per run, showing its newest job (a continuation, when there is one).
        run = run_from_manifest(run_dir, manifest, current_job_id(manifest))
        job = commands.job_state(run.job_id) if run.job_id else None
        out.append(RunStatus(run.job_id, job, run, read_progress(run_dir),
                             bad_input=read_bad_input(run_dir)))
    return out


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _ago(stamp: float | None, now: float) -> str:
    return "?" if stamp is None else f"{_duration(now - stamp)} ago"


def progress_fields(progress: Progress | None) -> list[str]:
    """``loss 1.2345``, ``eval loss ...``, ``tokens/s 12,345``, ``ETA 3m10s`` (what is known)."""
    if progress is None:
        return []
    parts = []
    if progress.loss is not None:
        parts.append(f"loss {progress.loss:.4f}")
    if progress.eval_loss is not None:
        parts.append(f"eval loss {progress.eval_loss:.4f}")
    if progress.tokens_per_s is not None:
        parts.append(f"tokens/s {progress.tokens_per_s:,.0f}")
    if progress.finished:
        parts.append("finished")
    elif progress.eta_s is not None:
        parts.append(f"ETA {_duration(progress.eta_s)}")
    return parts


def progress_text(progress: Progress | None, now: float | None = None) -> str:
    """``step 40/200 (20%) | loss 1.2345 | tokens/s 12,345 | ETA 3m10s | updated 5s ago``."""
    if progress is None:
        return "no progress reported yet"
    now = time.time() if now is None else now
    parts = []
    if progress.step is not None:
        total = f"/{progress.max_steps}" if progress.max_steps else ""
        pct = f" ({progress.fraction:.0%})" if progress.fraction is not None else ""
        parts.append(f"step {progress.step}{total}{pct}")
    parts += progress_fields(progress)
    parts.append(f"updated {_ago(progress.updated, now)}")
    return " | ".join(parts)


def checkpoint_text(progress: Progress | None, now: float | None = None) -> str:
    ckpt = progress.last_checkpoint if progress else None
    if ckpt is None:
        return "none reported"
    now = time.time() if now is None else now
    step = f"step {ckpt.step}" if ckpt.step is not None else "step ?"
    return f"{step}: {ckpt.path or '?'} ({_ago(ckpt.time, now)})"


def format_status(status: RunStatus, now: float | None = None) -> str:
    """The detailed, multi-line view of one job."""
    job = status.job
    if job is not None:
        reason = f" ({job.reason})" if job.reason else ""
        exit_code = f" exit {job.exit_code}" if job.finished and job.exit_code else ""
        head = (f"job {status.job_id}  {job.name}  {job.state}{reason}{exit_code}  "
                f"elapsed {job.elapsed} of {job.time_limit}{_all_runs(status)}  nodes {job.nodes}"
                f"{' (' + job.node_list + ')' if job.node_list and job.node_list != 'None assigned' else ''}"
                f"  requeues {job.requeues}")
    else:
        head = f"job {status.job_id}  {status.state} (Slurm has no record of it)"
    lines = [head]
    if status.note is not None:
        lines.append(f"  {status.note.label:<11} {status.note.text}")
    if status.current_job_id is not None:
        current = status.current_job.state if status.current_job else "unknown to Slurm"
        lines.append(f"  continued   by job {status.current_job_id} ({current}): hpc-mca status "
                     f"{status.current_job_id}")
    if status.bad_input is not None:
        lines.append(f"  bad input   {status.bad_input} (not requeued)")
    lines += fault_lines(status)
    if status.run is not None:
        lines.append(f"  run dir     {status.run.run_dir}")
    lines.append(f"  progress    {progress_text(status.progress, now)}")
    lines.append(f"  checkpoint  {checkpoint_text(status.progress, now)}")
    if status.run is not None and status.run.log is not None:
        lines.append(f"  log         {status.run.log}")
    return "\n".join(lines)


def fault_lines(status: RunStatus) -> list[str]:
    """The hangs the watchdog stopped (the last three) and the nodes the run excluded."""
    lines = []
    for hang in status.hangs[-3:]:
        ranks = ", ".join(f"rank {r.get('rank')} on {r.get('node')}" for r in hang.get("ranks", [])[:4])
        after = (f"excluded {','.join(hang['excluded'])}" if hang.get("excluded")
                 else hang.get("end") or "no node excluded")
        lines.append(f"  hang        restart {hang.get('restart', '?')}, after step {hang.get('step', '?')}: "
                     f"no progress for {hang.get('stalled_s', '?')} s, {ranks or 'no rank to blame'}; {after}")
    if len(status.hangs) > 3:
        lines.append(f"  hangs       {len(status.hangs)} in all (hangs.jsonl)")
    if status.excluded:
        nodes = ", ".join(f"{r['node']} (restart {r.get('restart', '?')}: "
                          f"{str(r.get('reason', '')).split(':')[0] or '?'})" for r in status.excluded)
        lines.append(f"  excluded    {nodes}")
    return lines


def _all_runs(status: RunStatus) -> str:
    """`` (all 4 runs: 2:40, 3 restarts)``: "elapsed" is the last run's only."""
    if status.total_elapsed_s is None or not status.runs or status.runs < 2:
        return ""
    return (f" (all {status.runs} runs: {commands.format_duration(status.total_elapsed_s)}, "
            f"{status.runs - 1} restart{'s' if status.runs > 2 else ''})")


def format_table(statuses: list[RunStatus], now: float | None = None) -> str:
    """One line per run, newest first."""
    if not statuses:
        return "no runs"
    rows = [("JOBID", "STATE", "STEP", "LOSS", "ETA", "RUN DIR")]
    for st in statuses:
        p = st.progress
        step = "-" if p is None or p.step is None else (
            f"{p.step}/{p.max_steps}" if p.max_steps else str(p.step))
        loss = "-" if p is None or p.loss is None else f"{p.loss:.4f}"
        eta = "-" if p is None or p.eta_s is None else _duration(p.eta_s)
        state = f"{st.state} (bad input)" if st.bad_input else st.state
        rows.append((st.job_id or "?", state, step, loss, eta,
                     str(st.run.run_dir) if st.run else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[5]
                     for row in rows)
