"""Hangs injected into training jobs on the local Slurm cluster (helpers for
tests/test_hangs.py and benchmarks/hang_campaign.py); the run setup and the comparison are
tests/fault_campaign.py's.

Each trial submits the raw template (``nodes`` simulated nodes x 1 rank, DP = nodes, CPU)
with ``training.hang_timeout=HANG_TIMEOUT_S`` and injects one of:

* ``freeze``: SIGSTOP of a random rank at a random step (the process and its heartbeat stop);
* ``block``: a random rank blocks, at a random step, in a barrier no other rank enters
  (tests/checkpoint_hooks: HPC_MCA_TEST_BLOCK; its heartbeat lives, its step falls behind);
* ``freeze-start``: SIGSTOP of a random rank as soon as its first heartbeat says it is
  starting (phase ``start``: before its process group; the others wait in the rendezvous);
* ``freeze-pg``, ``freeze-data``, ``freeze-load``, ``freeze-save``: a random rank stops itself
  (SIGSTOP) just after its process group is made, as data preparation begins, as the
  checkpoint load of the job's first restart begins (an outside requeue after the first save),
  or as its first save begins (the others wait in the save's collectives); see FREEZE_POINTS;
* ``slow``: one rank sleeps SLOW_S in every step, far longer in all than the hang timeout,
  but finishes each step (HPC_MCA_TEST_RANK_SLEEP): it must not be stopped.

and reports: the job's end, whether its numbers equal the uninterrupted run's, the node the
fault hit, the job's ExcNodeList and nodes after the restart, and the seconds from the fault
to the requeue line of the log and to the first resumed step.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import fault_campaign as campaign
import slurm_cluster as slurm

from hpc_mca.slurm.watchdog import read_beats

HANG_TIMEOUT_S = 20
SLOW_S, SLOW_TIMEOUT_S = 1.0, 8
KINDS = ("freeze", "block", "freeze-start", "freeze-pg", "freeze-data", "freeze-load", "freeze-save",
         "slow")
NODES_BANNER = re.compile(r"hpc-mca \| nodes +\d+: (\S+)$")
REQUEUE_LINE = re.compile(r"^hpc-mca \| requeue ")


@dataclass
class HangTrial:
    kind: str
    nodes: int
    job_id: str
    fault_step: int
    rank: int
    node: str
    state: str
    equal: bool
    restarts: int
    requeue_s: float | None
    """From the fault to the log's requeue line."""
    resume_s: float | None
    """From the fault to the first step the restarted job logged."""
    excluded: list[str]
    """The job's ExcNodeList while its restart ran."""
    restart_nodes: list[str]
    """The nodes of the restart (its banner)."""
    hangs: list[dict]
    """The run's hangs.jsonl."""


def _hostnames(expr: str) -> list[str]:
    if not expr or expr == "(null)":
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", expr], capture_output=True, text=True)
    return out.stdout.split()


def _excluded(job_id: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    match = re.search(r" ExcNodeList=(\S+)", out.stdout)
    return _hostnames(match.group(1)) if match else []


def _wait_line(log: Path, pattern: str, deadline: float, count: int = 1) -> float | None:
    """When the ``count``-th line matching ``pattern`` is in the log (None at the deadline)."""
    regex = re.compile(pattern)
    while time.monotonic() < deadline:
        if sum(bool(regex.search(line)) for line in campaign._log_lines(log)) >= count:
            return time.monotonic()
        time.sleep(0.1)
    return None


def _node_of(pid: int) -> str:
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"SLURMD_NODENAME="):
            return entry.split(b"=", 1)[1].decode()
    return "?"


def _starting_pid(run_dir: Path, rank: int, deadline: float) -> int:
    """The pid in ``rank``'s heartbeat (its node's file) while it says the rank is starting."""
    directory = run_dir / "heartbeat"
    while time.monotonic() < deadline:
        beat = next((b for b in read_beats(directory) if b.rank == rank), None)
        if beat is None:
            time.sleep(0.05)
            continue
        if beat.phase == "start":
            return beat.pid
        raise RuntimeError(f"rank {rank} was past its start ({beat.phase}) when first seen")
    raise RuntimeError(f"rank {rank}: no heartbeat in {directory}")


def _submit(work: Path, config: Path, nodes: int, timeout: float, **extra: str) -> str:
    env = {**campaign._job_env(**extra), "HPC_MCA_RUNS_ROOT": str(work / "runs")}
    done = subprocess.run(["sbatch", "--parsable", "--job-name=hang", f"--nodes={nodes}",
                           "--ntasks-per-node=1", "--time=10", f"--output={work}/%x_%j.out",
                           f"--chdir={work}", str(campaign.TEMPLATE), str(config),
                           f"training.hang_timeout={timeout}"],
                          env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip().split(";")[0]


FREEZE_POINTS = {"freeze-pg": "process_group", "freeze-data": "data", "freeze-load": "load",
                 "freeze-save": "save"}
"""Kinds that freeze a rank at tests/checkpoint_hooks' HPC_MCA_TEST_FREEZE points: its process
group just made, data preparation begun, the checkpoint load begun (on the job's first restart:
an outside requeue after the first save makes one to load), its first save begun."""


def trial(kind: str, config: Path, reference: list[dict], work: Path, rng: random.Random,
          nodes: int = 2) -> HangTrial:
    work.mkdir(parents=True)
    step, rank = rng.randint(6, campaign.STEPS - 8), rng.randint(0, nodes - 1)
    extra = {"HPC_MCA_TEST_BLOCK": f"{step}:{rank}@0"} if kind == "block" else {}
    if kind == "slow":
        extra = {"HPC_MCA_TEST_RANK_SLEEP": f"{SLOW_S}:{rank}"}
    if kind in FREEZE_POINTS:
        restart = 1 if kind == "freeze-load" else 0
        extra = {"HPC_MCA_TEST_FREEZE": f"{FREEZE_POINTS[kind]}:{rank}@{restart}"}
    job_id = _submit(work, config, nodes, SLOW_TIMEOUT_S if kind == "slow" else HANG_TIMEOUT_S,
                     **extra)
    run_dir, log = work / "runs" / f"hang_{job_id}", work / f"hang_{job_id}.out"
    step, node, faulted = _inject(kind, job_id, run_dir, log, step, rank, rng)
    # The requeue and the restart that follow the fault (freeze-load's restart came first).
    lines = campaign._log_lines(log)
    requeues = sum(bool(REQUEUE_LINE.search(line)) for line in lines)
    restarts = sum(bool(campaign.RESTART_BANNER.match(line)) for line in lines)
    deadline = time.monotonic() + 600
    requeued = _wait_line(log, REQUEUE_LINE.pattern, deadline, requeues + 1) if faulted else None
    resumed = campaign._first_resumed_step(log, restarts, deadline) if faulted else None
    excluded = _excluded(job_id) if resumed else []
    state = slurm.wait_for_job(job_id, timeout=600)
    for pid in campaign.job_processes(job_id):  # never leave them to the next trial
        os.kill(pid, signal.SIGKILL)
    banners = [m.group(1) for m in map(NODES_BANNER.match, campaign._log_lines(log)) if m]
    hangs_file = run_dir / "hangs.jsonl"
    hangs = ([json.loads(line) for line in hangs_file.read_text().splitlines()]
             if hangs_file.is_file() else [])
    return HangTrial(kind, nodes, job_id, step, rank, node, state,
                     state == "COMPLETED" and campaign.numbers(run_dir) == reference,
                     slurm.job_restart_count(job_id),
                     None if requeued is None else round(requeued - faulted, 1),
                     None if resumed is None else round(resumed - faulted, 1), excluded,
                     _hostnames(banners[-1]) if len(banners) > 1 else [], hangs)


def _inject(kind: str, job_id: str, run_dir: Path, log: Path, step: int, rank: int,
            rng: random.Random) -> tuple[int, str, float | None]:
    """The fault of ``kind``: (its step, the node it hit, when)."""
    if kind == "freeze-start":
        pid = _starting_pid(run_dir, rank, time.monotonic() + 300)
        node = _node_of(pid)
        os.kill(pid, signal.SIGSTOP)
        return 0, node, time.monotonic()
    if kind in FREEZE_POINTS:
        if kind == "freeze-load":  # a checkpoint to load, then a restart that loads it
            campaign._wait_logged(run_dir, campaign.SAVE_EVERY + 1, job_id)
            subprocess.run(["scontrol", "requeue", job_id], check=True)
        faulted = _wait_line(log, rf"test hook: rank {rank} freezes at ", time.monotonic() + 300)
        pid = campaign._rank_pid(job_id, rank)
        return 0, _node_of(pid) if pid else "?", faulted
    if kind not in ("freeze", "block"):
        return step, "", None
    campaign._wait_logged(run_dir, step - 1, job_id)
    pid, until = None, time.monotonic() + 60
    while pid is None and time.monotonic() < until:
        pid = campaign._rank_pid(job_id, rank)
    if pid is None:
        raise RuntimeError(f"job {job_id}: rank {rank} not found")
    node = _node_of(pid)
    if kind == "freeze":
        campaign._wait_logged(run_dir, step, job_id)
        time.sleep(rng.uniform(0, 0.25))  # a random moment within the step
        os.kill(pid, signal.SIGSTOP)
        return step, node, time.monotonic()
    return step, node, _wait_line(log, rf"test hook: rank {rank} blocks", time.monotonic() + 300)


def table(trials: list[HangTrial]) -> str:
    """One row per (fault, nodes): runs, equal runs, node excluded, fault->requeue and
    fault->resumed step (median, max)."""
    rows = [("fault", "nodes", "runs", "equal", "node excluded", "fault->requeue s med/max",
             "fault->resumed step s med/max", "restarts")]
    for key in dict.fromkeys((t.kind, t.nodes) for t in trials):
        mine = [t for t in trials if (t.kind, t.nodes) == key]
        req = [t.requeue_s for t in mine if t.requeue_s is not None]
        res = [t.resume_s for t in mine if t.resume_s is not None]
        rows.append((key[0], str(key[1]), str(len(mine)), str(sum(t.equal for t in mine)),
                     str(sum(bool(t.node) and t.node in t.excluded
                             and t.node not in t.restart_nodes for t in mine)),
                     f"{statistics.median(req):.1f}/{max(req):.1f}" if req else "-",
                     f"{statistics.median(res):.1f}/{max(res):.1f}" if res else "-",
                     ",".join(str(t.restarts) for t in mine)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)
