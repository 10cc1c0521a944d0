"""The run's counters (hpc_mca/loop/counters.py): one torch ``Stateful`` the backends advance
and a checkpoint saves and restores as a unit.

The object itself (no torch process group), then a real save and resume on each backend (1
rank, CPU): a run whose step 2 is skipped (a callback poisons its gradients) saves at step 2;
the resumed run must start from that checkpoint's step, samples and skipped-step count, so its
own checkpoint at step 4 still counts the skipped step and has consumed 4 global batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.checkpoint.stateful import Stateful
from trainer_fixtures import make_model_dir, make_sft_data, run_ranks, steps, write_config

from hpc_mca.checkpoint.store import CheckpointInfo, read_info
from hpc_mca.loop.counters import RunCounters


def test_the_counters_are_one_stateful_unit():
    counters = RunCounters(max_steps=3)
    assert isinstance(counters, Stateful)
    counters.step_taken(8, skipped=False)
    counters.step_taken(8, skipped=True)
    counters.requeue = True
    saved = counters.state_dict()
    assert saved == {"global_step": 2, "consumed_samples": 16, "skipped_iters": 1}
    # The run's length and this process's requeue are not saved: a resumed run may be longer.
    resumed = RunCounters(max_steps=5)
    resumed.load_state_dict(saved)
    assert resumed == RunCounters(max_steps=5, global_step=2, consumed_samples=16, skipped_iters=1)
    assert not resumed.at_end and not resumed.requeue
    resumed.step_taken(8, skipped=False)
    assert resumed.state_dict() != saved  # a copy was saved, not the live counters
    with pytest.raises(KeyError, match="skipped_iters"):
        RunCounters(max_steps=5).load_state_dict({"global_step": 2, "consumed_samples": 16})


def test_checkpoint_json_holds_the_counters_under_its_own_names():
    counters = RunCounters(max_steps=9, global_step=6, consumed_samples=48, skipped_iters=2)
    records = {"model": {"hidden_size": 64}, "layout": {"dp": 2}, "training": {"seed": 7}}
    info = CheckpointInfo.of_save(counters.state_dict(), records, reason="interval", job_id="7",
                                  restart_count=1)
    written = json.loads(info.to_json())
    assert (written["step"], written["consumed_samples"], written["skipped_iters"]) == (6, 48, 2)
    assert written["layout"] == {"dp": 2} and written["reason"] == "interval"
    assert CheckpointInfo.from_dict(written).counters == counters.state_dict()


POISON = """\
import sys

from transformers import TrainerCallback

from hpc_mca.launch.run import run_training


class Poison(TrainerCallback):
    '''Step 2's gradients not finite: the step is skipped (no update) and counted.'''

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step != 1:
            return
        if isinstance(model, list):  # Megatron: the DDP chunks, reduced gradients in their buffers
            model[0].buffers[0].grad_data[0] = float("nan")
        else:
            next(model.parameters()).grad.view(-1)[0] = float("nan")


run_training(sys.argv[1], sys.argv[2:], callbacks=[Poison()])
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("counters")
    config = write_config(root, make_model_dir(root, layers=2), make_sft_data(root, 64, seed=1, name="train"),
                          training={"save_steps": 2, "logging_steps": 1, "report_to": ["none"]})
    script = root / "poison.py"
    script.write_text(POISON)
    return {"root": root, "config": config, "script": script}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["megatron", "standard"])
def test_the_counters_round_trip_through_a_save_and_resume(setup, backend):
    run = setup["root"] / backend
    common = [setup["script"], setup["config"], f"training.output_dir={run}",
              f"training.use_mca={str(backend == 'megatron').lower()}"]
    first = run_ranks(1, [*common, "training.max_steps=2"], timeout=300)
    assert first.returncode == 0, first.stderr[-4000:]
    saved = read_info(run / "checkpoints" / "iter_0000002")
    assert saved.counters == {"global_step": 2, "consumed_samples": 16, "skipped_iters": 1}
    if backend == "megatron":  # the same counters, as one entry of the torch_dist common state
        from megatron.core.dist_checkpointing import load_common_state_dict

        assert load_common_state_dict(str(run / "checkpoints" / "iter_0000002"))["trainer"] == saved.counters

    resumed = run_ranks(1, [*common, "training.max_steps=4"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "at step 2 (16 samples)" in resumed.stdout
    final = read_info(run / "checkpoints" / "iter_0000004")
    assert final.counters == {"global_step": 4, "consumed_samples": 32, "skipped_iters": 1}
    assert [s["skipped"] for s in steps(run)] == [False, True, False, False]
    progress = json.loads((run / "progress.json").read_text())
    assert (progress["step"], progress["skipped_iters"], progress["finished"]) == (4, 1, True)
