"""The hang watchdog: on the batch node, beside srun, it reads every rank's heartbeat
(:mod:`hpc_mca.runtime.heartbeat`: one file per node holding its ranks' beats, or one per rank)
and stops a job that no longer makes progress.

A job hangs when some rank has finished no optimizer step for longer than its allowance:

* the hang timeout (``training.hang_timeout``, never less than 3 times the slowest rank's
  median step time; automatic: the larger of 300 s and 10 times that median, kept below 0.8 x
  the collective timeout) in a step;
* the collective timeout (``ddp_timeout``) in the first step of a start, a save or an
  evaluation: their collectives may wait that long anyway, and a first step compiles;
* the hang timeout for a rank whose heartbeat stopped, whatever it was doing;
* for a rank still starting (phase ``start``: imports, config, process group, model, data,
  checkpoint load), 300 s or 3 times the previous start's measured start-up, the longer;
* 60 s after the step's first heartbeat for a rank of the step (``SLURM_NTASKS``) that never
  wrote one: it is named by the node Slurm's task layout gives it (:mod:`.tasks`).

A slow rank that still finishes its steps is never stopped: its steps are slow for everyone,
and the median step time it sets raises the automatic timeout.

Which rank stopped the job, in order of evidence:

1. ranks whose heartbeat went stale (no beat for 3 beat intervals, at least 10 s), and ranks
   that never beat: the whole process stopped (SIGSTOP, a dead device driver, a node that
   stopped answering) or never started;
   then ranks alive but still starting past their allowance;
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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hpc_mca.rundir import HANGS_FILE, HEARTBEAT_DIR, PROGRESS_FILE, RANKS_ENDED_FILE
from hpc_mca.runtime.heartbeat import START_INTERVAL_S
from hpc_mca.runtime.node_beats import NODE_PREFIX, RANK_PREFIX

from .exclusion import decide_for_job
from .tasks import UNKNOWN, TaskLayout

EXIT_HANG = 3
AUTO_FLOOR_S = 300.0
AUTO_FACTOR = 10.0
AUTO_CAP = 0.8
"""The automatic timeout stays below this share of the collective timeout."""
STALE_BEATS, STALE_FLOOR_S = 3, 10.0
STEP_FACTOR = 3.0
"""A configured hang timeout is raised to this many of the slowest rank's median step."""
START_FLOOR_S = 300.0
"""The least a rank may take to start: imports on a cold shared file system, the process group,
the model, data preparation and the checkpoint load."""
STARTUP_FACTOR = 3.0
"""A start may take this many times the previous start's measured start-up."""
ABSENT_AFTER_S = 60.0
"""A rank that wrote no heartbeat this long after another rank's first is absent: ``hpc-mca
train`` beats within seconds of its process start (before the heavy imports), and the ranks
of a script enter the training loop together (they build the model together)."""


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
        """The nodes to exclude: those of the named ranks (where Slurm's layout told)."""
        return list(dict.fromkeys(beat.node for beat, _ in self.named if beat.node != UNKNOWN))

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
    """The heartbeats present, one per rank, lowest rank first: the node files' and any rank's
    own file (a file being replaced or unreadable is skipped this time). A beat is never newer
    than the node file that carries it: a node whose writer stopped goes stale whole."""
    found: dict[int, Beat] = {}
    for path in heartbeat_files(directory):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if path.name.startswith(NODE_PREFIX):
                written = float(data["time"])
                beats = [_beat(entry, written) for entry in data["beats"]]
            else:
                beats = [_beat(data, None)]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for beat in beats:  # a rank in two files (a node-local directory made anew): the newer beat
            if beat.rank not in found or beat.time > found[beat.rank].time:
                found[beat.rank] = beat
    return [found[rank] for rank in sorted(found)]


def heartbeat_files(directory: Path) -> list[Path]:
    """The node files and rank files in the heartbeat directory (in no order: beats are
    ordered by rank)."""
    return [path for prefix in (NODE_PREFIX, RANK_PREFIX) for path in Path(directory).glob(f"{prefix}*.json")]


_FIELDS = tuple(f.name for f in dataclasses.fields(Beat))


def _beat(data: dict, written: float | None) -> Beat:
    fields = {name: data[name] for name in _FIELDS}
    if written is not None:
        fields["time"] = min(fields["time"], written)
    return Beat(**fields)


def timeout_s(beats: Sequence[Beat]) -> float | None:
    """The hang timeout in a step, or None when the watchdog is off (hang_timeout 0). Only a
    rank that has read the config knows it (its beat carries the collective timeout); before
    any has, the automatic floor."""
    if any(b.hang_timeout == 0 for b in beats):
        return None
    known = [b for b in beats if b.ddp_timeout]
    if not known:
        return AUTO_FLOOR_S
    beats = known
    configured = beats[0].hang_timeout
    medians = [b.median_step_s for b in beats if b.median_step_s is not None]
    if configured:  # never below what the run's own steps take (the config refuses less on resume)
        return max(float(configured), STEP_FACTOR * max(medians, default=0.0))
    auto = max(AUTO_FLOOR_S, AUTO_FACTOR * max(medians, default=0.0))
    ddp = [b.ddp_timeout for b in beats if b.ddp_timeout]
    return min(auto, AUTO_CAP * min(ddp)) if ddp else auto


@dataclasses.dataclass(frozen=True)
class Expected:
    """The ranks the job step started, for counting the absent (:func:`verdict`)."""

    ranks: int
    started: float
    """When the watchdog saw the step's first heartbeat (a ``train`` rank beats within seconds
    of its start; a script's ranks under ``hpc-mca run`` from the training loop on)."""
    node_of: Callable[[int], str]
    """The node a rank runs on (Slurm's task layout)."""
    startup_s: float | None = None
    """The previous start's measured start-up (progress.json), if any."""

    def start_allowance(self) -> float:
        """How long a rank may take to start (imports, process group, model, data, checkpoint
        load): the floor, or a multiple of the last measured start-up."""
        return max(START_FLOOR_S, STARTUP_FACTOR * (self.startup_s or 0.0))


def _allowance(beat: Beat, timeout: float, expected: Expected | None) -> float:
    if beat.phase == "step":
        return timeout
    if beat.phase == "start":
        return expected.start_allowance() if expected else max(START_FLOOR_S, timeout)
    return max(timeout, beat.ddp_timeout or 0.0)


def _absent(beats: Sequence[Beat], now: float, expected: Expected | None,
            seen: frozenset[int]) -> list[Beat]:
    """Ranks that never beat (in ``seen``) within :data:`ABSENT_AFTER_S` of the step's first
    beat: each as a beat of phase ``absent`` on its node."""
    if expected is None or not beats or now - expected.started <= ABSENT_AFTER_S:
        return []
    return [Beat(rank=r, node=expected.node_of(r), pid=0, time=expected.started, step=0,
                 step_time=expected.started, phase="absent", phase_time=expected.started,
                 median_step_s=None, hang_timeout=None, ddp_timeout=None, interval=START_INTERVAL_S)
            for r in range(expected.ranks) if r not in seen]


def verdict(beats: Sequence[Beat], now: float, expected: Expected | None = None,
            seen: frozenset[int] = frozenset()) -> Hang | None:
    """The hang in these heartbeats at ``now``, or None (pure: see the module docstring).
    ``expected``: the ranks the step started, ``seen``: the ranks that ever beat (a rank that
    ended removed its file, and is not absent)."""
    if not beats:
        return None
    timeout = timeout_s(beats)
    if timeout is None:
        return None
    absent = _absent(beats, now, expected, seen | {b.rank for b in beats})
    # A stale heartbeat is a stopped process whatever it was doing; otherwise a rank stalls
    # past its phase's allowance.
    over = [b for b in beats if now - b.progress_time > _allowance(b, timeout, expected)]
    frozen = [b for b in beats if now - b.time > max(timeout, b.stale_after)]
    stalled = [now - b.progress_time for b in {*over, *frozen}] + [now - b.time for b in absent]
    if not stalled:
        return None
    first = min(b.step for b in beats)
    frozen = [b for b in beats if now - b.time > b.stale_after]
    if frozen or absent:
        named = tuple((b, f"no heartbeat for {now - b.time:.0f} s: the process is stopped or "
                          f"its node stopped answering (phase {b.phase})") for b in frozen)
        named += tuple((b, f"never beat in {now - b.time:.0f} s since the first rank did: the "
                           "process is stopped or never started") for b in absent)
    elif any(b.phase == "start" for b in over):
        named = tuple((b, f"alive but still starting after {now - b.phase_time:.0f} s (imports, "
                          "process group, model, data or checkpoint load)")
                      for b in over if b.phase == "start")
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


def expected_ranks(run_dir: Path, started: float,
                   env: Mapping[str, str] = os.environ) -> Expected | None:
    """The ranks this job step starts (Slurm's task count and layout), or None outside a job."""
    count = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if not count or not count.isdigit():
        return None
    try:
        startup = json.loads((Path(run_dir) / PROGRESS_FILE).read_text()).get("startup_s")
    except (OSError, ValueError, AttributeError):
        startup = None
    layout = TaskLayout(env.get("SLURM_JOB_NODELIST", ""), env.get("SLURM_TASKS_PER_NODE", ""))
    return Expected(int(count), started, layout.node_of,
                    float(startup) if isinstance(startup, (int, float)) else None)


def watch(run_dir: Path, *, clock: Callable[[], float] = time.time,
          sleep: Callable[[float], None] = time.sleep,
          env: Mapping[str, str] = os.environ) -> int:
    """Watch until the ranks end (0), the watchdog is off (0) or a hang (:data:`EXIT_HANG`)."""
    directory = Path(run_dir) / HEARTBEAT_DIR
    ended = Path(run_dir) / RANKS_ENDED_FILE  # written by the batch shell once srun returned
    expected: Expected | None = None
    seen: set[int] = set()
    while True:
        if ended.exists():
            return 0
        beats = read_beats(directory)
        if beats and timeout_s(beats) is None:
            return 0
        if seen and not beats and not heartbeat_files(directory):
            return 0  # every rank ended and removed its heartbeat
        now = clock()
        if beats and not seen:  # the first beat: the others' allowance starts now
            expected = expected_ranks(run_dir, now, env)
        seen.update(b.rank for b in beats)
        hang = verdict(beats, now, expected, frozenset(seen))
        if hang is not None:
            for beat, why in hang.named:
                print(f"hpc-mca watchdog: rank {beat.rank} on {beat.node} (pid {beat.pid}): last "
                      f"step {beat.step}, phase {beat.phase}; {why}", file=sys.stderr, flush=True)
            record(run_dir, hang, now)
            return EXIT_HANG
        sleep(min((b.interval for b in beats), default=2.0))
