"""status/logs/tensorboard building blocks without Slurm: the progress file, manifests and
run lookup, status text, log tailing and following, TensorBoard's command line."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest

from hpc_mca.slurm.commands import JobState
from hpc_mca.slurm.errors import OpsError
from hpc_mca.slurm.logs import follow, show, tail_start
from hpc_mca.slurm.manifest import find_run, read_manifest, resolve_runs, run_from_path, write_manifest
from hpc_mca.slurm.progress import read_progress, write_progress
from hpc_mca.slurm.status import RunStatus, format_status, format_table, progress_text
from hpc_mca.slurm.tensorboard import free_port, logdir_args, plan_launch

# --- progress.json ------------------------------------------------------------------------

def test_progress_round_trip_and_trainer_field_names(tmp_path: Path) -> None:
    # What hpc_mca.loop.metrics.MetricsWriter writes.
    write_progress(tmp_path, step=40, max_steps=200, loss=1.5, lr=3e-4, grad_norm=0.9,
                   tokens_per_s=12345.6, eta_s=190.0, skipped_iters=0, eval_loss=1.4,
                   last_checkpoint={"step": 30, "path": "/ck/iter_30", "time": 100.0})
    p = read_progress(tmp_path)
    assert (p.step, p.max_steps, p.loss, p.tokens_per_s, p.eta_s, p.eval_loss) == (
        40, 200, 1.5, 12345.6, 190.0, 1.4)
    assert p.fraction == 0.2 and p.updated is not None
    assert (p.last_checkpoint.step, p.last_checkpoint.path) == (30, "/ck/iter_30")
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("text", ["", "{", '{"step": 3', "[1, 2]", "null", "\x00\x01"])
def test_unreadable_progress_is_none(tmp_path: Path, text: str) -> None:
    (tmp_path / "progress.json").write_text(text)
    assert read_progress(tmp_path) is None
    assert read_progress(tmp_path / "missing") is None


def test_progress_fields_of_the_wrong_type_read_as_none(tmp_path: Path) -> None:
    (tmp_path / "progress.json").write_text(
        '{"step": "12", "max_steps": true, "loss": NaN, "tokens_per_s": [1], '
        '"last_checkpoint": "iter_3", "finished": "yes", "future_field": {"x": 1}}')
    p = read_progress(tmp_path)
    assert (p.step, p.max_steps, p.loss, p.tokens_per_s, p.last_checkpoint, p.finished) == (
        None, None, None, None, None, False)
    assert progress_text(p, now=0).startswith("updated")


def test_progress_aliases_and_eta_from_step_time(tmp_path: Path) -> None:
    (tmp_path / "progress.json").write_text(json.dumps(
        {"step": 10, "total_steps": 30, "step_time_s": 1.5, "time": 50.0}))
    p = read_progress(tmp_path)
    assert (p.max_steps, p.eta_s, p.updated) == (30, 30.0, 50.0)
    (tmp_path / "progress.json").write_text(json.dumps(
        {"step": 30, "max_steps": 30, "eta_s": 99, "finished": True}))
    assert read_progress(tmp_path).eta_s == 0.0


# --- status text --------------------------------------------------------------------------

def _job(state: str = "RUNNING", **kw) -> JobState:
    fields = dict(job_id="7", name="demo", state=state, reason="", elapsed="0:42",
                  time_limit="1:00:00", nodes="2", node_list="n[1-2]", work_dir="/w",
                  exit_code="", requeues=1, source="squeue")
    fields.update(kw)
    return JobState(**fields)


def test_format_status_joins_slurm_and_progress(tmp_path: Path) -> None:
    write_progress(tmp_path, step=40, max_steps=200, loss=1.23456, tokens_per_s=12345.4,
                   eta_s=190, updated=1000.0,
                   last_checkpoint={"step": 30, "path": "/ck/iter_30", "time": 940.0})
    run = run_from_path(tmp_path)
    text = format_status(RunStatus("7", _job(), run, read_progress(tmp_path)), now=1005.0)
    lines = text.splitlines()
    assert lines[0] == ("job 7  demo  RUNNING  elapsed 0:42 of 1:00:00  nodes 2 (n[1-2])  "
                        "requeues 1")
    assert lines[2] == ("  progress    step 40/200 (20%) | loss 1.2346 | tokens/s 12,345 | "
                        "ETA 3m10s | updated 0m05s ago")
    assert lines[3] == "  checkpoint  step 30: /ck/iter_30 (1m05s ago)"
    pending = format_status(RunStatus("8", _job("PENDING", reason="Priority", node_list=""),
                                      None, None))
    assert "PENDING (Priority)" in pending and "no progress reported yet" in pending
    done = format_status(RunStatus("9", _job("COMPLETED", exit_code="0:0"), None, None))
    assert "COMPLETED exit 0:0" in done
    # An old job of a run that a continuation (hpc-mca resume) carries on.
    old = format_status(RunStatus("7", _job("CANCELLED"), run, read_progress(tmp_path), "12",
                                  _job("RUNNING", job_id="12")), now=1005.0).splitlines()
    assert old[1] == "  continued   by job 12 (RUNNING): hpc-mca status 12"
    assert old[3].startswith("  progress    step 40/200 (20%)")


def test_format_table(tmp_path: Path) -> None:
    write_progress(tmp_path, step=3, max_steps=9, loss=2.0, eta_s=60)
    rows = format_table([RunStatus("7", _job(), run_from_path(tmp_path), read_progress(tmp_path)),
                         RunStatus("8", None, None, None)]).splitlines()
    assert rows[0].split() == ["JOBID", "STATE", "STEP", "LOSS", "ETA", "RUN", "DIR"]
    assert rows[1].split()[:5] == ["7", "RUNNING", "3/9", "2.0000", "1m00s"]
    assert rows[2].split() == ["8", "UNKNOWN", "-", "-", "-", "-"]


# --- manifests and finding runs -----------------------------------------------------------

def _manifest(root: Path, name: str, job_id: str, **extra) -> Path:
    run_dir = root / f"{name}_{job_id}"
    run_dir.mkdir(parents=True)
    write_manifest(run_dir, {"job_id": job_id, "job_name": name, "run_dir": str(run_dir),
                             "log": str(run_dir / f"{name}_{job_id}.out"), **extra})
    return run_dir


def test_find_run_by_manifest(tmp_path: Path) -> None:
    first = _manifest(tmp_path, "a b", "11")
    _manifest(tmp_path, "other", "111")
    cont = _manifest(tmp_path, "resumed", "20", job_ids=["31"])
    assert read_manifest(first)["version"] == 1
    run = find_run("11", tmp_path)
    assert (run.run_dir, run.job_id, run.log) == (first, "11", first / "a b_11.out")
    later = find_run("31", tmp_path)  # a continuation job of the same run
    assert (later.run_dir, later.job_id, later.log) == (cont, "31", cont / "resumed_31.out")
    with pytest.raises(OpsError, match="not a Slurm job id"):
        find_run("11; rm -rf /", tmp_path)
    runs = resolve_runs(["11", str(cont)], tmp_path)
    assert [r.run_dir for r in runs] == [first, cont]
    with pytest.raises(OpsError, match="does not exist"):
        resolve_runs([str(tmp_path / "nope")], tmp_path)


# --- logs ---------------------------------------------------------------------------------

def test_tail_and_show(tmp_path: Path) -> None:
    log = tmp_path / "x.out"
    log.write_bytes(b"".join(b"line %d\n" % i for i in range(10)))
    assert log.read_bytes()[tail_start(log, 3):] == b"line 7\nline 8\nline 9\n"
    assert tail_start(log, 50) == 0 and tail_start(log, None) == 0
    out = io.BytesIO()
    show(log, 2, out)
    assert out.getvalue() == b"line 8\nline 9\n"
    with pytest.raises(OpsError, match="does not exist"):
        show(tmp_path / "none.out")


def test_follow_prints_appended_lines_until_the_job_ends(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "job.out"
    ended = threading.Event()
    monkeypatch.setattr("hpc_mca.slurm.logs._final_state", lambda job_id: "COMPLETED")

    def writer() -> None:
        time.sleep(0.2)  # the log appears only once the job starts
        with log.open("ab") as f:
            for i in range(5):
                f.write(b"step %d\n" % i)
                f.flush()
                time.sleep(0.05)
        ended.set()

    thread = threading.Thread(target=writer)
    thread.start()
    out = io.BytesIO()
    state = follow(log, "5", out=out, poll_s=0.02, state_every_s=0.05,
                   job_finished=lambda job_id: ended.is_set())
    thread.join()
    assert state == "COMPLETED"
    assert out.getvalue() == b"".join(b"step %d\n" % i for i in range(5))


# --- tensorboard --------------------------------------------------------------------------

def test_tensorboard_command_line(tmp_path: Path) -> None:
    a, b = _manifest(tmp_path, "x:y", "1"), _manifest(tmp_path, "z", "2")
    runs = resolve_runs(["1", "2"], tmp_path)
    assert logdir_args([], tmp_path) == ["--logdir", str(tmp_path)]
    assert logdir_args(runs[:1], tmp_path) == ["--logdir", str(a)]
    # The trainer's event files: TensorBoard names the run after the directory below
    # <run dir>/tensorboard, which is the run dir's name.
    (b / "tensorboard" / b.name).mkdir(parents=True)
    assert logdir_args(runs[1:], tmp_path) == ["--logdir", f"{b}/tensorboard"]
    assert logdir_args(runs, tmp_path) == ["--logdir_spec", f"{a},{b}/tensorboard"]
    launch = plan_launch(runs[:1], tmp_path, port=16006)
    assert launch.argv[1:7] == ["-m", "tensorboard.main", "--host", "127.0.0.1", "--port",
                                "16006"]
    assert launch.tunnel.startswith("ssh -N -L 16006:127.0.0.1:16006 ")
    assert 1024 < free_port() < 65536


def test_the_job_index_finds_runs_from_anywhere(tmp_path: Path, monkeypatch) -> None:
    from hpc_mca.slurm.index import indexed_run_dir, record_job, state_dir

    monkeypatch.setenv("HPC_MCA_STATE_DIR", str(tmp_path / "state"))
    assert state_dir() == tmp_path / "state" and indexed_run_dir("5") is None
    elsewhere = _manifest(tmp_path / "elsewhere", "far", "5")
    record_job("5", elsewhere)
    record_job("6", tmp_path / "gone")  # removed since: ignored
    record_job("7", tmp_path / "a\tb")  # cannot be one line of the index: not written
    assert indexed_run_dir("5") == elsewhere and indexed_run_dir("6") is None
    assert "a\tb" not in (tmp_path / "state" / "runs.tsv").read_text()
    # Found from another runs root; a reused job id whose manifest names other jobs is not.
    assert find_run("5", tmp_path / "empty_root").run_dir == elsewhere
    record_job("99999981", elsewhere)
    assert indexed_run_dir("99999981") == elsewhere
    with pytest.raises(OpsError):
        find_run("99999981", tmp_path / "empty_root")  # (Slurm does not know it either)
