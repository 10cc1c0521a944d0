"""The preflight's time limits and the records it leaves while it runs, shared by one
node's check (:mod:`hpc_mca.runtime.node_check`, which imports torch), the batch node's wait
and verdict (:mod:`hpc_mca.slurm.preflight`) and ``hpc-mca status``/``watch``
(:mod:`hpc_mca.slurm.status`), which must not import torch. Pure Python.

In ``<run dir>/preflight/`` (removed at each start):

* ``<node>.phase``: a node writes it as it goes (:data:`PHASES`): its checks began, it
  reached the all-reduce, it joined it (its key is in the rendezvous store); the batch node
  names who is behind from them while the preflight runs. Only the reports (``<node>.json``)
  decide the verdict.
* :data:`STATE_FILE`: the batch node's line on the preflight, rewritten while it waits
  (``waiting for n2 (...)``) and once it judged (the verdict's line); status and watch show it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hpc_mca.rundir import PREFLIGHT_DIR, write_atomic

START_ALLOWANCE_S = 120.0
"""From srun's launch to a node's first check: the task's start and importing torch (a cold
shared file system included)."""
CHECK_TIMEOUT_S = 120.0
"""How long the local checks may take in all (a hung device fails instead of hanging)."""
RENDEZVOUS_TIMEOUT_S = 60.0
"""How long a node waits for the others at the all-reduce: one absent node cannot hang the
rest of the job for longer."""
AFTER_FAILURE_S = 5.0
"""After a failed all-reduce: how long each question to the rendezvous store may take, and
how long the nodes that joined wait for each other to say theirs failed too."""
LEAVE_S = 10.0
"""How long the first node keeps the store up for the others once it is done with it."""


def all_reduce_bound_s(rendezvous_s: float = RENDEZVOUS_TIMEOUT_S) -> float:
    """The longest a node's all-reduce may take in all: the store's connect, then the process
    group and the all-reduce, each up to the rendezvous timeout (their waits overlap the
    connect's: two in all), the questions after a failure, the store's leave. Past it the
    node gives up on the store (whose server, the first node, stopped answering)."""
    return 2 * rendezvous_s + 3 * AFTER_FAILURE_S + LEAVE_S


DEADLINE_S = START_ALLOWANCE_S + CHECK_TIMEOUT_S + all_reduce_bound_s() + 5.0
"""The preflight's own deadline, from srun's launch: every node that is not stopped has
written its report by then (start-up, the checks, the all-reduce, 5 s to write). The batch
node judges at this point at the latest and a node still silent is excluded; usually far
sooner, once every node reported or was named by the others."""

PHASES = ("checks", "all-reduce", "joined")
"""A node's phases in order: its local checks run; it reached the all-reduce (connecting to
the rendezvous store, which the first node hosts); it joined (its key is in the store)."""
PHASE_SUFFIX = ".phase"


def phase_path(run_dir: Path, node: str) -> Path:
    return Path(run_dir) / PREFLIGHT_DIR / f"{node}{PHASE_SUFFIX}"


def write_phase(run_dir: Path, node: str, restart: int, phase: str) -> None:
    """Record that ``node`` entered ``phase`` (best effort: the report is what counts)."""
    record = {"node": node, "restart": restart, "phase": phase, "time": round(time.time(), 3)}
    try:
        path = phase_path(run_dir, node)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record) + "\n")
    except OSError:
        pass


def read_phases(run_dir: Path, restart: int | None = None) -> dict[str, tuple[str, float]]:
    """node -> (phase, since when) of this start's phase records (``restart`` given: only
    that start's); unreadable or foreign records are skipped."""
    phases = {}
    for path in sorted((Path(run_dir) / PREFLIGHT_DIR).glob(f"*{PHASE_SUFFIX}")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            node, phase, since = str(record["node"]), str(record["phase"]), float(record["time"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if phase in PHASES and (restart is None or record.get("restart") == restart):
            phases[node] = (phase, since)
    return phases


STATE_FILE = "state"
"""In ``<run dir>/preflight/``: the batch node's record (:func:`write_state`); no ``.json``
suffix, so it is never taken for a node's report."""


def write_state(run_dir: Path, *, job: str, restart: int, started: float, line: str,
                done: bool, passed: bool | None = None) -> None:
    """The batch node's line on the preflight for status and watch (best effort)."""
    record = {"job": job, "restart": restart, "started": round(started, 3),
              "time": round(time.time(), 3), "line": line, "done": done, "passed": passed}
    try:
        path = Path(run_dir) / PREFLIGHT_DIR / STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record) + "\n")
    except OSError:
        pass


def read_state(run_dir: Path) -> dict | None:
    """The batch node's record of this start's preflight, or None (none, or unreadable)."""
    try:
        record = json.loads((Path(run_dir) / PREFLIGHT_DIR / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("line"), str) \
            or not isinstance(record.get("time"), (int, float)):
        return None
    return record
