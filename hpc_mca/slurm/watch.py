"""``hpc-mca watch`` / ``submit --wait``: follow a job until it ends, with a live progress bar.

Each poll joins Slurm's view of the job (:func:`hpc_mca.slurm.commands.job_state`: state,
squeue's pending reason, requeues) with the run's ``progress.json`` (step/total, loss,
tokens/s, ETA, eval loss) and what ``hpc-mca status`` says of why the job is where it is
(:func:`hpc_mca.slurm.status.job_note`: why a pending job was requeued, whom a running
preflight waits for). On a terminal the view is one tqdm bar redrawn in place; on
anything else (a pipe, a log file, CI) it is one plain line per change, so a log holds no
carriage returns and no line repeats while nothing moves.

The watcher's exit status says how the job ended (:data:`EXIT_STATUS`), so
``hpc-mca submit --wait ... && next-step`` chains on success only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from hpc_mca.rundir import read_bad_input

from . import commands
from .commands import TERMINAL_STATES, JobState
from .errors import OpsError
from .manifest import find_run
from .progress import Progress, read_progress
from .status import job_note, progress_fields

if TYPE_CHECKING:
    from tqdm import tqdm

EXIT_STATUS: dict[str, int] = {
    "COMPLETED": 0,
    "FAILED": 3, "CANCELLED": 4, "TIMEOUT": 5, "DEADLINE": 5, "OUT_OF_MEMORY": 6,
    "NODE_FAIL": 7, "BOOT_FAIL": 7, "PREEMPTED": 7,
}
"""Exit status of ``watch``/``submit --wait`` per final job state. 1 is left to Click's own
errors (an unknown job, Slurm not answering) and 2 to usage errors; 130 is Ctrl-C (the job
keeps running)."""
assert set(EXIT_STATUS) == TERMINAL_STATES, "every terminal state needs an exit status"

UNKNOWN_GRACE_POLLS = 5
"""Polls a job may be unknown to Slurm before watch gives up (sacct lags squeue briefly)."""


@dataclass(frozen=True)
class Snapshot:
    """One poll: the job as Slurm sees it and the run's progress (None where unknown)."""

    job_id: str
    job: JobState | None
    progress: Progress | None
    bad_input: str | None = None
    note: str | None = None
    """Why the job is where it is: the text ``hpc-mca status`` shows (why a pending job was
    requeued, whom a running preflight waits for)."""

    @property
    def finished(self) -> bool:
        return self.job is not None and self.job.finished

    @property
    def requeues(self) -> int:
        # Slurm's count survives the run dir; the trainer's restart_count covers a job whose
        # REQUEUED records sacct does not keep (accounting off).
        restarts = self.progress.restart_count if self.progress else None
        return max(self.job.requeues if self.job else 0, restarts or 0)

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.job.state, 1) if self.job else 1


class JobSource:
    """Polls Slurm and the job's run directory (found once it exists)."""

    def __init__(self, job_id: str, runs_root: Path, run_dir: Path | None = None) -> None:
        self.job_id = commands.check_job_id(job_id)
        self.runs_root = runs_root
        self.run_dir = run_dir
        self.misses = 0

    def poll(self) -> Snapshot:
        job = commands.job_state(self.job_id)
        if job is None:
            self.misses += 1
            if self.misses >= UNKNOWN_GRACE_POLLS:
                raise OpsError(f"job {self.job_id} is unknown to Slurm (squeue, scontrol, "
                               "sacct); valid: a job id that squeue or sacct lists")
        if self.run_dir is None:
            try:
                self.run_dir = find_run(self.job_id, self.runs_root).run_dir
            except OpsError:
                pass  # a raw sbatch job before Slurm reports its work dir: try next poll
        if self.run_dir is None:
            return Snapshot(self.job_id, job, None)
        progress = read_progress(self.run_dir)
        note = job_note(self.run_dir, self.job_id, job, progress)
        return Snapshot(self.job_id, job, progress, read_bad_input(self.run_dir),
                        note.text if note else None)


def step_text(progress: Progress | None) -> str | None:
    if progress is None or progress.step is None:
        return None
    total = f"/{progress.max_steps}" if progress.max_steps else ""
    pct = f" ({progress.fraction:.0%})" if progress.fraction is not None else ""
    return f"step {progress.step}{total}{pct}"


def state_text(snap: Snapshot) -> str:
    """``job 12 PENDING (Priority)``, ``job 12 RUNNING``, ``job 12 FAILED exit 2:0``."""
    job = snap.job
    if job is None:
        return f"job {snap.job_id} (not known to Slurm yet)"
    text = f"job {snap.job_id} {job.state}"
    if job.reason:
        text += f" ({job.reason})"
    if job.finished and job.exit_code:
        text += f" exit {job.exit_code}"
    return text


def status_line(snap: Snapshot) -> str:
    """The whole snapshot in one line (the non-terminal view and the final line)."""
    parts = [state_text(snap)]
    step = step_text(snap.progress)
    parts += [step] if step else []
    parts += progress_fields(snap.progress)
    parts.append(f"requeues {snap.requeues}")
    if snap.bad_input:
        parts.append(f"bad input: {snap.bad_input}")
    if snap.note:
        parts.append(snap.note)
    return " | ".join(parts)


class LineView:
    """One plain line per change (stdout is not a terminal)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.last: str | None = None

    def update(self, snap: Snapshot) -> None:
        line = status_line(snap)
        if line != self.last:
            print(line, file=self.out, flush=True)
            self.last = line

    def close(self, snap: Snapshot) -> None:
        self.update(snap)


class BarView:
    """A tqdm bar redrawn in place: ``job 12 RUNNING  40%|████      | step 4/10 | loss ...``."""

    BAR = "{{desc}} {{percentage:3.0f}}%|{{bar}}| step {{n}}/{{total}} | {fields}"
    NO_BAR = "{{desc}} | {fields}"

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.bar: tqdm | None = None  # made at the first update: nothing drawn before a state
        self.last: str | None = None

    def update(self, snap: Snapshot) -> None:
        # Redraw only on a change: an idle watch over ssh sends nothing.
        if status_line(snap) == self.last:
            return
        self.last = status_line(snap)
        if self.bar is None:
            from tqdm import tqdm  # imported here: only a terminal view needs it

            self.bar = tqdm(total=None, file=self.out, bar_format="{desc}", dynamic_ncols=True,
                            leave=True, mininterval=0, delay=0)
        bar = self.bar
        progress = snap.progress
        step = progress.step if progress else None
        total = progress.max_steps if progress else None
        # tqdm's own rate, ETA and postfix would describe this poller, not the trainer: the
        # format carries the trainer's numbers (braces escaped for str.format).
        fields = " | ".join(progress_fields(progress) + [f"requeues {snap.requeues}"]
                            + ([snap.note] if snap.note else []))
        fields = fields.replace("{", "{{").replace("}", "}}")
        if step is not None and total:
            bar.total, bar.n = total, min(step, total)
            bar.bar_format = self.BAR.format(fields=fields)
        else:
            bar.bar_format = self.NO_BAR.format(fields=fields)
        bar.set_description_str(state_text(snap), refresh=False)
        bar.refresh()

    def close(self, snap: Snapshot) -> None:
        self.update(snap)
        if self.bar is not None:
            self.bar.close()
        print(status_line(snap), file=self.out, flush=True)


def follow(poll: Callable[[], Snapshot], view: LineView | BarView, interval: float,
           sleep: Callable[[float], None] = time.sleep) -> Snapshot:
    """Poll until the job is in a terminal state; every snapshot goes to ``view``. Returns the
    last snapshot (its ``exit_status`` is the watcher's)."""
    while True:
        snap = poll()
        if snap.finished:
            view.close(snap)
            return snap
        view.update(snap)
        sleep(interval)


def watch(job_id: str, runs_root: Path, out: TextIO, *, interval: float = 2.0,
          tty: bool | None = None, run_dir: Path | None = None) -> Snapshot:
    """Follow job ``job_id`` until it ends, drawing on ``out`` (a bar when ``tty``; default:
    when ``out`` is a terminal)."""
    if interval <= 0:
        raise OpsError(f"poll interval {interval} is not positive; valid: seconds > 0, e.g. 2")
    tty = out.isatty() if tty is None else tty
    source = JobSource(job_id, runs_root, run_dir)
    return follow(source.poll, BarView(out) if tty else LineView(out), interval)
