"""Status that tells the truth after faults (issue 42, part 4): the figures in progress.json
belong to the step shown, the batch shell names why a job requeues or ends, and a lead-time
signal that leaves the job no time to train is refused. Fast tests (no Slurm) and one Slurm
test of the batch shell's reasons."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hpc_mca.slurm.progress import read_progress

# --- progress.json: the figures belong to the step shown ----------------------------------


def _writer(run_dir: Path, max_steps: int = 20):
    from hpc_mca.loop.metrics import MetricsWriter

    return MetricsWriter(run_dir, True, [], max_steps, flops_per_token=1.0, world_size=1)


def _record(writer, step: int) -> None:
    writer.record_step(step=step, loss=10.0 - step / 10, tokens=100, input_tokens=100 * step,
                       grad_norm=1.0 + step, lr=1e-3 * step, skipped=False, seconds=0.5 * step)


def test_a_signal_save_between_logging_steps_shows_the_saved_steps_figures(tmp_path: Path) -> None:
    """Logged at step 5, stopped by a signal at step 7 (the loop's finish writes step 7): the
    loss, LR and ETA are step 7's, not step 5's; a restart at 7 reads them from steps.jsonl."""
    writer = _writer(tmp_path)
    for step in range(1, 8):
        _record(writer, step)
        if step == 5:
            writer.progress_line(5, {"train/loss": 9.5, "train/lr": 5e-3, "train/grad_norm": 6.0,
                                     "perf/tokens_per_s": 200.0}, step_time=1.0)
    before = read_progress(tmp_path)
    assert (before.step, before.loss, before.lr, before.eta_s) == (5, 9.5, 5e-3, 15.0)
    writer.write_progress(step=7, finished=False)  # what RunLoop.finish writes at the stop
    after = read_progress(tmp_path)
    # Steps 6 and 7 since the log: 1300 input tokens in 6.5 s, 3.25 s a step, 13 steps left.
    assert (after.step, after.loss, after.lr, after.grad_norm) == (7, 9.3, 7e-3, 8.0)
    assert after.tokens_per_s == pytest.approx(200.0) and after.eta_s == pytest.approx(42.25)
    # The job restarts at step 7: a new process, its first write names step 7 only.
    restarted = _writer(tmp_path)
    restarted.write_progress(step=7, max_steps=20, finished=False, job_id="9", restart_count=1)
    again = read_progress(tmp_path)
    assert (again.step, again.loss, again.lr, again.restart_count) == (7, 9.3, 7e-3, 1)
    assert again.startup_s == before.startup_s  # the last start's, until this one's first step
    assert again.eta_s == pytest.approx(13 * 3.5)  # step 7's own 3.5 s
    # A step without a record (a fresh run's step 0) shows no figures rather than old ones.
    (tmp_path / "steps.jsonl").unlink()
    _writer(tmp_path).write_progress(step=0, max_steps=20)
    fresh = json.loads((tmp_path / "progress.json").read_text())
    assert fresh["step"] == 0 and fresh["loss"] is None and fresh["eta_s"] is None


# --- a lead-time signal that leaves the job no time to train ------------------------------


def test_a_lead_that_leaves_no_time_to_train_is_refused_in_one_line() -> None:
    """--time 1 --signal-lead 30 (the issue's case: a signal at the start of every allocation)
    is refused; the largest lead that still leaves a quarter of the minute to train is kept."""
    from hpc_mca.slurm.errors import OpsError
    from hpc_mca.slurm.timelimit import signal_lead, training_window

    with pytest.raises(OpsError) as err:
        signal_lead(30, "00:01:00")
    assert str(err.value) == (
        "--signal-lead 30 s does not fit --time 00:01:00 (60 s): the job would stop to save right "
        "after it started; valid: --signal-lead 1..15 (the lead plus Slurm's 30 s check interval "
        "must leave a quarter of the limit to train), or leave it out (then 15 s)")
    assert signal_lead(15, "00:01:00") == 15 and training_window(15, "00:01:00") == 15
    assert signal_lead(None, "00:01:00") == 15
    with pytest.raises(OpsError, match=r"valid: a --time over 40 s, or leave it out \(then 10 s\)$"):
        signal_lead(1, "00:00:40")
    assert signal_lead(1, "00:00:41") == 1
    # From 2 minutes on, half the limit is the tighter rule, as before.
    assert signal_lead(60, "2") == 60 and signal_lead(1800, "01:00:00") == 1800


def test_resume_warns_when_the_lead_leaves_less_than_the_last_start_up(tmp_path: Path) -> None:
    from hpc_mca.slurm.progress import write_progress
    from hpc_mca.slurm.script import SbatchOptions, render_script
    from hpc_mca.slurm.timelimit import continuation_warning

    script = render_script(SbatchOptions(time="00:02:00", signal_lead_s=45))
    assert continuation_warning(tmp_path, script) is None  # no progress.json: nothing known
    write_progress(tmp_path, step=3, startup_s=59.2)
    assert continuation_warning(tmp_path, script) == (
        "warning: --signal-lead 45 s with --time 00:02:00 leaves 45 s before the lead-time "
        "signal (Slurm checks every 30 s), less than the 59 s the run's last start took to its "
        "first step: the job may requeue without training a step; valid: --signal-lead 1..30 or "
        "a longer --time")
    fits = render_script(SbatchOptions(time="00:02:00", signal_lead_s=30))
    assert continuation_warning(tmp_path, fits) is None


def test_the_first_step_records_the_start_up(tmp_path: Path) -> None:
    import psutil

    writer = _writer(tmp_path)
    _record(writer, 1)
    startup = read_progress(tmp_path).startup_s
    assert startup is not None
    assert 0 < startup <= time.time() - psutil.Process().create_time() + 1


# --- the batch shell names why the job requeues (stand-ins for srun, squeue, scontrol) ------

REPO = Path(__file__).resolve().parents[1]
FAKES = {
    # srun: holds while ${FAKE_DIR}/hold exists, then prints FAKE_SRUN_STDERR as srun would
    # (its own lines on failed tasks) and exits with FAKE_SRUN_EXIT.
    "srun": '#!/bin/bash\ntouch "${FAKE_DIR}/started"\n'
            'while [[ -e "${FAKE_DIR}/hold" ]]; do sleep 0.05; done\n'
            'printf "%b" "${FAKE_SRUN_STDERR:-}" >&2\nexit "${FAKE_SRUN_EXIT:-0}"\n',
    # squeue: the job's end time when asked for it, else a running job.
    "squeue": '#!/bin/bash\nif [[ "$*" == *EndTime* ]]; then cat "${FAKE_DIR}/endtime.out"; '
              'else echo "RUNNING|None|0|"; fi\n',
    "scontrol": '#!/bin/bash\necho "$*" >>"${FAKE_DIR}/scontrol.calls"\n',
    "scancel": '#!/bin/bash\necho "$*" >>"${FAKE_DIR}/scancel.calls"\n',
    # sinfo: the node states the shell reads before the ranks start (the machine's own sinfo
    # waits ~9 s for a controller when no local Slurm runs, which the timings above would see).
    "sinfo": '#!/bin/bash\nprintf "n1 alloc\\nn2 alloc\\n"\n',
}


def _batch_shell(tmp_path: Path, *, left_s: int, usr1: bool, stderr: str = "",
                 exit_code: int = 0) -> tuple[str, list[str], str]:
    """Run the rendered template (lead 120 s) under bash with the job's time limit ``left_s``
    away; ``usr1``: send the batch shell a USR1 while the ranks run. Returns the log, the
    scontrol calls and the signal file."""
    import os
    import signal
    import subprocess

    from hpc_mca.slurm.script import render_script

    fake = tmp_path / "fake"
    fake.mkdir()
    for name, text in FAKES.items():
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + left_s))
    (fake / "endtime.out").write_text(f"{end}\n")
    (fake / "hold").touch()
    config = tmp_path / "c.yaml"
    config.write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPC_MCA_"))}
    env.update(PATH=f"{fake}:{env['PATH']}", FAKE_DIR=str(fake), SLURM_JOB_ID="4242",
               SLURM_JOB_NAME="j", SLURM_SUBMIT_DIR=str(tmp_path), HPC_MCA_HOME=str(REPO),
               HPC_MCA_RANK_CMD="train", HPC_MCA_PLAN="given", FAKE_SRUN_STDERR=stderr,
               FAKE_SRUN_EXIT=str(exit_code))
    script = tmp_path / "job.sbatch"
    script.write_text(render_script())
    proc = subprocess.Popen(["bash", str(script), str(config)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    signal_file = tmp_path / "runs" / "j_4242" / "signal_received"
    deadline = time.monotonic() + 30
    while not (fake / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if usr1:
        proc.send_signal(signal.SIGUSR1)
        while not signal_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    (fake / "hold").unlink()
    out, _ = proc.communicate(timeout=60)
    calls = fake / "scontrol.calls"
    # ("show ..." calls: the node facts read for a hang's or a preflight's exclusion)
    return (out, [c for c in calls.read_text().splitlines() if not c.startswith("show ")]
            if calls.exists() else [],
            signal_file.read_text() if signal_file.exists() else "")


@pytest.mark.parametrize("case", ["lead-time", "manual", "crash after USR1", "script stopped",
                                  "SIGKILL", "exit 137"])
def test_the_requeue_banner_names_what_happened(tmp_path: Path, case: str) -> None:
    """Before: "time limit ahead (SIGUSR1)" for a USR1 an hour before the limit and for a rank
    that crashed after one; "ranks failed with exit code 143" for a SIGKILLed rank. Every case
    still requeues (when a job requeues is unchanged)."""
    import re

    killed = "srun: error: n2: task 1: Killed\nsrun: error: n1: task 0: Terminated\n"
    crashed = "Traceback (most recent call last):\nsrun: error: n2: task 1: Exited with exit code 1\n"
    left, usr1, stderr, code, expected = {
        "lead-time": (90, True, "", 0, r"time limit ahead \(SIGUSR1 (89|90) s before the limit\)"),
        "manual": (3600, True, "", 0, r"SIGUSR1 (3599|3600) s before the time limit, not the "
                   r"lead-time signal \(lead 120 s\): sent by hand \(scancel --signal=USR1\)"),
        "crash after USR1": (90, True, crashed, 1, r"task 1 on n2 failed: exit code 1 \(srun exit "
                             r"code 1\), after time limit ahead \(SIGUSR1 (89|90) s before the limit\)"),
        # A script's ranks (hpc-mca run) exit 75 when a signal stopped them: no failure.
        "script stopped": (90, True, "srun: error: n1: task 0: Exited with exit code 75\n"
                           "srun: error: n2: task 1: Terminated\n", 143,
                           r"time limit ahead \(SIGUSR1 (89|90) s before the limit\)"),
        "SIGKILL": (3600, False, killed, 143,
                    r"task 1 on n2 failed: killed by SIGKILL \(srun exit code 143\)"),
        "exit 137": (3600, False, "", 137, r"ranks failed with exit code 137 \(SIGKILL\)"),
    }[case]
    out, scontrol, signals = _batch_shell(tmp_path, left_s=left, usr1=usr1, stderr=stderr,
                                          exit_code=code)
    assert re.search(rf"^hpc-mca \| requeue        {expected}: restart 1 of at most 10$", out,
                     re.M), out
    assert scontrol == ["requeue 4242"], out
    if usr1:  # the record says how far the limit was
        assert re.search(r"^USR1 \S+ left=\d+ job=4242 restart=0$", signals), signals
    if stderr:  # srun's lines (and the ranks') still reach the log
        assert all(line in out for line in stderr.splitlines()), out


# --- on the local Slurm: a manual USR1, then a SIGKILLed rank, in one training job -----------


@pytest.mark.slurm
@pytest.mark.slow
def test_on_slurm_status_and_reasons_after_a_manual_usr1_and_a_sigkilled_rank(
        slurm_cluster: None, tmp_path: Path) -> None:
    """2 nodes × 1 rank, the raw template, --time=5 (lead 120 s), logging every 10 steps.
    The first run (slowed by the test hook) gets ``scancel --signal=USR1 --batch`` minutes
    before its limit: the ranks save at an unlogged step and the job requeues, named as a USR1
    sent by hand; progress.json then shows that step with that step's own loss and LR (before:
    step 10's). The second run has rank 1 SIGKILLed in the save of step 20: the requeue names
    the task, its node and SIGKILL (before: "exit code 143"). The third run finishes."""
    import re
    import subprocess

    import slurm_cluster as slurm
    from test_requeue import HOOKS, TEMPLATE, job_env, submit
    from trainer_fixtures import make_model_dir, make_sft_data, steps, write_config

    config = write_config(tmp_path, make_model_dir(tmp_path, layers=2),
                          make_sft_data(tmp_path, 128, seed=1, name="train"),
                          training={"max_steps": 30, "logging_steps": 10, "save_steps": 20,
                                    "report_to": ["none"]})
    env = job_env(PYTHONPATH=str(HOOKS), HPC_MCA_TEST_STEP_SLEEP="0.3@0",
                  HPC_MCA_TEST_KILL="20:before_write:1@1")
    job_id, run_dir = submit(tmp_path, "truth", ["--nodes=2", "--ntasks-per-node=1", "--time=5",
                                                 str(TEMPLATE), str(config)], env)
    log_path = tmp_path / f"truth_{job_id}.out"
    try:
        deadline = time.monotonic() + 300
        while (not (run_dir / "steps.jsonl").is_file()
               or len((run_dir / "steps.jsonl").read_text().splitlines()) < 12):
            assert time.monotonic() < deadline, "no 12 steps in 300 s"
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
        while "hpc-mca | requeue " not in (log_path.read_text() if log_path.exists() else ""):
            assert time.monotonic() < deadline, "no requeue after the USR1"
            time.sleep(0.1)
        # Between the first run's end and the second's first logging step (20).
        progress = read_progress(run_dir)
        by_step = {record["step"]: record for record in steps(run_dir)}
        saved = progress.step
        assert saved is not None and 12 <= saved < 20 and saved % 10, progress
        assert (progress.loss, progress.lr) == (by_step[saved]["loss"], by_step[saved]["lr"])
        assert progress.loss != by_step[10]["loss"] and progress.startup_s > 0
        state = slurm.wait_for_job(job_id, timeout=600)
    finally:
        slurm.cancel(job_id)
    log = log_path.read_text()
    assert state == "COMPLETED" and slurm.job_restart_count(job_id) == 2, log[-4000:]
    banners = [line for line in log.splitlines() if line.startswith("hpc-mca | requeue ")]
    assert re.fullmatch(r"hpc-mca \| requeue        SIGUSR1 \d+ s before the time limit, not the "
                        r"lead-time signal \(lead 120 s\): sent by hand \(scancel "
                        r"--signal=USR1\): restart 1 of at most 10", banners[0]), banners
    assert re.fullmatch(r"hpc-mca \| requeue        task 1 on n\d failed: killed by SIGKILL \(srun "
                        r"exit code 1(37|43)\): restart 2 of at most 10", banners[1]), banners
    assert len(banners) == 2 and "saved (signal)" in log, log[-4000:]
    print(f"\njob {job_id}: {banners[0][25:]}\n{banners[1][25:]}\nprogress after the signal "
          f"save: step {saved} loss {progress.loss:.4f} (step 10's {by_step[10]['loss']:.4f}); "
          f"start-up {progress.startup_s:.1f} s")
