"""Operator control on the real local Slurm cluster (2 simulated nodes × 1 rank, DP=2, CPU):

* ``hpc-mca cancel`` ends a job for good — after a lead-time signal, in the middle of a save,
  and while the job is pending between requeues: CANCELLED, no further restart (sacct), the
  checkpoints intact (the run then resumes and equals the uninterrupted run);
* the lead-time signal must fit the time limit: refused at submit when it does not, scaled
  to a quarter of a short limit by default, and a 2-minute job requeues only as often as its
  steps need;
* a finished run is extended with ``hpc-mca resume JOBID max_steps=N`` and equals a run
  defined for N steps from the start (constant schedule after warmup, so the rule "the
  schedule is re-derived for the new total" gives the same rates); ``status`` shows the run
  once, with its current job.

Steps are paced by the test hook (tests/checkpoint_hooks: sleeping, so the CPUs stay free).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster as slurm
from trainer_fixtures import make_model_dir, make_sft_data, run_train, steps, write_config

from hpc_mca.checkpoint.store import read_info, read_tracker

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.time_limits]

REPO = Path(__file__).resolve().parents[1]
HPC_MCA = str(Path(sys.executable).with_name("hpc-mca"))
HOOKS = Path(__file__).with_name("checkpoint_hooks")
DEMO = REPO / "hpc_mca" / "assets" / "demo" / "sft_addition.yaml"
CPU_2X1 = ["--gpu", "CPU", "--nodes", "2", "--gpus-per-node", "1"]
COMPARED = ("step", "loss", "tokens", "grad_norm", "lr")
MAX_STEPS = 40


def hpc_mca(*args: str, cwd: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    env.update(PYTHONPATH=str(HOOKS), PYTHONWARNINGS="ignore", HPC_MCA_DIST_TIMEOUT="120",
               HPC_MCA_RUNS_ROOT=str(cwd / "runs"), **env_extra)
    return subprocess.run([HPC_MCA, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180, check=False)


def numbers(run_dir: Path) -> list[dict]:
    return [{k: s[k] for k in COMPARED} for s in steps(run_dir)]


def assert_same_numbers(run_dir: Path, reference: list[dict]) -> float:
    got = numbers(run_dir)
    assert [s["step"] for s in got] == [s["step"] for s in reference]
    for mine, ref in zip(got, reference):
        assert mine["tokens"] == ref["tokens"], (mine, ref)
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-5), (mine, ref)
        assert mine["lr"] == pytest.approx(ref["lr"], rel=1e-9), (mine, ref)
    return max(abs(a["loss"] - b["loss"]) for a, b in zip(got, reference))


def wait_until(what: str, check, timeout: float = 240, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"{what}: not within {timeout} s")


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "steps.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def queued(job_id: str) -> str:
    """squeue's state of the job ('' once squeue no longer lists it)."""
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                          text=True, check=False).stdout.strip()


def assert_cancelled_for_good(job_id: str, restarts: int) -> None:
    """CANCELLED in sacct, and still so (with no new restart) after the requeue hold (5 s)
    and a scheduler pass would have started it again."""
    assert slurm.wait_for_job(job_id, timeout=120) == "CANCELLED"
    time.sleep(12)
    assert slurm.job_state(job_id) == "CANCELLED"
    assert slurm.job_restart_count(job_id) == restarts
    assert queued(job_id) == ""


def assert_checkpoints_intact(run_dir: Path) -> int:
    """The tracker names a complete checkpoint; returns its step."""
    root = run_dir / "checkpoints"
    name = read_tracker(root)
    assert name is not None and (root / name / "checkpoint.json").is_file()
    return read_info(root / name).step


@pytest.fixture(scope="module")
def setup(slurm_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run config (tiny Llama, SFT) and its uninterrupted DP=2 log (torchrun, no Slurm)."""
    root = tmp_path_factory.mktemp("operator")
    config = write_config(root, make_model_dir(root, layers=2),
                          make_sft_data(root, 256, seed=1, name="train"),
                          training={"max_steps": MAX_STEPS, "logging_steps": 1, "save_steps": 5,
                                    "report_to": ["none"]})
    proc = run_train(config, root / "reference", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "config": config, "reference": numbers(root / "reference")}


@pytest.fixture(scope="module", autouse=True)
def two_minute_job(setup: dict) -> tuple[str, Path]:
    """The job of test_a_two_minute_job_requeues_only_as_often_as_its_steps_need, submitted
    when the module starts: it sleeps through its paced steps for 2-3 allocations, so it runs
    beside the other tests here and its test finds it (nearly) done. (job id, run dir)."""
    work = setup["root"] / "two_minutes"
    work.mkdir()
    job_id = slurm.submitted_job_id(hpc_mca("submit", str(setup["config"]), *CPU_2X1, "--time",
                                            "2", cwd=work, HPC_MCA_TEST_STEP_SLEEP="2.2"))
    return job_id, work / "runs" / f"config_{job_id}"


def _submit(setup: dict, name: str, **hooks: str) -> tuple[str, Path, Path]:
    work = setup["root"] / name
    work.mkdir()
    job_id = slurm.submitted_job_id(hpc_mca("submit", str(setup["config"]), *CPU_2X1, "--time",
                                            "10", cwd=work, **hooks))
    return job_id, work, work / "runs" / f"config_{job_id}"


# --- cancel means cancel ---------------------------------------------------------------------


def test_cancel_after_the_lead_signal_is_final(setup: dict) -> None:
    """USR1 recorded (the ranks are mid-step, 4 s long), then hpc-mca cancel: the batch shell
    must not requeue on the strength of the earlier USR1."""
    job_id, work, run_dir = _submit(setup, "after_usr1", HPC_MCA_TEST_STEP_SLEEP="4")
    wait_until("two steps", lambda: logged_steps(run_dir) >= 2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    wait_until("the USR1 record", (run_dir / "signal_received").is_file)
    done = hpc_mca("cancel", job_id, cwd=work)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"cancelled job {job_id} (config, was RUNNING; now CANCELLED)"
    assert_cancelled_for_good(job_id, restarts=0)
    log = (run_dir / f"config_{job_id}.out").read_text()
    assert "end            cancelled: not requeued" in log, log[-3000:]
    assert "requeue        " not in log
    assert (run_dir / "cancel_requested").read_text().startswith(f"job={job_id} ")
    assert_checkpoints_intact(run_dir)
    # From another directory, with another runs root: the user's job index finds the run.
    shown = hpc_mca("status", job_id, cwd=setup["root"])
    assert shown.returncode == 0 and f"  run dir     {run_dir}\n" in shown.stdout, shown.stdout


def test_cancel_during_a_save_keeps_checkpoints_and_the_run_resumes_exactly(setup: dict) -> None:
    job_id, work, run_dir = _submit(setup, "mid_save", HPC_MCA_TEST_STEP_SLEEP="0.2",
                                    HPC_MCA_TEST_SAVE_SLEEP="6@10")
    log_path = run_dir / f"config_{job_id}.out"
    wait_until("the save of step 10",
               lambda: log_path.is_file() and "saving step 10" in log_path.read_text())
    assert (run_dir / "checkpoints" / "iter_0000010.tmp").is_dir()
    done = hpc_mca("cancel", job_id, cwd=work)
    assert done.returncode == 0 and "now CANCELLED" in done.stdout, done.stdout + done.stderr
    assert_cancelled_for_good(job_id, restarts=0)
    step = assert_checkpoints_intact(run_dir)
    # The save in flight completed (the ranks get KillWait, 30 s, after the TERM); the ranks
    # then agree on the stop at the next step boundary and save that step too.
    assert (run_dir / "checkpoints" / "iter_0000010" / "checkpoint.json").is_file()
    assert step in (10, 11)
    assert not (run_dir / "finished").exists()
    resumed = slurm.submitted_job_id(hpc_mca("resume", job_id, cwd=work))
    assert slurm.wait_for_job(resumed, timeout=300) == "COMPLETED"
    resume_log = (run_dir / f"config_{resumed}.out").read_text()
    assert f"at step {step} " in resume_log, resume_log[-3000:]
    worst = assert_same_numbers(run_dir, setup["reference"])
    print(f"\ncancelled mid-save of step 10; resumed from step {step}; "
          f"max |loss - reference| {worst:.1e}")


def test_cancel_while_pending_between_requeues(setup: dict) -> None:
    job_id, work, run_dir = _submit(setup, "pending", HPC_MCA_TEST_STEP_SLEEP="0.5")
    wait_until("two steps", lambda: logged_steps(run_dir) >= 2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    wait_until("the requeue", lambda: queued(job_id) == "PENDING", timeout=120, poll=0.1)
    # squeue shows PENDING as soon as slurmctld requeues the job; the REQUEUED record reaches
    # accounting (slurmdbd, what sacct reads) a moment later (one suite run read 0 here).
    wait_until("the requeue in accounting", lambda: slurm.job_restart_count(job_id) == 1,
               timeout=60)
    done = hpc_mca("cancel", job_id, cwd=work)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"cancelled job {job_id} (config, was PENDING; now CANCELLED)"
    assert_cancelled_for_good(job_id, restarts=1)
    log = (run_dir / f"config_{job_id}.out").read_text()
    assert re.search(r"requeue        SIGUSR1 \d+ s before the time limit, not the lead-time "
                     r"signal \(lead 120 s\): sent by hand \(scancel --signal=USR1\): restart 1 "
                     r"of at most 10", log), log[-3000:]
    assert f"job            {job_id} (config) restart 1" not in log  # never started again
    assert_checkpoints_intact(run_dir)


# --- the lead-time signal fits the time limit ------------------------------------------------


def test_a_lead_that_does_not_fit_the_limit_is_refused(setup: dict) -> None:
    work = setup["root"]
    config = str(setup["config"])
    done = hpc_mca("submit", config, *CPU_2X1, "--time", "1", "--signal-lead", "120", cwd=work)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == (
        "Error: --signal-lead 120 s does not fit --time 1 (60 s): the job would stop to save "
        "right after it started; valid: --signal-lead 1..15 (the lead plus Slurm's 30 s check "
        "interval must leave a quarter of the limit to train), or leave it out (then 15 s)")
    assert not (work / "runs").exists()  # nothing was submitted
    for time_limit, lead in (("1", 15), ("2", 30), ("01:00:00", 120)):
        script = hpc_mca("plan", config, *CPU_2X1, "--time", time_limit, "--sbatch", cwd=work)
        assert script.returncode == 0, script.stderr
        assert f"#SBATCH --signal=B:USR1@{lead}\n" in script.stdout


def test_a_two_minute_job_requeues_only_as_often_as_its_steps_need(
        setup: dict, two_minute_job: tuple[str, Path]) -> None:
    """--time 2 and the default lead (30 s there): each allocation trains for a good minute
    before the signal; the run of 40 × 2.2 s of steps takes 2 or 3 allocations."""
    job_id, run_dir = two_minute_job
    assert slurm.wait_for_job(job_id, timeout=900) == "COMPLETED"
    log = (run_dir / f"config_{job_id}.out").read_text()
    resumed_at = [int(m) for m in re.findall(r"^resumed from \S+ at step (\d+)", log, re.M)]
    restarts = slurm.job_restart_count(job_id)
    assert len(resumed_at) == restarts and 1 <= restarts <= 2, log[-4000:]
    # Every allocation but the last (which may just finish the run) moved it on by a good
    # share of its 40 steps (with a lead as long as the limit: one step each).
    starts = [0, *resumed_at, MAX_STEPS]
    assert all(b - a >= 10 for a, b in zip(starts[:-2], starts[1:-1])), starts
    assert_same_numbers(run_dir, setup["reference"])
    print(f"\n--time 2, lead 30 s: {restarts} requeue(s), allocations ended at steps "
          f"{starts[1:]}")


# --- a finished run extended; status follows it ----------------------------------------------

DEMO_60 = ["lr_scheduler_type=constant_with_warmup", "lr_scheduler_kwargs={}",
           "warmup_steps=10", "warmup_ratio=0", "eval_dataset=null", "eval_steps=null", "logging_steps=20"]


def test_finished_demo_run_extends_to_120_steps_and_status_follows_it(setup: dict) -> None:
    work = setup["root"] / "extend"
    work.mkdir()
    first = slurm.submitted_job_id(hpc_mca("submit", str(DEMO), *CPU_2X1, *DEMO_60,
                                           "max_steps=60", cwd=work))
    run_dir = work / "runs" / f"sft_addition_{first}"
    # The reference: 120 steps from the start, with the settings the job's ranks got (the
    # planner's choices included, e.g. the distributed optimizer), on 2 torchrun ranks.
    overrides = json.loads((run_dir / "manifest.json").read_text())["resolved_overrides"]
    reference = work / "reference"
    proc = run_train(DEMO, reference, 2, *overrides, "max_steps=120")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert slurm.wait_for_job(first, timeout=300) == "COMPLETED"
    assert json.loads((run_dir / "finished").read_text())["step"] == 60

    refused = {(): "nothing to resume; valid: extend it with max_steps=N (N > 60)",
               ("max_steps=40",): "training.max_steps=40 is below the step of the checkpoint",
               ("max_steps=60",): "finished at step 60 and this config trains to step 60"}
    for extra, message in refused.items():
        done = hpc_mca("resume", first, *extra, cwd=work)
        assert done.returncode == 1 and message in done.stderr, (extra, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1
    second = slurm.submitted_job_id(hpc_mca("resume", first, "max_steps=120", cwd=work))
    assert slurm.wait_for_job(second, timeout=300) == "COMPLETED"
    log = (run_dir / f"sft_addition_{second}.out").read_text()
    assert "extending the run that finished at step 60 to 120 steps" in log, log[-3000:]
    assert json.loads((run_dir / "finished").read_text())["step"] == 120
    worst = assert_same_numbers(run_dir, numbers(reference))
    print(f"\nextended 60 -> 120: max |loss - 120-step run| {worst:.1e}")

    table = json.loads(hpc_mca("status", "--json", cwd=work).stdout)
    assert [(row["job_id"], row["state"]) for row in table] == [(second, "COMPLETED")]
    assert table[0]["progress"]["step"] == 120 and table[0]["progress"]["max_steps"] == 120
    old = hpc_mca("status", first, cwd=work).stdout
    assert f"continued   by job {second} (COMPLETED)" in old, old
