"""A rank's heartbeat: what the batch node's hang watchdog (:mod:`hpc_mca.slurm.watchdog`)
reads to tell a job that makes progress from one that stopped, and which rank stopped it.

Why files in the run directory, written by a thread of every rank: the watchdog must see a
rank that cannot speak for itself. A rank frozen by SIGSTOP, a dead GPU driver or a node
that stopped answering stops all its threads, so its beat stops changing (a *stale*
heartbeat); a rank blocked inside a collective still has a live thread, so its beat keeps
changing but its last finished step falls behind the others'. The rendezvous store was the
other candidate, but it lives in rank 0's process and dies with it; and the batch shell's
own node could not see the other nodes' processes.

Why one file per node: a rank rewrites its beat every ``interval`` seconds (a tenth of the hang
timeout, 1-30 s), and at 8,192 ranks one file per rank is 8,192 creates and renames per
interval on the shared file system, and 8,192 files for the watchdog to read. So a rank
writes its beat into a directory on its own node, twice an interval (memory, not the shared
file system), and one rank of each node copies its node's beats into one shared file every
interval (:mod:`hpc_mca.runtime.node_beats`): 8 times fewer shared operations at 8 ranks a
node (``benchmarks/heartbeat_scale.py``). A frozen rank's beat is copied as it stands and
goes stale; a frozen copier's node file goes stale whole, and the watchdog names every rank
of that node. A beat the watchdog reads is at most about 1.5 intervals old (half an interval
locally, one in the node file), below the 3 that make it stale. Where no node-local directory
is usable every rank writes its own ``rank-<5 digits>.json`` to the shared directory, as
before.

Each beat (a ``beats`` entry of ``<run dir>/heartbeat/node-<node>.<id>.json``, or a
``rank-<5 digits>.json`` file) holds: ``rank``, ``node``, ``pid``,
``time`` (this beat), ``step`` (the last finished optimizer step) and ``step_time`` (when it
finished; the start of training before the first), ``phase`` (``first``: the first step of
this process is under way; ``step``; ``save``; ``eval``) and ``phase_time`` (when it began),
``median_step_s`` (of this process's steps so far), ``hang_timeout`` (the config's: null =
automatic, 0 = no watchdog), ``ddp_timeout`` (the collective timeout the process group runs
with) and ``interval``. A node file also holds ``node``, ``time`` (when it was written: the
watchdog takes no beat in it as newer) and ``writer`` (the copying rank).

Written only when the batch script asks for it (``HPC_MCA_HEARTBEAT_DIR``): a torchrun or
single-process run writes nothing.

A rank beats from the start of its process (:func:`begin`, the first thing ``hpc-mca train``
does), every :data:`START_INTERVAL_S` seconds, with ``phase`` ``start`` (imports, config,
process group, model, data, checkpoint load) until training begins: a rank frozen while it
starts goes stale like one frozen mid-run, and the watchdog counts the ranks it expects, so one
that never beat at all is named too (:mod:`hpc_mca.slurm.watchdog`).
"""

from __future__ import annotations

import atexit
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

from .node_beats import local_directory, local_ranks, rank_file, roll_up

MIN_INTERVAL_S, MAX_INTERVAL_S = 1.0, 30.0
AUTO_INTERVAL_S = 30.0
"""The beat interval with an automatic hang timeout (at least 300 s: a tenth of it)."""
LOCAL_BEATS = 2
"""Beats a rank writes to its node-local directory per interval: the node file, written once an
interval, then carries beats at most half an interval old."""
START_INTERVAL_S = 10.0
"""The beat interval while a rank starts, before its config (and hang timeout) is read."""
RANK_ENVS = ("SLURM_PROCID", "RANK")
"""Where a starting process finds its global rank (srun's, torchrun's), before the process group."""

_PROCESS: Heartbeat | None = None
"""This process's heartbeat once :func:`begin` started it."""


def beat_interval(hang_timeout: int | None) -> float:
    """Seconds between beats: a tenth of the hang timeout, within 1-30 s."""
    if not hang_timeout:
        return AUTO_INTERVAL_S
    return min(max(hang_timeout / 10, MIN_INTERVAL_S), MAX_INTERVAL_S)


def heartbeat_file(directory: Path, rank: int) -> Path:
    """A rank's own beat file in ``directory`` (node-local, or the shared one without it)."""
    return rank_file(directory, rank)


class Heartbeat:
    """This rank's heartbeat thread and the loop's marks (see the module docstring)."""

    def __init__(self, directory: Path, rank: int, *, hang_timeout: int | None,
                 ddp_timeout: float | None, interval: float | None = None, node: str | None = None) -> None:
        self.shared = Path(directory)
        self.node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        # The node-local directory of this node's ranks (None: this rank's own file is shared).
        self.local = local_directory(self.shared, self.node)
        self.path = heartbeat_file(self.local or self.shared, rank)
        self.node_file: Path | None = None  # the node file this process wrote last (None: none, or removed)
        self.interval = interval or beat_interval(hang_timeout)
        now = time.time()
        self._state = {"rank": rank, "node": self.node,
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
        hb = _PROCESS if _PROCESS is not None and _PROCESS.rank == rank else None
        if hb is None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            hb = cls(Path(directory), rank, hang_timeout=hang_timeout, ddp_timeout=ddp_timeout)
        else:  # the start-up heartbeat goes on with the config's settings
            hb.configure(hang_timeout=hang_timeout, ddp_timeout=ddp_timeout)
        if hang_timeout == 0:  # one beat says so, and the watchdog stops watching
            hb.stop_beating()
            hb.beat()
            atexit.register(hb.close)  # nothing is left on the node (the run's file: until the next start)
            return None
        return hb

    @classmethod
    def starting(cls, directory: Path, rank: int) -> Heartbeat:
        """A starting process's heartbeat (phase ``start``, every :data:`START_INTERVAL_S`
        seconds), beating from now on."""
        hb = cls(directory, rank, hang_timeout=None, ddp_timeout=None, interval=START_INTERVAL_S)
        with hb._lock:
            hb._state.update(phase="start")
        hb.beat()
        hb._start_thread()
        return hb

    @property
    def beats_per_interval(self) -> int:
        """How many beats the thread writes per interval (the node's shared file: one of them)."""
        return LOCAL_BEATS if self.local is not None else 1

    @property
    def rank(self) -> int:
        return int(self._state["rank"])  # type: ignore[call-overload]  # an int, set in __init__

    def configure(self, *, hang_timeout: int | None, ddp_timeout: float | None) -> None:
        """The config is read: its hang timeout, collective timeout and their beat interval."""
        self.interval = beat_interval(hang_timeout)
        with self._lock:
            self._state.update(hang_timeout=hang_timeout, ddp_timeout=ddp_timeout,
                               interval=self.interval)

    def stop_beating(self) -> None:
        """Stop the beat thread (the file stays as last written)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def start(self, step: int) -> None:
        """Training starts at ``step`` (the checkpoint's): the first step's allowance begins."""
        now = time.time()
        with self._lock:
            self._state.update(step=step, step_time=now, phase="first", phase_time=now)
        self.beat()
        self._start_thread()

    def _start_thread(self) -> None:
        if self._thread is None:
            self._stop.clear()
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
        self.beat()
        try:
            yield
        finally:
            with self._lock:
                self._state.update(phase="step", phase_time=time.time())

    def close(self) -> None:
        """Training is over on this rank (finished, stopped or failed): its beat goes, so a
        rank that ends normally is never taken for a frozen one (the node file is written
        without it at once, or removed by the node's last rank)."""
        global _PROCESS
        self.stop_beating()
        self.path.unlink(missing_ok=True)
        self._roll_up()
        if _PROCESS is self:
            _PROCESS = None

    def _run(self) -> None:
        ticks = 0
        while not self._stop.wait(self.interval / self.beats_per_interval):
            ticks += 1
            self.beat(aggregate=ticks % self.beats_per_interval == 0)

    def beat(self, *, aggregate: bool = True) -> None:
        """Write this rank's beat now; with ``aggregate``, where this rank is its node's
        aggregator (the lowest rank with a beat in the node-local directory), the node file
        too. The thread beats :attr:`beats_per_interval` times an interval, the last with
        ``aggregate``; a start, a phase and the config's hang timeout 0 beat at once."""
        with self._lock:
            self._state["time"] = time.time()
            text = json.dumps(self._state)
        try:
            try:
                write_atomic(self.path, text)
            except FileNotFoundError:
                if self.local is None:
                    raise
                # the node's other ranks all ended, and the last took the directory with it
                self.local.mkdir(mode=0o700, parents=True, exist_ok=True)
                write_atomic(self.path, text)
        except OSError:  # a full or flaky file system must not stop training
            return
        if aggregate and self.local is not None and local_ranks(self.local)[:1] == [self.rank]:
            self._roll_up()

    def _roll_up(self) -> None:
        if self.local is None:
            return
        try:
            self.node_file = roll_up(self.shared, self.local, self.node, self.rank, self.node_file)
        except OSError:  # as a beat's: training goes on; an unwritten node file goes stale
            pass


def begin() -> Heartbeat | None:
    """Start this process's heartbeat in phase ``start``, under a batch script that asks for
    heartbeats (None elsewhere, or where no rank variable names the rank yet); the training
    loop takes it over (:meth:`Heartbeat.from_env`). A process that ends before training
    removes its file (atexit), so a rank that stops on bad input is never taken for a frozen
    one."""
    global _PROCESS
    directory = os.environ.get(HEARTBEAT_ENV)
    rank = next((os.environ[name] for name in RANK_ENVS if os.environ.get(name, "").isdigit()), None)
    if not directory or rank is None or _PROCESS is not None:
        return _PROCESS
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    beat = Heartbeat.starting(Path(directory), int(rank))
    _PROCESS = beat
    atexit.register(beat.close)
    return beat


def configure_process(hang_timeout: int | None, ddp_timeout: float | None) -> None:
    """The config is read: this process's start-up heartbeat (if any) carries its timeouts, so
    the watchdog applies the run's own hang timeout to a rank that freezes while it starts."""
    if _PROCESS is not None:
        _PROCESS.configure(hang_timeout=hang_timeout, ddp_timeout=ddp_timeout)
