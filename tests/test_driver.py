"""The run loop both backends share (hpc_mca/loop/driver.py), driven by a scripted backend.

One real gloo process group of one rank (the boundary's agreement and the non-finite flag are
all-reduces), a real MetricsWriter writing steps.jsonl and progress.json, transformers' own
CallbackHandler. The backends' use of it is covered end to end by test_standard.py,
test_trainer_parity.py and test_checkpoint.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers.trainer_callback import CallbackHandler, TrainerCallback, TrainerControl, TrainerState

from hpc_mca.checkpoint.requeue import StopSignal
from hpc_mca.loop.boundary import Decision, StepBoundary
from hpc_mca.loop.callbacks import StepFlowCallback
from hpc_mca.loop.driver import RunLoop, any_non_finite
from hpc_mca.loop.metrics import MetricsWriter
from hpc_mca.loop.records import StepResult
from hpc_mca.rundir import PROGRESS_FILE, STEPS_FILE


class Args:
    """What callbacks read of the run's arguments."""

    logging_steps, eval_steps = 2, 3


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", state.global_step))

    def on_evaluate(self, args, state, control, **kwargs):
        self.events.append(("evaluate", state.global_step))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step))


class ScriptedBackend:
    """A backend whose steps are given: losses 1/step, step 3 skipped (non-finite)."""

    def __init__(self, max_steps: int) -> None:
        self.state = TrainerState(max_steps=max_steps)
        self.control = TrainerControl()
        self.saved: list[tuple[int, str]] = []

    def step(self, handler: CallbackHandler) -> StepResult:
        self.state.global_step += 1
        self.control = handler.on_step_end(Args(), self.state, self.control)
        step = self.state.global_step
        return StepResult(loss=1.0 / step, tokens=10, input_tokens=12,
                          grad_norm=float("nan") if step == 3 else 0.5, skipped=step == 3,
                          metrics={"extra": float(step)})

    def learning_rate(self) -> float:
        return 0.1 * self.state.global_step

    def eval_metrics(self) -> dict[str, float]:
        return {"eval/loss": 2.0}

    def save(self, decision: Decision) -> None:
        self.saved.append((self.state.global_step, decision.reason))


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HPC_MCA_SIGNAL_FILE", raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _loop(tmp_path: Path, max_steps: int, recorder: Recorder) -> tuple[RunLoop, ScriptedBackend]:
    backend = ScriptedBackend(max_steps)
    flow = StepFlowCallback(True, Args.logging_steps, Args.eval_steps)
    handler = CallbackHandler([flow, recorder], None, None, None, None)
    metrics = MetricsWriter(tmp_path, True, [], max_steps, 1.0, 1)
    boundary = StepBoundary(4, max_steps, StopSignal(tmp_path, torch.device("cpu"), True), True)
    loop = RunLoop(backend, events=handler, args=Args(), metrics=metrics, boundary=boundary,
                   device=torch.device("cpu"), unit="tokens", skipped_iters=5)
    return loop, backend


def test_the_step_end_records_logs_evaluates_saves_and_finishes(group, tmp_path, capsys):
    recorder = Recorder()
    loop, backend = _loop(tmp_path, 6, recorder)
    (tmp_path / STEPS_FILE).write_text('{"step": 99}\n')  # a fresh run starts it afresh
    try:
        loop.begin(0, job_id="7", restart_count=0)
        loop.run(lambda: backend.step(loop.events))
        loop.finish()
    finally:
        loop.close()
    lines = [json.loads(line) for line in (tmp_path / STEPS_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert lines[0] == {"step": 1, "loss": 1.0, "tokens": 10, "input_tokens": 12, "grad_norm": 0.5,
                        "lr": 0.1, "skipped": False, "seconds": lines[0]["seconds"], "extra": 1.0}
    assert [line["skipped"] for line in lines] == [False, False, True, False, False, False]
    assert loop.skipped_iters == 6  # 5 before this process, 1 here
    assert recorder.events == [("log", 2), ("evaluate", 3), ("log", 4), ("save", 4), ("log", 6),
                               ("evaluate", 6), ("save", 6)]
    assert backend.saved == [(4, "interval"), (6, "end")]
    assert [len(loop.history), loop.requeue] == [6, False]
    logged = backend.state.log_history
    assert [entry["step"] for entry in logged] == [2, 4, 6]
    assert logged[-1]["skipped_iters"] == 6.0 and logged[-1]["extra"] == 6.0
    progress = json.loads((tmp_path / PROGRESS_FILE).read_text())
    assert (progress["step"], progress["finished"], progress["eval_loss"]) == (6, True, 2.0)
    assert "eval/loss 2.0000" in capsys.readouterr().out


def test_a_signal_saves_and_stops_for_a_requeue(group, tmp_path):
    recorder = Recorder()
    loop, backend = _loop(tmp_path, 10, recorder)

    def step() -> StepResult:
        if backend.state.global_step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return backend.step(loop.events)

    try:
        loop.begin(0, job_id=None, restart_count=0)
        loop.run(step)
        loop.finish()
    finally:
        loop.close()
    assert backend.saved == [(2, "signal")]
    assert loop.requeue and backend.state.global_step == 2
    assert json.loads((tmp_path / PROGRESS_FILE).read_text())["finished"] is False


def test_any_non_finite_reads_every_sum(group):
    cpu = torch.device("cpu")
    assert not any_non_finite([torch.tensor(1.0), torch.tensor(-3.0)], cpu)
    assert any_non_finite([torch.tensor(1.0), torch.tensor(math.inf)], cpu)
    assert any_non_finite([torch.tensor(math.nan)], cpu)
