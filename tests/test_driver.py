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
from hpc_mca.loop.counters import RunCounters
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

    def __init__(self, counters: RunCounters) -> None:
        self.counters = counters
        self.state = TrainerState(max_steps=counters.max_steps)
        self.control = TrainerControl()
        self.saved: list[tuple[int, str]] = []

    def step(self, handler: CallbackHandler) -> StepResult:
        skipped = self.counters.global_step + 1 == 3
        self.counters.step_taken(8, skipped=skipped)
        self.state.global_step = self.counters.global_step
        self.control = handler.on_step_end(Args(), self.state, self.control)
        step = self.state.global_step
        return StepResult(loss=1.0 / step, tokens=10, input_tokens=12,
                          grad_norm=float("nan") if skipped else 0.5, skipped=skipped,
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


def _loop(tmp_path: Path, max_steps: int, recorder: Recorder, listen: bool = True) -> tuple[RunLoop, ScriptedBackend]:
    counters = RunCounters(max_steps, skipped_iters=5)  # 5 skipped before this process
    backend = ScriptedBackend(counters)
    flow = StepFlowCallback(True, Args.logging_steps, Args.eval_steps)
    handler = CallbackHandler([flow, recorder], None, None, None, None)
    metrics = MetricsWriter(tmp_path, True, [], max_steps, 1.0, 1)
    boundary = StepBoundary(4, StopSignal(tmp_path, torch.device("cpu"), True, listen=listen), True)
    loop = RunLoop(backend, counters=counters, boundary=boundary, events=handler, args=Args(),
                   metrics=metrics, device=torch.device("cpu"), unit="tokens")
    return loop, backend


def test_the_step_end_records_logs_evaluates_saves_and_finishes(group, tmp_path, capsys):
    recorder = Recorder()
    loop, backend = _loop(tmp_path, 6, recorder)
    (tmp_path / STEPS_FILE).write_text('{"step": 99}\n')  # a fresh run starts it afresh
    try:
        loop.begin(job_id="7", restart_count=0)
        loop.run(lambda: backend.step(loop.events))
        loop.finish()
    finally:
        loop.close()
    lines = [json.loads(line) for line in (tmp_path / STEPS_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert lines[0] == {"step": 1, "loss": 1.0, "tokens": 10, "input_tokens": 12, "grad_norm": 0.5,
                        "lr": 0.1, "skipped": False, "seconds": lines[0]["seconds"], "extra": 1.0}
    assert [line["skipped"] for line in lines] == [False, False, True, False, False, False]
    assert loop.counters.skipped_iters == 6  # 5 before this process, 1 here
    assert loop.counters.state_dict() == {"global_step": 6, "consumed_samples": 48, "skipped_iters": 6}
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
        loop.begin(job_id=None, restart_count=0)
        loop.run(step)
        loop.finish()
    finally:
        loop.close()
    assert backend.saved == [(2, "signal")]
    assert loop.requeue and loop.counters.requeue and backend.state.global_step == 2
    assert json.loads((tmp_path / PROGRESS_FILE).read_text())["finished"] is False


def test_any_non_finite_reads_every_sum(group):
    cpu = torch.device("cpu")
    assert not any_non_finite([torch.tensor(1.0), torch.tensor(-3.0)], cpu)
    assert any_non_finite([torch.tensor(1.0), torch.tensor(math.inf)], cpu)
    assert any_non_finite([torch.tensor(math.nan)], cpu)


def test_the_step_end_refuses_a_step_the_counters_did_not_count(group, tmp_path):
    """transformers' record (what callbacks read) and the run's counters (what is saved)
    advance together; a backend that moved only one of them is stopped at its step end."""
    loop, backend = _loop(tmp_path, 6, Recorder())
    try:
        loop.begin(job_id=None, restart_count=0)
        backend.state.global_step += 1
        with pytest.raises(RuntimeError, match="TrainerState is at step 1, the run's counters at 0"):
            loop.end_step(StepResult(loss=1.0, tokens=10, input_tokens=12, grad_norm=0.5, skipped=False))
    finally:
        loop.close()


def test_a_boundary_made_without_listening_takes_the_signals_when_the_loop_listens(group, tmp_path):
    """The Megatron trainer makes its boundary with the trainer and listens from train() on: a
    trainer that is made and never trained leaves SIGUSR1/SIGTERM as they were."""
    loop, _ = _loop(tmp_path, 6, Recorder(), listen=False)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    try:
        loop.listen()
        assert signal.getsignal(signal.SIGUSR1) == loop.boundary.signal._on_signal
    finally:
        loop.close()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
