"""A rank's heartbeat: what the batch node's hang watchdog (:mod:`hpc_mca.slurm.watchdog`)
reads to tell a job that makes progress from one that stopped, and which rank stopped it.

Why files in the run directory, written by a thread of every rank: the watchdog must see a
rank that cannot speak for itself. A rank frozen by SIGSTOP, a dead GPU driver or a node
that stopped answering stops all its threads, so its file stops changing (a *stale*
heartbeat); a rank blocked inside a collective still has a live thread, so its file keeps
changing but its last finished step falls behind the others'. The rendezvous store was the
other candidate, but it lives in rank 0's process and dies with it; and the batch shell's
own node could not see the other nodes' processes. One small file per rank, rewritten every
``interval`` seconds (a tenth of the hang timeout, 1-30 s), bounds the metadata load.

Each file (``<run dir>/heartbeat/rank-<5 digits>.json``) holds: ``rank``, ``node``, ``pid``,
``time`` (this beat), ``step`` (the last finished optimizer step) and ``step_time`` (when it
finished; the start of training before the first), ``phase`` (``first``: the first step of
this process is under way; ``step``; ``save``; ``eval``) and ``phase_time`` (when it began),
``median_step_s`` (of this process's steps so far), ``hang_timeout`` (the config's: null =
automatic, 0 = no watchdog), ``ddp_timeout`` (the collective timeout the process group runs
with) and ``interval``.

Written only when the batch script asks for it (``HPC_MCA_HEARTBEAT_DIR``): a torchrun or
single-process run writes nothing.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hpc_mca.rundir import HEARTBEAT_ENV, write_atomic

MIN_INTERVAL_S, MAX_INTERVAL_S = 1.0, 30.0
AUTO_INTERVAL_S = 30.0
"""The beat interval with an automatic hang timeout (at least 300 s: a tenth of it)."""


def beat_interval(hang_timeout: int | None) -> float:
    """Seconds between beats: a tenth of the hang timeout, within 1-30 s."""
    if not hang_timeout:
        return AUTO_INTERVAL_S
    return min(max(hang_timeout / 10, MIN_INTERVAL_S), MAX_INTERVAL_S)


def heartbeat_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank:05d}.json"


class Heartbeat:
    """This rank's heartbeat thread and the loop's marks (see the module docstring)."""

    def __init__(self, directory: Path, rank: int, *, hang_timeout: int | None,
                 ddp_timeout: float | None) -> None:
        self.path = heartbeat_file(directory, rank)
        self.interval = beat_interval(hang_timeout)
        now = time.time()
        self._state = {"rank": rank, "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
                       "pid": os.getpid(), "time": now, "step": 0, "step_time": now,
                       "phase": "first", "phase_time": now, "median_step_s": None,
                       "hang_timeout": hang_timeout, "ddp_timeout": ddp_timeout,
                       "interval": self.interval}
        self._seconds: deque[float] = deque(maxlen=50)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, rank: int, *, hang_timeout: int | None,
                 ddp_timeout: float | None) -> Heartbeat | None:
        """The heartbeat the batch script asked for, or None (no watchdog: outside a batch
        script, or ``hang_timeout`` 0)."""
        directory = os.environ.get(HEARTBEAT_ENV)
        if not directory:
            return None
        Path(directory).mkdir(parents=True, exist_ok=True)
        beat = cls(Path(directory), rank, hang_timeout=hang_timeout, ddp_timeout=ddp_timeout)
        if hang_timeout == 0:  # one beat says so, and the watchdog stops watching
            beat._write()
            return None
        return beat

    def start(self, step: int) -> None:
        """Training starts at ``step`` (the checkpoint's): the first step's allowance begins."""
        now = time.time()
        with self._lock:
            self._state.update(step=step, step_time=now, phase="first", phase_time=now)
        self._write()
        self._thread = threading.Thread(target=self._run, name="hpc-mca-heartbeat", daemon=True)
        self._thread.start()

    def step_done(self, step: int, seconds: float) -> None:
        """An optimizer step finished on this rank (before the step's collectives of the
        boundary: a rank that blocks in them is the one whose step falls behind)."""
        now = time.time()
        with self._lock:
            self._seconds.append(seconds)
            self._state.update(step=step, step_time=now, phase="step", phase_time=now,
                               median_step_s=round(statistics.median(self._seconds), 6))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A save or an evaluation: the watchdog gives it the collective timeout's allowance."""
        with self._lock:
            self._state.update(phase=name, phase_time=time.time())
        self._write()
        try:
            yield
        finally:
            with self._lock:
                self._state.update(phase="step", phase_time=time.time())

    def close(self) -> None:
        """Training is over on this rank (finished, stopped or failed): the file goes, so a
        rank that ends normally is never taken for a frozen one."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._write()

    def _write(self) -> None:
        with self._lock:
            self._state["time"] = time.time()
            text = json.dumps(self._state)
        try:
            write_atomic(self.path, text)
        except OSError:  # a full or flaky file system must not stop training
            pass
