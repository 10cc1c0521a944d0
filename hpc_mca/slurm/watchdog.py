"""The hang watchdog: on the batch node, beside srun, it reads every rank's heartbeat
(:mod:`hpc_mca.runtime.heartbeat`) and stops a job that no longer makes progress.

A job hangs when some rank has finished no optimizer step for longer than its allowance:

* the hang timeout (``training.hang_timeout``; automatic: the larger of 300 s and 10 times
  the slowest rank's median step time, kept below 0.8 x the collective timeout) in a step;
* the collective timeout (``ddp_timeout``) in the first step of a start, a save or an
  evaluation: their collectives may wait that long anyway, and a first step compiles;
* the hang timeout for a rank whose heartbeat stopped, whatever it was doing.

A slow rank that still finishes its steps is never stopped: its steps are slow for everyone,
and the median step time it sets raises the automatic timeout.

Which rank stopped the job, in order of evidence:

1. ranks whose heartbeat went stale (no beat for 3 beat intervals, at least 10 s): the whole
   process stopped (SIGSTOP, a dead device driver, a node that stopped answering);
2. otherwise ranks whose last finished step is behind the others': every process is alive,
   and these are stuck inside a step the others finished (blocked in a collective the others
   never entered);
3. otherwise none: every rank is alive at the same step; the job is requeued without
   excluding a node, and the log says why.

On a hang the watchdog appends a record to ``hangs.jsonl``, leaves the batch shell its
verdict through :func:`hpc_mca.slurm.exclusion.decide_for_job` (the named nodes, within the
run's budget) and exits 3; the shell kills the ranks (SIGKILL reaches a stopped process) and
requeues the job. Nothing is saved first: a checkpoint is a collective of every rank, which a
frozen or blocked rank cannot join; the run resumes from its last checkpoint, exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from hpc_mca.rundir import HANGS_FILE, HEARTBEAT_DIR, RANKS_ENDED_FILE

from .exclusion import decide_for_job

EXIT_HANG = 3
AUTO_FLOOR_S = 300.0
AUTO_FACTOR = 10.0
AUTO_CAP = 0.8
"""The automatic timeout stays below this share of the collective timeout."""
STALE_BEATS, STALE_FLOOR_S = 3, 10.0


@dataclasses.dataclass(frozen=True)
class Beat:
    """One rank's heartbeat file (fields: :mod:`hpc_mca.runtime.heartbeat`)."""

    rank: int
    node: str
    pid: int
    time: float
    step: int
    step_time: float
    phase: str
    phase_time: float
    median_step_s: float | None
    hang_timeout: float | None
    ddp_timeout: float | None
    interval: float

    @property
    def progress_time(self) -> float:
        """The last sign of progress: a finished step, or the start of a save or evaluation."""
        return max(self.step_time, self.phase_time)

    @property
    def stale_after(self) -> float:
        return max(STALE_BEATS * self.interval, STALE_FLOOR_S)


@dataclasses.dataclass(frozen=True)
class Hang:
    stalled_s: float
    """How long the most stalled rank has made no progress."""
    timeout_s: float
    named: tuple[tuple[Beat, str], ...]
    """The ranks blamed, each with why."""
    step: int
    """The last step every rank finished."""

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(beat.node for beat, _ in self.named))

    def line(self) -> str:
        """The requeue banner's reason."""
        head = (f"hang: no progress for {self.stalled_s:.0f} s after step {self.step} "
                f"(hang timeout {self.timeout_s:.0f} s)")
        if not self.named:
            return (f"{head}; every rank is alive at the same step, so no node is to blame")
        ranks = ", ".join(f"rank {beat.rank} on {beat.node}" for beat, _ in self.named[:8])
        more = f" and {len(self.named) - 8} more" if len(self.named) > 8 else ""
        return f"{head}: {ranks}{more} ({self.named[0][1]})"


def read_beats(directory: Path) -> list[Beat]:
    """The heartbeats present (a file being replaced or unreadable is skipped this time)."""
    beats = []
    for path in sorted(Path(directory).glob("rank-*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            beats.append(Beat(**{f.name: data[f.name] for f in dataclasses.fields(Beat)}))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return beats


def timeout_s(beats: Sequence[Beat]) -> float | None:
    """The hang timeout in a step, or None when the watchdog is off (hang_timeout 0)."""
    configured = beats[0].hang_timeout
    if configured == 0:
        return None
    if configured:
        return float(configured)
    medians = [b.median_step_s for b in beats if b.median_step_s is not None]
    auto = max(AUTO_FLOOR_S, AUTO_FACTOR * max(medians, default=0.0))
    ddp = [b.ddp_timeout for b in beats if b.ddp_timeout]
    return min(auto, AUTO_CAP * min(ddp)) if ddp else auto


def _allowance(beat: Beat, timeout: float) -> float:
    if beat.phase == "step":
        return timeout
    return max(timeout, beat.ddp_timeout or 0.0)


def verdict(beats: Sequence[Beat], now: float) -> Hang | None:
    """The hang in these heartbeats at ``now``, or None (pure: see the module docstring)."""
    if not beats:
        return None
    timeout = timeout_s(beats)
    if timeout is None:
        return None
    # A stale heartbeat is a stopped process whatever it was doing; otherwise a rank stalls
    # past its phase's allowance.
    stalled = [now - b.progress_time for b in beats
               if now - b.progress_time > _allowance(b, timeout) or now - b.time > timeout]
    if not stalled:
        return None
    first = min(b.step for b in beats)
    frozen = [b for b in beats if now - b.time > b.stale_after]
    if frozen:
        named = tuple((b, f"no heartbeat for {now - b.time:.0f} s: the process is stopped or "
                          "its node stopped answering") for b in frozen)
    else:
        top = max(b.step for b in beats)
        named = tuple((b, f"alive but stuck in step {b.step + 1}, which the others finished")
                      for b in beats if b.step < top)
    return Hang(stalled_s=max(stalled), timeout_s=timeout, named=named, step=first)


def record(run_dir: Path, hang: Hang, now: float) -> str:
    """The hang's record in hangs.jsonl and the batch shell's verdict; returns its line."""
    env = os.environ
    line = hang.line()
    exclusion = decide_for_job(run_dir, hang.nodes, line)
    entry = {"time": round(now, 3), "job": env.get("SLURM_JOB_ID", ""),
             "restart": int(env.get("SLURM_RESTART_COUNT", "0") or 0), "step": hang.step,
             "stalled_s": round(hang.stalled_s, 1), "timeout_s": hang.timeout_s,
             "ranks": [{"rank": b.rank, "node": b.node, "why": why} for b, why in hang.named],
             "excluded": list(exclusion.added), "over_budget": list(exclusion.over_budget),
             "end": exclusion.end}
    with open(Path(run_dir) / HANGS_FILE, "a", encoding="utf-8") as out:
        out.write(json.dumps(entry) + "\n")
    return line


def watch(run_dir: Path, *, clock: Callable[[], float] = time.time,
          sleep: Callable[[float], None] = time.sleep) -> int:
    """Watch until the ranks end (0), the watchdog is off (0) or a hang (:data:`EXIT_HANG`)."""
    directory = Path(run_dir) / HEARTBEAT_DIR
    ended = Path(run_dir) / RANKS_ENDED_FILE  # written by the batch shell once srun returned
    seen = False
    while True:
        if ended.exists():
            return 0
        beats = read_beats(directory)
        if beats and timeout_s(beats) is None:
            return 0
        if seen and not beats and not any(directory.glob("rank-*.json")):
            return 0  # every rank ended and removed its heartbeat
        seen = seen or bool(beats)
        now = clock()
        hang = verdict(beats, now)
        if hang is not None:
            for beat, why in hang.named:
                print(f"hpc-mca watchdog: rank {beat.rank} on {beat.node} (pid {beat.pid}): last "
                      f"step {beat.step}, phase {beat.phase}; {why}", file=sys.stderr, flush=True)
            record(run_dir, hang, now)
            return EXIT_HANG
        sleep(min((b.interval for b in beats), default=2.0))
