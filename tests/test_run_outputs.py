"""What a finished run leaves in output_dir besides the model (hpc_mca/loop/outputs.py): the
files transformers' Trainer and LLaMA-Factory's workflow write there, read back by their own
readers (transformers' ``TrainerState.load_from_json``, LLaMA-Factory's ``plot_loss``).

The end-to-end check (a real run leaves them, with the model) is tests/test_lf_examples.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_mca.loop.outputs import JobSpan, RunSummary, write_run_outputs
from hpc_mca.rundir import EVALS_FILE, STEPS_FILE


def _summary(**changes: object) -> RunSummary:
    fields: dict = dict(global_step=6, max_steps=6, steps_per_epoch=2, num_train_epochs=3.0,
                        logging_steps=2, eval_steps=3, save_steps=500, train_batch_size=1,
                        consumed_samples=48, flops_per_token=100.0,
                        job=JobSpan(first_step=2, seconds=8.0))
    fields.update(changes)
    return RunSummary(**fields)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A requeued run's records: steps 1-4 of the first job, then steps 3-6 again (the second
    job resumed from step 2's checkpoint; its records of 3 and 4 win), and two evaluations."""
    lines = [{"step": s, "loss": 10.0 - s, "lr": 0.1 * s, "grad_norm": 1.0, "input_tokens": 10}
             for s in (1, 2, 3, 4)]
    lines += [{"step": s, "loss": 5.0 - s / 2, "lr": 0.1 * s, "grad_norm": 2.0, "input_tokens": 10}
              for s in (3, 4, 5, 6)]
    (tmp_path / STEPS_FILE).write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 7, "lo')
    (tmp_path / EVALS_FILE).write_text(json.dumps({"step": 3, "eval_loss": 2.5}) + "\n"
                                       + json.dumps({"step": 6, "eval_loss": 2.0, "eval_accuracy": 0.5}) + "\n")
    return tmp_path


def test_train_metrics_cover_this_jobs_steps(run_dir: Path) -> None:
    train = write_run_outputs(run_dir, _summary())
    saved = json.loads((run_dir / "train_results.json").read_text())
    assert saved == train
    # Steps 3..6 trained by this job (resumed at 2), with the later records of 3 and 4.
    assert train["train_loss"] == pytest.approx(sum(5.0 - s / 2 for s in (3, 4, 5, 6)) / 4)
    assert train["epoch"] == 3.0
    assert train["train_runtime"] == 8.0
    assert train["train_steps_per_second"] == 0.5  # 4 steps in 8 s
    assert train["train_samples_per_second"] == 4.0  # 48 samples over 6 steps: 32 in 8 s
    assert train["total_flos"] == 100.0 * 10 * 6  # every step of the run, each once
    results = json.loads((run_dir / "all_results.json").read_text())
    assert results == {**train, "eval_loss": 2.0, "eval_accuracy": 0.5}
    assert json.loads((run_dir / "eval_results.json").read_text()) == {
        "eval_loss": 2.0, "eval_accuracy": 0.5, "epoch": 3.0}


def test_trainer_state_reads_back_as_transformers_state(run_dir: Path) -> None:
    from transformers.trainer_callback import TrainerState

    write_run_outputs(run_dir, _summary())
    state = TrainerState.load_from_json(str(run_dir / "trainer_state.json"))
    assert (state.global_step, state.max_steps, state.logging_steps, state.num_train_epochs) == (6, 6, 2, 3)
    train_logs = [e for e in state.log_history if "loss" in e]
    assert [e["step"] for e in train_logs] == [2, 4, 6]  # every logging_steps, and the last
    assert [e["loss"] for e in train_logs] == [8.0, 3.0, 2.0]
    assert train_logs[0] == {"loss": 8.0, "grad_norm": 1.0, "learning_rate": 0.2, "epoch": 1.0, "step": 2}
    evals = [e for e in state.log_history if "eval_loss" in e]
    assert [(e["step"], e["eval_loss"], e["epoch"]) for e in evals] == [(3, 2.5, 1.5), (6, 2.0, 3.0)]
    assert "train_runtime" in state.log_history[-1] and state.log_history[-1]["step"] == 6


def test_llamafactorys_plot_reads_it(run_dir: Path) -> None:
    """LLaMA-Factory's own plot_loss draws training_loss.png and training_eval_loss.png from
    the trainer_state.json written here."""
    import lf_peer  # noqa: F401  (LLaMA-Factory importable: its stubs)
    from llamafactory.extras.ploting import plot_loss

    write_run_outputs(run_dir, _summary())
    plot_loss(str(run_dir), keys=["loss", "eval_loss"])
    for name in ("training_loss.png", "training_eval_loss.png"):
        assert (run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def test_a_run_resumed_at_its_end_reports_no_loss(tmp_path: Path) -> None:
    """A job that trained nothing (resumed after the last step) writes no train_loss, not NaN,
    and its files stay valid JSON."""
    (tmp_path / STEPS_FILE).write_text(json.dumps({"step": 1, "loss": 1.0, "lr": 0.1}) + "\n")
    train = write_run_outputs(tmp_path, _summary(global_step=1, max_steps=1, steps_per_epoch=1,
                                                 job=JobSpan(first_step=1, seconds=0.0)))
    assert "train_loss" not in train and train["train_steps_per_second"] == 0.0
    for name in ("trainer_state.json", "train_results.json", "all_results.json"):
        json.loads((tmp_path / name).read_text(), parse_constant=_no_constant)
    assert not (tmp_path / "eval_results.json").exists()
