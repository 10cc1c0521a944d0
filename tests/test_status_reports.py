"""Status that tells the truth after faults (issue 42, part 4, items 3-5).

Fast tests feed the status code Slurm's own text through stand-in ``squeue``/``scontrol``/
``sacct`` on PATH; one Slurm test runs a raw-template job through two requeues and a cancel and
checks ``watch``, ``status`` and ``logs`` against sacct.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_mca.checkpoint.compat import lowest_max_steps, nothing_to_train
from hpc_mca.checkpoint.store import mark_finished
from hpc_mca.config.sections import TrainingArguments
from hpc_mca.slurm import commands
from hpc_mca.slurm.logs import log_path
from hpc_mca.slurm.status import RunStatus, format_status

HPC_MCA = str(Path(sys.executable).with_name("hpc-mca"))
REPO = Path(__file__).resolve().parents[1]
SEP = "\x1f"


def _stand_ins(folder: Path, sacct_rows: list[list[str]], submit_line: str = "",
               scontrol: str = "", steps: str = "") -> dict[str, str]:
    """PATH with squeue and scontrol that (by default) no longer know any job, as after
    MinJobAge, and an sacct that prints ``sacct_rows`` (or ``submit_line`` when asked for
    SubmitLine)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = "\n".join(SEP.join(row) for row in sacct_rows)
    (folder / "rows").write_text(rows + "\n")
    (folder / "submit").write_text(submit_line + "\n")
    (folder / "scontrol.out").write_text(scontrol)
    (folder / "steps").write_text(steps)
    scripts = {
        "squeue": "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1",
        "scontrol": f'[[ -s "{folder}/scontrol.out" ]] || exit 1; cat "{folder}/scontrol.out"',
        "sacct": f'if [[ "$*" == *SubmitLine* ]]; then cat "{folder}/submit"; '
                 f'elif [[ "$*" == *JobID,ExitCode,End* ]]; then cat "{folder}/steps"; '
                 f'else cat "{folder}/rows"; fi',
    }
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/bin/bash\n{body}\n")
        (folder / name).chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


# --- item 3: one exit code, and elapsed over every run ----------------------------------------

def _row(state: str, elapsed: str, exit_code: str, name: str = "rq", work: str = "/w") -> list[str]:
    return ["7", state, elapsed, "01:00:00", "1", "n1", work, exit_code, name]


def test_durations_parse_slurm_formats() -> None:
    assert [commands.duration_s(t) for t in ("0:26", "00:02:40", "1:02:03", "2-01:00:00")] == [
        26, 160, 3723, 176400]
    assert commands.duration_s("INVALID") is None and commands.duration_s("") is None
    assert [commands.format_duration(s) for s in (26, 160, 3723, 176400)] == [
        "0:26", "2:40", "1:02:03", "2-01:00:00"]


def test_total_elapsed_and_restarts_over_requeues(tmp_path: Path, monkeypatch) -> None:
    # The campaign's case: three requeued runs and the last one, 2:40 in all, the last 0:26.
    rows = [_row("REQUEUED", "00:00:50", "0:0"), _row("REQUEUED", "00:00:44", "0:0"),
            _row("REQUEUED", "00:00:40", "0:0"), _row("CANCELLED by 0", "00:00:26", "0:0")]
    monkeypatch.setenv("PATH", _stand_ins(tmp_path / "bin", rows)["PATH"])
    job = commands.job_state("7")
    assert (job.source, job.state, job.elapsed, job.requeues, job.runs) == (
        "sacct", "CANCELLED", "00:00:26", 3, 4)
    assert job.total_elapsed_s == 160
    head = format_status(RunStatus("7", job, None, None, total_elapsed_s=160, runs=4))
    assert "elapsed 00:00:26 of 01:00:00 (all 4 runs: 2:40, 3 restarts)" in head.splitlines()[0]


def test_exit_code_is_the_batch_steps_and_final(tmp_path: Path, monkeypatch) -> None:
    """sacct's job record of a cancelled job says 0:0 from the moment of the cancel; the
    batch step says how the script ended, once it has (measured: 5 s later, job 702)."""
    rows = [_row("REQUEUED", "00:00:03", "0:0"), _row("CANCELLED by 0", "00:00:01", "0:0")]

    def steps(last_end: str) -> str:
        return "\n".join(SEP.join(f) for f in [
            ("7", "0:0", "2026-11-27T03:26:52"), ("7.batch", "0:0", "2026-11-27T03:26:57"),
            ("7", "0:0", "2026-11-27T03:27:18"), ("7.batch", "15:0", last_end)]) + "\n"

    monkeypatch.setenv("PATH", _stand_ins(tmp_path / "a", rows, steps=steps("Unknown"))["PATH"])
    ending = commands.job_state("7")
    assert (ending.state, ending.exit_code, ending.finished) == ("COMPLETING", "", False)
    monkeypatch.setenv("PATH", _stand_ins(tmp_path / "b", rows,
                                          steps=steps("2026-11-27T03:27:23"))["PATH"])
    ended = commands.job_state("7")
    assert (ended.state, ended.exit_code, ended.finished) == ("CANCELLED", "15:0", True)
    # The same from scontrol (slurmctld still holds the job), whose own ExitCode differs.
    scontrol = "JobId=7 JobName=rq JobState=CANCELLED RunTime=00:00:01 ExitCode=143:0 Restarts=1\n"
    monkeypatch.setenv("PATH", _stand_ins(tmp_path / "c", rows, "", scontrol,
                                          steps("2026-11-27T03:27:23"))["PATH"])
    held = commands.job_state("7")
    assert (held.source, held.exit_code, held.total_elapsed_s) == ("scontrol", "15:0", 4)
    # Cancelled while pending after a requeue: the newest run has no batch step; the
    # earlier run's is not this run's exit code.
    no_batch = "\n".join(SEP.join(f) for f in [("7", "0:0", "2026-11-27T03:26:52"),
                                              ("7.batch", "0:0", "2026-11-27T03:26:57"),
                                              ("7", "0:0", "2026-11-27T03:27:18")]) + "\n"
    monkeypatch.setenv("PATH", _stand_ins(tmp_path / "d", rows, steps=no_batch)["PATH"])
    assert commands.batch_exit("7") is None and commands.job_state("7").exit_code == "0:0"


# --- item 4: logs of a raw-template job Slurm has forgotten -----------------------------------

def test_log_of_a_forgotten_raw_job_comes_from_accounting(tmp_path: Path, monkeypatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    rows = [_row("COMPLETED", "00:00:10", "0:0", name="rq", work=str(work))]
    # The template's own --output=%x_%j.out, relative to the job's WorkDir.
    monkeypatch.setenv("PATH", _stand_ins(tmp_path / "a", rows, "sbatch rq.sbatch c.yaml")["PATH"])
    assert commands.job_log("7") == work / "rq_7.out"
    # sbatch's own -o/--output wins, its %-patterns filled in; one the login side cannot
    # know (%N: the first node) falls back to the template's.
    for line, expected in [("sbatch -o logs/%x-%j.txt train.sbatch c.yaml", work / "logs/rq-7.txt"),
                           ("sbatch --output=/abs/%j_%%.log t.sbatch", Path("/abs/7_%.log")),
                           ("sbatch --output /o/%u.%A t.sbatch", Path(f"/o/{commands.current_user()}.7")),
                           ("sbatch -o %N.out t.sbatch", work / "rq_7.out")]:
        monkeypatch.setenv("PATH", _stand_ins(tmp_path / "b", rows, line)["PATH"])
        assert commands.job_log("7") == expected, line
    # While slurmctld knows the job, its StdOut is exact.
    monkeypatch.setenv("PATH", _stand_ins(tmp_path / "c", rows, "", "JobId=7 StdOut=/x/y.out\n")["PATH"])
    assert commands.job_log("7") == Path("/x/y.out")


def test_logs_finds_a_forgotten_indexed_raw_job(tmp_path: Path, monkeypatch) -> None:
    """The raw template indexes its run dir (no manifest): the log must come from sacct."""
    work, run_dir = tmp_path / "work", tmp_path / "work" / "runs" / "rq_7"
    run_dir.mkdir(parents=True)
    (work / "rq_7.out").write_text("hello\n")
    monkeypatch.setenv("HPC_MCA_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "runs.tsv").write_text(f"7\t{run_dir}\t0\n")
    rows = [_row("COMPLETED", "00:00:10", "0:0", name="rq", work=str(work))]
    monkeypatch.setenv("PATH", _stand_ins(tmp_path / "bin", rows, "sbatch t.sbatch")["PATH"])
    assert log_path("7", tmp_path / "elsewhere") == work / "rq_7.out"


# --- item 5: the bound resume names is the one it accepts -------------------------------------

def test_resume_names_the_lowest_max_steps_it_accepts(tmp_path: Path) -> None:
    def training(max_steps: int) -> TrainingArguments:
        return TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps)

    # Not finished (a job stopped at its checkpoint of step 180): 180 resumes (and finishes).
    assert lowest_max_steps(training(150), 180) == 180
    mark_finished(tmp_path, 180)
    bound = lowest_max_steps(training(150), 180)
    assert bound == 181
    assert nothing_to_train(training(bound)) is None  # the named bound is accepted
    refused = nothing_to_train(training(bound - 1))  # and the step below it refused
    assert refused is not None and "finished at step 180" in refused and "N > 180" in refused
    # An explicit checkpoint path is no extension of the finished run: the step is the bound.
    explicit = TrainingArguments(output_dir=str(tmp_path), max_steps=150,
                                 resume_from_checkpoint=str(tmp_path / "checkpoints"))
    assert lowest_max_steps(explicit, 180) == 180


# --- on the local Slurm: a raw-template job requeued twice, then cancelled --------------------

REQUEUE_TWICE = """#!/bin/bash
# Stand-in rank: the first two runs requeue the job (as the requeue protocol does), the third
# waits to be cancelled.
echo "rank run ${SLURM_RESTART_COUNT:-0}"
if (( ${SLURM_RESTART_COUNT:-0} < 2 )); then
    sleep 3
    scontrol requeue "${SLURM_JOB_ID}"
    sleep 60
fi
exec sleep 600
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    return {**env, **extra}


@pytest.mark.slurm
@pytest.mark.slow
def test_requeued_then_cancelled_raw_job_reports_agree(slurm_cluster: None, tmp_path: Path) -> None:
    import slurm_cluster as slurm

    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)  # sbatch's -o folder must exist
    (work / "c.yaml").write_text("max_steps: 2\n")  # the template checks that it exists
    fake = tmp_path / "rank"
    fake.write_text(REQUEUE_TWICE)
    fake.chmod(0o755)
    env = _env(HPC_MCA_HOME=str(REPO), HPC_MCA_PYTHON=str(fake), HPC_MCA_PLAN="given")
    done = subprocess.run(["sbatch", "--parsable", "--job-name", "rq", "-o", "logs/%x-%j.txt",
                           str(REPO / "sbatch" / "train.sbatch"), "c.yaml"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip().split(";")[0]
    log = work / "logs" / f"rq-{job_id}.txt"
    watch = subprocess.Popen([HPC_MCA, "watch", job_id, "--interval", "0.5"], cwd=tmp_path,
                             env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (log.is_file() and "rank run 2" in log.read_text()):
            assert time.monotonic() < deadline, log.read_text() if log.is_file() else "no log"
            assert slurm.job_state(job_id) not in slurm.TERMINAL_STATES
            time.sleep(0.5)
        subprocess.run(["scancel", job_id], check=True, timeout=60)
        out, err = watch.communicate(timeout=300)
    finally:
        watch.kill()
        slurm.cancel(job_id)
    assert slurm.wait_for_job(job_id, timeout=300) == "CANCELLED"
    final = out.strip().splitlines()[-1]
    status = subprocess.run([HPC_MCA, "status", job_id], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=120)
    head = status.stdout.splitlines()[0]
    as_json = json.loads(subprocess.run([HPC_MCA, "status", job_id, "--json"], cwd=tmp_path,
                                        env=_env(), capture_output=True, text=True,
                                        timeout=120).stdout)
    batch = commands.batch_exit(job_id)
    print(f"\nwatch:  {final}\nstatus: {head}\nsacct batch step {batch}")
    # Item 3: one exit code, the batch step's, in watch's last line and status's head.
    assert batch is not None and batch[1], batch
    assert final.startswith(f"job {job_id} CANCELLED exit {batch[0]} |"), final
    assert f"  rq  CANCELLED exit {batch[0]}  elapsed " in head, head
    # ... and the time of all three runs (sacct's records: start to end of each).
    records = slurm.job_records(job_id)
    assert [r.state for r in records] == ["REQUEUED", "REQUEUED", "CANCELLED"], records
    total = sum(int((_stamp(r.end) - _stamp(r.start))) for r in records)
    assert as_json["total_elapsed_s"] == total and as_json["runs"] == 3, as_json
    assert f"(all 3 runs: {commands.format_duration(total)}, 2 restarts)" in head, head
    # Item 4: logs once Slurm forgot the job (squeue and scontrol stand-ins that no longer
    # know it, as after MinJobAge; sacct is the real one), from a directory with no runs.
    hidden = tmp_path / "forgotten"
    hidden.mkdir()
    for name in ("squeue", "scontrol"):
        (hidden / name).write_text("#!/bin/bash\necho 'Invalid job id specified' >&2\nexit 1\n")
        (hidden / name).chmod(0o755)
    forgotten = _env(PATH=f"{hidden}{os.pathsep}{os.environ['PATH']}")
    shown = subprocess.run([HPC_MCA, "logs", job_id], cwd=tmp_path, env=forgotten,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == log.read_text() and "rank run 2" in shown.stdout
    print(f"logs of the forgotten job: {len(shown.stdout)} characters from {log}")


def _stamp(text: str) -> float:
    import datetime

    return datetime.datetime.fromisoformat(text).timestamp()
