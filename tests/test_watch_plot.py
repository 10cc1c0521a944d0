"""hpc-mca plot and the watch views, without Slurm (tests/test_watch_slurm.py has the jobs).

The watch tests feed the views JobState values built here and progress.json files written
here: they check the rendering and the stop rule; the Slurm side (squeue, sacct) is exercised
on the real local cluster only.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_mca.slurm.commands import TERMINAL_STATES, JobState
from hpc_mca.slurm.plot import panels, read_curves
from hpc_mca.slurm.progress import read_progress, write_progress
from hpc_mca.slurm.watch import EXIT_STATUS, BarView, LineView, Snapshot, follow

HPC_MCA = str(Path(sys.executable).with_name("hpc-mca"))


def _job(state: str, reason: str = "", exit_code: str = "", requeues: int = 0) -> JobState:
    return JobState("42", "tiny", state, reason, "0:05", "10:00", "1", "n1", "/w", exit_code,
                    requeues, "squeue")


def _write_run(run_dir: Path, steps: int = 30, dpo: bool = False, mtp: bool = False,
               tensorboard: bool = True) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "steps.jsonl", "w") as out:
        for step in range(1, steps + 1):
            record = {"step": step, "loss": 2.0 / step ** 0.5, "tokens": 100,
                      "input_tokens": 400, "grad_norm": 1.0 / step, "lr": 1e-3 * step / steps,
                      "skipped": False, "seconds": 0.1 + 0.01 * (step % 3)}
            if mtp:
                record.update(mtp_loss_1=2.5 / step ** 0.5, mtp_loss_2=2.8 / step ** 0.5)
            if dpo:
                record.pop("tokens")
                record.update({"pairs": 4, "rewards/chosen": 0.01 * step,
                               "rewards/rejected": -0.01 * step, "rewards/margins": 0.02 * step,
                               "rewards/accuracies": min(1.0, step / steps),
                               "logps/chosen": -20 + step, "logps/rejected": -25 - step})
            out.write(json.dumps(record) + "\n")
        out.write('{"step": 31, "lo')  # a torn last line: the trainer is appending
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(run_dir / "tensorboard" / run_dir.name))
        for step in range(10, steps + 1, 10):
            writer.add_scalar("eval/loss", 1.8 / step ** 0.5, step)
            writer.add_scalar("eval/accuracy", step / steps, step)
            writer.add_scalar("train/loss", 9.9, step)  # steps.jsonl is the train source
        writer.close()


def _png(path: Path):
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def test_plot_writes_a_png_of_loss_eval_lr_and_throughput(tmp_path: Path) -> None:
    run_dir = tmp_path / "sft_7"
    _write_run(run_dir)
    out = tmp_path / "out" / "curves.png"
    done = subprocess.run([HPC_MCA, "plot", str(run_dir), "-o", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (f"wrote {out}: loss, accuracy, learning rate, "
                                   "throughput (input tokens/s), grad norm")
    image = _png(out)
    assert image.shape[:2] == (1020, 1200)  # 12 x 10.2 inches (3 rows of 3.4) at 100 dpi
    # Not blank: many distinct colours, and plenty of non-white pixels (the curves).
    rgb = image[..., :3].reshape(-1, 3)
    assert len({tuple(px) for px in rgb[::7].round(2).tolist()}) > 20
    assert (rgb.min(axis=1) < 0.9).mean() > 0.02


def test_plot_reads_the_eval_history_from_tensorboard_and_steps_last_write_wins(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "r_1"
    _write_run(run_dir)
    # A requeued run redoes step 30: its record supersedes the first one.
    with open(run_dir / "steps.jsonl", "a") as out:
        out.write("\n" + json.dumps({"step": 30, "loss": 0.123, "lr": 1e-3}) + "\n")
    curves = read_curves(run_dir)
    assert sorted(curves.evals["eval/loss"]) == [10, 20, 30]
    assert curves.evals["eval/accuracy"][30] == pytest.approx(1.0)
    assert "train/loss" not in curves.evals
    assert curves.steps["loss"][30] == 0.123 and len(curves.steps["loss"]) == 30
    assert curves.steps["input_tokens_per_s"][3] == pytest.approx(400 / 0.1)


def test_plot_adds_mtp_and_dpo_panels_when_the_run_has_them(tmp_path: Path) -> None:
    mtp = [p.title for p in panels(read_curves(_run(tmp_path / "mtp_1", mtp=True)))]
    assert "MTP losses" in mtp and "DPO rewards" not in mtp
    dpo = panels(read_curves(_run(tmp_path / "dpo_1", dpo=True, tensorboard=False)))
    titles = [p.title for p in dpo]
    assert titles == ["loss", "accuracy", "learning rate", "throughput (input tokens/s)",
                      "grad norm", "DPO rewards", "DPO log-probs"]
    rewards = dict((label, s) for label, s, _ in dpo[titles.index("DPO rewards")].lines)
    assert sorted(rewards) == ["rewards/chosen", "rewards/margins", "rewards/rejected"]
    out = tmp_path / "dpo.png"
    done = subprocess.run([HPC_MCA, "plot", str(tmp_path / "dpo_1"), "-o", str(out), "--dpi",
                           "50"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _png(out).shape[:2] == (680, 600)


def _run(run_dir: Path, **kwargs) -> Path:
    _write_run(run_dir, **kwargs)
    return run_dir


def test_plot_errors_name_the_bad_run(tmp_path: Path) -> None:
    empty = tmp_path / "empty_3"
    empty.mkdir()
    done = subprocess.run([HPC_MCA, "plot", str(empty)], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr == (f"Error: run directory '{empty}' has no steps.jsonl; valid: the run "
                           "directory (or job id) of a run that has trained at least one step\n")
    done = subprocess.run([HPC_MCA, "plot", "999999", "--runs-root", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith("Error: no run found for job 999999")
    assert len(done.stderr.splitlines()) == 1


def _script(run_dir: Path, states: list[tuple[JobState, dict | None]]):
    """A poll function: each call writes the next progress.json (when given) and returns the
    next job state with the progress read back through read_progress."""
    queue = list(states)

    def poll() -> Snapshot:
        job, fields = queue.pop(0)
        if fields is not None:
            write_progress(run_dir, **fields)
        return Snapshot("42", job, read_progress(run_dir))
    return poll


def _timeline(run_dir: Path, final: JobState) -> list[tuple[JobState, dict | None]]:
    step = {"max_steps": 10, "loss": 1.5, "tokens_per_s": 12345.6, "eta_s": 65}
    return [(_job("PENDING", "Priority"), None),
            (_job("PENDING", "Resources"), None),
            (_job("RUNNING"), None),
            (_job("RUNNING"), {"step": 4, **step}),
            (_job("RUNNING"), {"step": 4, **step}),  # nothing moved: no line
            (_job("RUNNING"), {"step": 10, **step, "eval_loss": 1.25, "eta_s": 0,
                               "finished": True, "restart_count": 1}),
            (final, None)]


def test_watch_prints_one_line_per_change_off_a_terminal(tmp_path: Path) -> None:
    out, sleeps = io.StringIO(), []
    last = follow(_script(tmp_path, _timeline(tmp_path, _job("COMPLETED", exit_code="0:0"))),
                  LineView(out), interval=2.0, sleep=sleeps.append)
    assert out.getvalue().splitlines() == [
        "job 42 PENDING (Priority) | requeues 0",
        "job 42 PENDING (Resources) | requeues 0",
        "job 42 RUNNING | requeues 0",
        "job 42 RUNNING | step 4/10 (40%) | loss 1.5000 | tokens/s 12,346 | ETA 1m05s | requeues 0",
        "job 42 RUNNING | step 10/10 (100%) | loss 1.5000 | eval loss 1.2500 | tokens/s 12,346 "
        "| finished | requeues 1",
        "job 42 COMPLETED exit 0:0 | step 10/10 (100%) | loss 1.5000 | eval loss 1.2500 | "
        "tokens/s 12,346 | finished | requeues 1",
    ]
    assert "\r" not in out.getvalue()
    assert sleeps == [2.0] * 6 and last.exit_status == 0


def test_watch_bar_redraws_in_place_and_ends_with_the_final_state(tmp_path: Path) -> None:
    out = io.StringIO()
    last = follow(_script(tmp_path, _timeline(tmp_path, _job("FAILED", exit_code="2:0"))),
                  BarView(out), interval=0.1, sleep=lambda s: None)
    text = out.getvalue()
    assert "\rjob 42 PENDING (Priority) | requeues 0" in text
    assert "\rjob 42 RUNNING  40%|" in text and "| step 4/10 | loss 1.5000" in text
    assert "ETA 1m05s | requeues 0" in text
    assert text.endswith("\njob 42 FAILED exit 2:0 | step 10/10 (100%) | loss 1.5000 | eval "
                         "loss 1.2500 | tokens/s 12,346 | finished | requeues 1\n")
    assert last.exit_status == EXIT_STATUS["FAILED"] == 3


def test_every_final_state_has_a_distinct_documented_failure_status() -> None:
    assert set(EXIT_STATUS) == TERMINAL_STATES and EXIT_STATUS["COMPLETED"] == 0
    assert all(code >= 3 for state, code in EXIT_STATUS.items() if state != "COMPLETED")
    done = subprocess.run([HPC_MCA, "watch", "--help"], capture_output=True, text=True)
    for state, code in EXIT_STATUS.items():
        assert f"{code} " in done.stdout and state in done.stdout.replace("\n", " ")
