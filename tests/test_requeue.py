"""The requeue protocol on the real local Slurm cluster (contract: hpc_mca/checkpoint/requeue.py).

* Training jobs (2 simulated nodes × 1 rank, DP=2, CPU, fixed seeds) submitted with the raw
  template ``sbatch/train.sbatch``: a real 1-minute time limit whose lead-time signal makes the
  job save and requeue itself, and an outside ``scontrol requeue``; both logs must equal an
  uninterrupted run's exactly. The test hook (tests/checkpoint_hooks) slows the first run's
  steps (sleeping, so the shared CPUs stay free) until the signal comes, and only the first.
* The batch script's requeue decisions with a stand-in rank launcher (no trainer, seconds):
  a finished run is not requeued even if the signal comes after the last step; a run stopped
  by the signal without budget is not requeued; a job that keeps failing stops after
  HPC_MCA_MAX_REQUEUES restarts.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import time
from pathlib import Path

import pytest
import slurm_cluster as slurm
import yaml
from trainer_fixtures import (
    make_model_dir,
    make_sft_data,
    run_train,
    steps,
    write_config,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.time_limits]

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "sbatch" / "train.sbatch"
HOOKS = Path(__file__).with_name("checkpoint_hooks")
COMPARED = ("step", "loss", "tokens", "grad_norm", "lr", "skipped")
MAX_STEPS = 300
SLOW_FIRST_RUN = "0.15@0"  # seconds per step while SLURM_RESTART_COUNT is 0


def numbers(run_dir: Path) -> list[dict]:
    return [{k: s[k] for k in COMPARED} for s in steps(run_dir)]


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    # HPC_MCA_PLAN=given: the arguments as they are (a reference run without a plan, or a
    # stand-in launcher); the job-start plan has its own tests (tests/test_sbatch_plan.py).
    env.update(HPC_MCA_HOME=str(REPO), PYTHONWARNINGS="ignore", HPC_MCA_DIST_TIMEOUT="120",
               HPC_MCA_PLAN="given", **extra)
    return env


def submit(work: Path, name: str, args: list[str], env: dict[str, str]) -> tuple[str, Path]:
    """sbatch the raw template; returns the job id and its run directory."""
    env = {**env, "HPC_MCA_RUNS_ROOT": str(work / "runs")}
    done = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={name}", f"--output={work}/%x_%j.out",
         f"--chdir={work}", *args], env=env, capture_output=True, text=True, check=True)
    job_id = done.stdout.strip().split(";")[0]
    return job_id, work / "runs" / f"{name}_{job_id}"


def wait_for_steps(run_dir: Path, count: int, timeout: float = 180) -> None:
    path, deadline = run_dir / "steps.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{path} did not reach {count} steps in {timeout} s")


def log_of(work: Path, name: str, job_id: str) -> str:
    return (work / f"{name}_{job_id}.out").read_text()


# --- training jobs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def training(slurm_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run config of MAX_STEPS steps and its uninterrupted DP=2 log (torchrun, no Slurm)."""
    root = tmp_path_factory.mktemp("requeue")
    config = write_config(root, make_model_dir(root, layers=2),
                          make_sft_data(root, 256, seed=1, name="train"),
                          training={"max_steps": MAX_STEPS, "logging_steps": 50,
                                    "report_to": ["none"]})
    proc = run_train(config, root / "reference", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "config": config, "reference": numbers(root / "reference")}


@pytest.fixture(scope="module")
def standard_training(training: dict) -> dict:
    """The same run on the standard backend (training.use_mca=false), and its uninterrupted log."""
    root = training["root"] / "standard"
    root.mkdir()
    settings = yaml.safe_load(training["config"].read_text())
    settings["training"]["use_mca"] = False
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(settings))
    proc = run_train(config, root / "reference", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "config": config, "reference": numbers(root / "reference")}


def test_time_limit_signal_saves_requeues_and_resumes_exactly(training: dict) -> None:
    """--time=1 with --signal=B:USR1@50: Slurm sends USR1 to the batch shell at its first limit
    check, 0-30 s into the run (checks come every 30 s and less than lead + 30 s is left), even
    before the shell's handler exists (it holds the signal till then); the ranks save at the
    next step and the job requeues itself: same job id, restart count >= 1 (1 unless the
    resumed run is signalled too), and the same numbers as without the interruption."""
    _time_limit_requeue(training, "tl")


def test_standard_backend_time_limit_requeues_and_resumes_exactly(standard_training: dict
                                                                  ) -> None:
    """The same contract on the standard backend (transformers' Trainer, HF checkpoints)."""
    _time_limit_requeue(standard_training, "tls")


def _time_limit_requeue(training: dict, name: str) -> None:
    work = training["root"] / "timelimit"
    work.mkdir()
    env = job_env(PYTHONPATH=str(HOOKS), HPC_MCA_TEST_STEP_SLEEP=SLOW_FIRST_RUN)
    started = time.monotonic()
    job_id, run_dir = submit(work, name, ["--nodes=2", "--ntasks-per-node=1", "--time=1",
                                          "--signal=B:USR1@50", str(TEMPLATE),
                                          str(training["config"])], env)
    state = slurm.wait_for_job(job_id, timeout=400)
    log = log_of(work, name, job_id)
    assert state == "COMPLETED", log[-4000:]
    # The limit applies to every run of the job: a resumed run that is still going at Slurm's
    # next limit check (every 30 s) gets its own lead-time signal and requeues once more. The
    # first run always does; usually the second finishes first (restart count 1).
    restarts = slurm.job_restart_count(job_id)
    assert restarts >= 1, log[-4000:]
    assert "hpc-mca | job            " + f"{job_id} ({name}) restart 1" in log
    assert re.search(r"requeue        time limit ahead \(SIGUSR1 \d+ s before the limit\): "
                     r"restart 1 of at most 10", log), log[-4000:]
    stopped = [line for line in log.splitlines() if line.startswith("stop requested by")]
    saved = [line for line in log.splitlines() if "saved (signal)" in line]
    assert len(stopped) == restarts and len(saved) == restarts, log[-4000:]
    assert numbers(run_dir) == training["reference"]
    print(f"\n{stopped[0]}\n{saved[0]}\njob {job_id}: signal -> requeue -> finished in "
          f"{time.monotonic() - started:.0f} s")


def test_outside_scontrol_requeue_resumes_exactly(training: dict) -> None:
    """``scontrol requeue`` from outside at a random step: TERM reaches the batch shell (which
    records it) and the ranks; they save at the next step; Slurm requeues; the log equals the
    uninterrupted one."""
    work = training["root"] / "outside"
    work.mkdir()
    env = job_env(PYTHONPATH=str(HOOKS), HPC_MCA_TEST_STEP_SLEEP=SLOW_FIRST_RUN)
    job_id, run_dir = submit(work, "out", ["--nodes=2", "--ntasks-per-node=1", "--time=5",
                                           str(TEMPLATE), str(training["config"])], env)
    at = random.Random().randint(5, 60)
    wait_for_steps(run_dir, at)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    state = slurm.wait_for_job(job_id, timeout=300)
    log = log_of(work, "out", job_id)
    assert state == "COMPLETED", log[-4000:]
    assert slurm.job_restart_count(job_id) == 1
    assert "stop requested by TERM" in log and "saved (signal)" in log, log[-4000:]
    assert "requeue        " not in log  # Slurm requeued it, not the batch shell
    assert numbers(run_dir) == training["reference"], f"requeued at step {at}"
    print(f"\nrequeued from outside after step {at}: "
          + next(line for line in log.splitlines() if line.startswith("resumed from")))


# --- the batch script's decisions, with a stand-in rank launcher -----------------------------

FAKE_RANK = r"""#!/bin/bash
# Stand-in for bin/hpc-mca-rank: records each start, then behaves as $FAKE_MODE says.
# (The batch shell also starts its hang watchdog through it: there is nothing to watch.)
[[ "$1" != watchdog ]] || exit 0
echo "${SLURM_RESTART_COUNT:-0}" >>"${HPC_MCA_RUN_DIR}/starts"
case "${FAKE_MODE}" in
    fail) exit 1 ;;
    finish_then_signal)  # the last step and its checkpoint are done; a signal comes late
        echo '{"step": 10}' >"${HPC_MCA_RUN_DIR}/finished"
        touch "${HPC_MCA_RUN_DIR}/ready"
        while [[ ! -f "${HPC_MCA_RUN_DIR}/go" ]]; do sleep 0.1; done ;;
    stop_on_signal)  # what the ranks do on the lead-time signal: save, exit 0, not finished
        touch "${HPC_MCA_RUN_DIR}/ready"
        while [[ ! -s "${HPC_MCA_SIGNAL_FILE}" ]]; do sleep 0.1; done ;;
    outside_requeue)  # the first start waits for an outside requeue; the next one finishes
        if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then
            touch "${HPC_MCA_RUN_DIR}/ready"
            while [[ ! -s "${HPC_MCA_SIGNAL_FILE}" ]]; do sleep 0.1; done
        else
            echo '{"step": 10}' >"${HPC_MCA_RUN_DIR}/finished"
        fi ;;
esac
exit 0
"""


@pytest.fixture
def fake_home(slurm_cluster: None, tmp_path: Path) -> Path:
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    launcher = home / "bin" / "hpc-mca-rank"
    launcher.write_text(FAKE_RANK)
    launcher.chmod(0o755)
    (tmp_path / "config.yaml").write_text("{}\n")
    return home


def _fake_job(home: Path, mode: str, **knobs: str) -> tuple[str, Path, Path]:
    work = home.parent
    env = job_env(FAKE_MODE=mode, **knobs)
    env["HPC_MCA_HOME"] = str(home)
    # --time=5: the template's lead-time signal (120 s) must not come on its own.
    job_id, run_dir = submit(work, mode, ["--time=5", str(TEMPLATE), str(work / "config.yaml")],
                             env)
    return job_id, run_dir, work


def _wait_file(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(str(path))
        time.sleep(0.1)


def test_finished_run_is_not_requeued_by_a_late_signal(fake_home: Path) -> None:
    job_id, run_dir, work = _fake_job(fake_home, "finish_then_signal")
    _wait_file(run_dir / "ready")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    _wait_file(run_dir / "signal_received")
    (run_dir / "go").touch()
    assert slurm.wait_for_job(job_id) == "COMPLETED"
    log = log_of(work, "finish_then_signal", job_id)
    assert slurm.job_restart_count(job_id) == 0 and "requeue " not in log, log
    assert (run_dir / "starts").read_text().split() == ["0"]


def test_stop_without_budget_is_not_requeued(fake_home: Path) -> None:
    job_id, run_dir, work = _fake_job(fake_home, "stop_on_signal", HPC_MCA_MAX_REQUEUES="0")
    _wait_file(run_dir / "ready")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    assert slurm.wait_for_job(job_id) == "FAILED"
    log = log_of(work, "stop_on_signal", job_id)
    # A manual USR1 with minutes left (--time=5, lead 120 s) is named as such.
    assert re.search(r"SIGUSR1 \d+ s before the time limit, not the lead-time signal \(lead 120 "
                     r"s\): sent by hand \(scancel --signal=USR1\): not requeued, retry budget "
                     r"spent \(0 restarts\)", log), log
    assert "exit code 75" in log and slurm.job_restart_count(job_id) == 0


def test_retry_budget_stops_a_job_that_keeps_failing(fake_home: Path) -> None:
    job_id, run_dir, work = _fake_job(fake_home, "fail", HPC_MCA_MAX_REQUEUES="2")
    assert slurm.wait_for_job(job_id, timeout=120) == "FAILED"
    log = log_of(work, "fail", job_id)
    assert (run_dir / "starts").read_text().split() == ["0", "1", "2"], log
    assert slurm.job_restart_count(job_id) == 2
    # srun's own line names the task and node that failed.
    assert re.search(r"task 0 on n\d failed: exit code 1 \(srun exit code 1\): restart 2 of at "
                     r"most 2", log), log
    assert re.search(r"task 0 on n\d failed: exit code 1 \(srun exit code 1\): not requeued, "
                     r"retry budget spent \(2 restarts\)", log), log


def test_an_outside_requeue_leaves_no_failed_batch_step_and_status_and_watch_say_why(
        fake_home: Path) -> None:
    """An outside ``scontrol requeue``: the batch shell of that start exits 0 (before: 75,
    which sacct kept as a FAILED 75:0 batch step for every such start); while the job is
    pending again, status and watch say why, in the same words."""
    from hpc_mca.slurm.status import job_status
    from hpc_mca.slurm.watch import JobSource, status_line

    job_id, run_dir, work = _fake_job(fake_home, "outside_requeue")
    _wait_file(run_dir / "ready")
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    runs, pending, watched = work / "runs", None, None
    deadline = time.monotonic() + 60
    while (pending is None or watched is None) and time.monotonic() < deadline:
        status = job_status(job_id, runs)
        if status.note is not None and status.note.label == "pending":
            pending = status.note.text
        snap = JobSource(job_id, runs).poll()
        if snap.note is not None and snap.note.startswith("requeued at "):
            watched = status_line(snap)
        time.sleep(0.2)
    assert slurm.wait_for_job(job_id) == "COMPLETED"
    log = log_of(work, "outside_requeue", job_id)
    why = "requeued by Slurm (scontrol requeue or preemption)"
    assert pending is not None and pending.endswith(f"(restart 0): {why}"), log
    assert watched is not None and watched.endswith(f"| {pending}"), watched
    assert re.search(rf"^hpc-mca \| end +{re.escape(why)}.*; exit code 0 after ", log, re.M), log
    batch: list[list[str]] = []
    deadline = time.monotonic() + 30  # accounting records each start's batch step as it ends
    while len(batch) < 2 and time.monotonic() < deadline:
        done = subprocess.run(["sacct", "-j", job_id, "--duplicates", "-n", "-P", "-o",
                               "JobID,State,ExitCode"], capture_output=True, text=True, check=True)
        batch = [line.split("|")[1:] for line in done.stdout.splitlines()
                 if line.startswith(f"{job_id}.batch|")]
        time.sleep(0.5)
    assert len(batch) == 2 and not any(state.startswith("FAILED") for state, _ in batch), done.stdout
    assert batch[0][1] == "0:0", done.stdout
    print(f"\njob {job_id}: batch steps {batch}; pending: {pending}")
