"""Fault injection into training jobs on the local Slurm cluster (helpers for
tests/test_faults.py and benchmarks/fault_campaign.py).

Each trial submits the raw template (2 simulated nodes × 1 rank, DP=2, CPU) for a short run,
injects one fault at a random step, waits for the job to end, and reports:

* ``equal``: the run's per-step numbers equal the uninterrupted torchrun run's exactly;
* ``orphans_s``: how long after Slurm recorded the job's end (sacct) processes of the job
  (found by SLURM_JOB_ID in their environment: every simulated node is this machine) were
  still alive (about 0 when none were; the trial waits at most ORPHAN_WAIT_S, then kills);
* ``resume_s``: from the fault to the first step the restarted job logged (resumed from the
  last checkpoint, or started afresh when the fault hit the first save);
* ``restarts``: the job's requeues (sacct).

Faults: ``requeue`` (an outside ``scontrol requeue``), ``usr1`` (``scancel --signal=USR1
--batch``: the lead-time signal), ``kill`` (SIGKILL of a random rank process at a random
moment) and ``kill_in_save`` (SIGKILL of a random rank inside the save of a random
checkpoint step, at a random point of the commit protocol: tests/checkpoint_hooks).
"""

from __future__ import annotations

import os
import random
import re
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import slurm_cluster as slurm
from trainer_fixtures import make_model_dir, make_sft_data, processes_with_env, run_train, steps, write_config

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "sbatch" / "train.sbatch"
HOOKS = Path(__file__).with_name("checkpoint_hooks")
COMPARED = ("step", "loss", "tokens", "grad_norm", "lr", "skipped")
KINDS = ("requeue", "usr1", "kill", "kill_in_save")
STEPS, SAVE_EVERY = 40, 5
ORPHAN_WAIT_S = 30.0
RESTART_BANNER = re.compile(r"hpc-mca \| job +\d+ \(.*\) restart [1-9]\d*$")


@dataclass
class Trial:
    kind: str
    job_id: str
    fault_step: int
    detail: str
    equal: bool
    orphans_s: float
    resume_s: float | None
    restarts: int
    state: str


def numbers(run_dir: Path) -> list[dict]:
    return [{k: s[k] for k in COMPARED} for s in steps(run_dir)]


def prepare(root: Path, ranks: int = 2) -> tuple[Path, list[dict]]:
    """The run config and its uninterrupted numbers on ``ranks`` ranks (torchrun, no Slurm)."""
    config = write_config(root, make_model_dir(root, layers=2),
                          make_sft_data(root, 256, seed=1, name="train"),
                          training={"max_steps": STEPS, "logging_steps": 1,
                                    "save_steps": SAVE_EVERY, "report_to": ["none"]})
    proc = run_train(config, root / "reference", ranks)
    if proc.returncode != 0:
        raise RuntimeError(f"reference run failed:\n{proc.stderr[-3000:]}")
    return config, numbers(root / "reference")


def _job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    # HPC_MCA_PLAN=given: compared with a reference run that has no job-start plan.
    env.update(HPC_MCA_HOME=str(REPO), PYTHONWARNINGS="ignore", HPC_MCA_DIST_TIMEOUT="120",
               PYTHONPATH=str(HOOKS), HPC_MCA_TEST_STEP_SLEEP="0.25", HPC_MCA_PLAN="given",
               **extra)
    return env


def job_processes(job_id: str) -> list[int]:
    """Live processes with SLURM_JOB_ID=<job_id> in their environment."""
    return sorted(processes_with_env(f"SLURM_JOB_ID={job_id}"))


def _rank_pid(job_id: str, rank: int) -> int | None:
    marks = (f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={rank}".encode())
    for pid in job_processes(job_id):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(m in environ for m in marks) and b"hpc_mca" in command and b"train" in command:
            return pid
    return None


def _log_lines(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines() if log.is_file() else []


def _wait_logged(run_dir: Path, step: int, job_id: str, timeout: float = 300) -> None:
    path, deadline = run_dir / "steps.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) >= step:
            return
        if slurm.job_state(job_id) in slurm.TERMINAL_STATES:
            raise RuntimeError(f"job {job_id} ended before step {step}")
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} did not reach step {step}")


def _first_resumed_step(log: Path, after: int, deadline: float) -> float | None:
    """When the log first shows a step line after its ``after``-th restart banner (a restart
    resumes from the last checkpoint, or starts afresh when the fault hit the first save)."""
    while time.monotonic() < deadline:
        lines = _log_lines(log)
        restarts = [i for i, line in enumerate(lines) if RESTART_BANNER.match(line)]
        if len(restarts) > after and any(re.match(r"step \d+/", line)
                                          for line in lines[restarts[after]:]):
            return time.monotonic()
        time.sleep(0.1)
    return None


def _inject(kind: str, job_id: str, run_dir: Path, rng: random.Random) -> tuple[int, str]:
    """Wait for a random step and inject the fault; returns (step, what was done)."""
    if kind == "kill_in_save":  # the hook (set at submit) does it; wait for its line
        return 0, ""
    step = rng.randint(3, STEPS - 5)
    _wait_logged(run_dir, step, job_id)
    time.sleep(rng.uniform(0, 0.25))  # a random moment within the step
    if kind == "requeue":
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        return step, "scontrol requeue"
    if kind == "usr1":
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
        return step, "scancel --signal=USR1 --batch"
    rank = rng.randint(0, 1)
    pid = _rank_pid(job_id, rank)
    if pid is None:
        raise RuntimeError(f"job {job_id}: rank {rank} not found")
    os.kill(pid, signal.SIGKILL)
    return step, f"SIGKILL rank {rank}"


def trial(kind: str, config: Path, reference: list[dict], work: Path,
          rng: random.Random) -> Trial:
    work.mkdir(parents=True)
    extra = {}
    if kind == "kill_in_save":
        save_step = SAVE_EVERY * rng.randint(1, STEPS // SAVE_EVERY - 1)
        point = rng.choice(["before_write", "after_write", "before_tracker"])
        rank = 0 if point == "before_tracker" else rng.randint(0, 1)
        extra["HPC_MCA_TEST_KILL"] = f"{save_step}:{point}:{rank}@0"
    env = {**_job_env(**extra), "HPC_MCA_RUNS_ROOT": str(work / "runs")}
    done = subprocess.run(["sbatch", "--parsable", "--job-name=fault", "--nodes=2",
                           "--ntasks-per-node=1", "--time=10", f"--output={work}/%x_%j.out",
                           f"--chdir={work}", str(TEMPLATE), str(config)], env=env,
                          capture_output=True, text=True, check=True)
    job_id = done.stdout.strip().split(";")[0]
    run_dir, log = work / "runs" / f"fault_{job_id}", work / f"fault_{job_id}.out"
    step, detail = _inject(kind, job_id, run_dir, rng)
    if kind == "kill_in_save":
        deadline = time.monotonic() + 300
        while not any("test hook: SIGKILL" in line for line in _log_lines(log)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id}: the kill hook did not fire")
            time.sleep(0.05)
        step, detail = save_step, f"SIGKILL rank {rank} {point} of save {save_step}"
    faulted = time.monotonic()
    resumed = _first_resumed_step(log, 0, faulted + 300)
    state = slurm.wait_for_job(job_id, timeout=600)
    ended = time.monotonic()
    while job_processes(job_id) and time.monotonic() - ended < ORPHAN_WAIT_S:
        time.sleep(0.1)
    orphans_s = time.monotonic() - ended  # about 0 when nothing of the job was left
    for pid in job_processes(job_id):  # never leave them to the next trial
        os.kill(pid, signal.SIGKILL)
    equal = state == "COMPLETED" and numbers(run_dir) == reference
    return Trial(kind, job_id, step, detail, equal, round(orphans_s, 2),
                 None if resumed is None else round(resumed - faulted, 2),
                 slurm.job_restart_count(job_id), state)


def table(trials: list[Trial]) -> str:
    """One row per fault kind: runs, bitwise-equal runs, orphans, fault -> resumed step."""
    rows = [("fault", "runs", "bitwise equal", "orphans max s", "fault->resumed step median s",
             "max s", "restarts")]
    for kind in dict.fromkeys(t.kind for t in trials):
        mine = [t for t in trials if t.kind == kind]
        waits = [t.resume_s for t in mine if t.resume_s is not None]
        rows.append((kind, str(len(mine)), str(sum(t.equal for t in mine)),
                     f"{max(t.orphans_s for t in mine):.1f}",
                     f"{statistics.median(waits):.1f}" if waits else "-",
                     f"{max(waits):.1f}" if waits else "-",
                     ",".join(str(t.restarts) for t in mine)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)
