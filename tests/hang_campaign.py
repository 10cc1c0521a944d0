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

HANG_TIMEOUT_S = 20
SLOW_S, SLOW_TIMEOUT_S = 1.0, 8
KINDS = ("freeze", "block", "freeze-start", "slow")
NODES_BANNER = re.compile(r"hpc-mca \| nodes +\d+: (\S+)$")


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


def _wait_line(log: Path, pattern: str, deadline: float) -> float | None:
    """When a line matching ``pattern`` is first in the log (None at the deadline)."""
    regex = re.compile(pattern)
    while time.monotonic() < deadline:
        if any(regex.search(line) for line in campaign._log_lines(log)):
            return time.monotonic()
        time.sleep(0.1)
    return None


def _node_of(pid: int) -> str:
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"SLURMD_NODENAME="):
            return entry.split(b"=", 1)[1].decode()
    return "?"


def _starting_pid(run_dir: Path, rank: int, deadline: float) -> int:
    """The pid in ``rank``'s heartbeat while it says the rank is starting."""
    path = run_dir / "heartbeat" / f"rank-{rank:05d}.json"
    while time.monotonic() < deadline:
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
            continue
        if beat.get("phase") == "start":
            return int(beat["pid"])
        raise RuntimeError(f"rank {rank} was past its start ({beat.get('phase')}) when first seen")
    raise RuntimeError(f"rank {rank}: no heartbeat at {path}")


def _submit(work: Path, config: Path, nodes: int, timeout: float, **extra: str) -> str:
    env = {**campaign._job_env(**extra), "HPC_MCA_RUNS_ROOT": str(work / "runs")}
    done = subprocess.run(["sbatch", "--parsable", "--job-name=hang", f"--nodes={nodes}",
                           "--ntasks-per-node=1", "--time=10", f"--output={work}/%x_%j.out",
                           f"--chdir={work}", str(campaign.TEMPLATE), str(config),
                           f"training.hang_timeout={timeout}"],
                          env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip().split(";")[0]


def trial(kind: str, config: Path, reference: list[dict], work: Path, rng: random.Random,
          nodes: int = 2) -> HangTrial:
    work.mkdir(parents=True)
    step, rank = rng.randint(6, campaign.STEPS - 8), rng.randint(0, nodes - 1)
    extra = {"HPC_MCA_TEST_BLOCK": f"{step}:{rank}@0"} if kind == "block" else {}
    if kind == "slow":
        extra = {"HPC_MCA_TEST_RANK_SLEEP": f"{SLOW_S}:{rank}"}
    job_id = _submit(work, config, nodes, SLOW_TIMEOUT_S if kind == "slow" else HANG_TIMEOUT_S,
                     **extra)
    run_dir, log = work / "runs" / f"hang_{job_id}", work / f"hang_{job_id}.out"
    node, faulted = "", None
    if kind == "freeze-start":
        step, pid = 0, _starting_pid(run_dir, rank, time.monotonic() + 300)
        node = _node_of(pid)
        os.kill(pid, signal.SIGSTOP)
        faulted = time.monotonic()
    if kind in ("freeze", "block"):
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
            faulted = time.monotonic()
        else:
            faulted = _wait_line(log, rf"test hook: rank {rank} blocks", time.monotonic() + 300)
    deadline = time.monotonic() + 600
    requeued = _wait_line(log, r"^hpc-mca \| requeue ", deadline) if faulted else None
    resumed = campaign._first_resumed_step(log, 0, deadline) if faulted else None
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
