"""The step boundary (hpc_mca/trainer/boundary.py): when a step ends with a save, a stop or both.

One real gloo process group of one rank (the decision's agreement is an all-reduce); signals
are real SIGUSR1/SIGTERM to this process, and the batch shell's record is a real signal file.
The multi-rank agreement and the saves themselves are covered on the local Slurm cluster
(test_requeue.py, test_operator_control.py).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers.trainer_callback import TrainerControl

from hpc_mca.checkpoint.requeue import StopSignal
from hpc_mca.loop.boundary import Decision, StepBoundary
from hpc_mca.loop.counters import RunCounters


def at(step: int) -> RunCounters:
    """The counters of a 10-step run at the end of ``step``."""
    return RunCounters(max_steps=10, global_step=step)


@pytest.fixture
def boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HPC_MCA_SIGNAL_FILE", raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    stop = StopSignal(tmp_path, torch.device("cpu"), is_main=True)
    try:
        yield StepBoundary(save_steps=4, signal=stop, is_main=True)
    finally:
        stop.restore()
        dist.destroy_process_group()


def test_interval_last_step_and_callback_requests(boundary: StepBoundary):
    decide = [boundary.decide(at(step), TrainerControl()) for step in range(1, 11)]
    assert [step for step, d in enumerate(decide, 1) if d.save] == [4, 8, 10]
    assert [d.reason for d in decide if d.save] == ["interval", "interval", "end"]
    assert [step for step, d in enumerate(decide, 1) if d.stop] == [10]
    assert not decide[-1].requeue  # the last step finishes the run
    assert boundary.decide(at(3), TrainerControl(should_save=True)) == Decision(True, False, "callback")
    # A callback's early stop ends the run there (saved, finished: not for a requeue).
    early = boundary.decide(at(3), TrainerControl(should_training_stop=True))
    assert (early.save, early.stop, early.reason, early.requeue) == (True, True, "end", False)


@pytest.mark.parametrize("name", ["USR1", "TERM"])
def test_a_signal_to_the_rank_saves_and_stops_for_a_requeue(boundary: StepBoundary, capsys, name):
    assert not boundary.decide(at(1), TrainerControl()).save
    os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
    decision = boundary.decide(at(2), TrainerControl())
    assert (decision.save, decision.stop, decision.reason, decision.requeue) == (True, True, "signal", True)
    assert decision.stop_time is not None
    assert f"stop requested by {name}" in capsys.readouterr().out


def test_the_batch_shells_record_stops_and_dates_the_request(boundary: StepBoundary):
    boundary.signal.signal_file.write_text("USR1 1700000000.5 job=7 restart=0\n")
    decision = boundary.decide(at(3), TrainerControl())
    assert decision.requeue and decision.stop_time == 1700000000.5


def test_a_signal_with_the_last_step_finishes_the_run(boundary: StepBoundary):
    boundary.signal.signal_file.write_text("USR1 1700000000.5 job=7 restart=0\n")
    decision = boundary.decide(at(10), TrainerControl())
    assert (decision.save, decision.stop, decision.reason, decision.requeue) == (True, True, "end", False)
