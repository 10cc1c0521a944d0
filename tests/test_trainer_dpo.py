"""Stage dpo in the trainer: the loss and TRL's reward/log-probability metrics do not depend on
the layout, the packing ranks or an interruption, and bad pairwise data stops every rank.

A Llama with weights trains on addition pairs (chosen: the sum, rejected: a near miss).
Unpacked, 4 pairs per step, on TP2, PP2 and DP2; packed (pairs as neighbouring documents) on
CP2; a Qwen3-MoE on EP2; each equals its one-process reference within 1e-5 at every step, eval
included. A run
resumed from its step-4 checkpoint equals the uninterrupted one.
"""

from __future__ import annotations

import json
import math

import pytest
from trainer_fixtures import (
    assert_bad_input_on_every_rank,
    launch_ranks,
    make_model_dir,
    rewind,
    run_train,
    steps,
    write_config,
    write_pairs,
)

pytestmark = pytest.mark.slow

KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
        "logps/chosen", "logps/rejected")
PACKED = ["data.sequence_packing=true", "data.seq_length=64", "data.pack_alignment=4",
          "training.per_device_train_batch_size=1", "training.global_batch_size=4"]



@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    model = make_model_dir(root)
    config = write_config(root, model, write_pairs(root / "train.jsonl", 256, 1),
                          write_pairs(root / "eval.jsonl", 16, 9), finetuning={"stage": "dpo"},
                          training={"save_steps": 4, "eval_steps": 10, "global_batch_size": 4,
                                    "per_device_eval_batch_size": 2})
    refs = {}
    for name, overrides in (("unpacked", []), ("packed", PACKED)):
        proc = run_train(config, root / f"reference_{name}", 1, *overrides)
        assert proc.returncode == 0, proc.stderr[-4000:]
        refs[name] = steps(root / f"reference_{name}")
    return root, config, refs


def _same(got: list[dict], want: list[dict], what: str) -> None:
    assert [s["step"] for s in got] == list(range(1, 11)), what
    for mine, ref in zip(got, want):
        assert mine["pairs"] == ref["pairs"], (what, mine, ref)
        for key in KEYS:
            assert mine[key] == pytest.approx(ref[key], abs=1e-5), (what, key, mine, ref)


def _eval(run) -> dict:
    return json.loads((run / "progress.json").read_text())


def test_reference_logs_the_preference_metrics(setup):
    root, _, refs = setup
    ref = refs["unpacked"]
    assert all(s["pairs"] == 4 for s in ref)
    assert ref[0]["loss"] == pytest.approx(0.693147, abs=1e-6)  # policy = reference at step 1
    assert ref[0]["rewards/margins"] == 0.0
    assert any(s["rewards/chosen"] != 0.0 for s in ref[2:])
    progress = _eval(root / "reference_unpacked")
    assert 0.0 <= progress["eval_rewards_accuracies"] <= 1.0
    assert math.isfinite(progress["eval_loss"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hpc_mca.rundir import tensorboard_dir

    events = EventAccumulator(str(tensorboard_dir(root / "reference_unpacked")))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/rewards/accuracies", "train/logps/rejected", "eval/rewards/margins"} <= tags


@pytest.mark.parametrize("name, overrides", [
    ("tp2", ["parallel.tensor_model_parallel_size=2"]),
    ("pp2", ["parallel.pipeline_model_parallel_size=2"]),
    ("dp2", ["training.per_device_train_batch_size=2"]),
])
def test_dpo_layouts_match_one_process(setup, name, overrides):
    root, config, refs = setup
    proc = run_train(config, root / name, 2, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _same(steps(root / name), refs["unpacked"], name)
    want, got = _eval(root / "reference_unpacked"), _eval(root / name)
    for key in ("eval_loss", "eval_rewards_accuracies", "eval_rewards_margins"):
        assert got[key] == pytest.approx(want[key], abs=1e-5), (name, key)


def test_packed_dpo_on_context_parallel_matches_one_process(setup):
    root, config, refs = setup
    proc = run_train(config, root / "cp2", 2, *PACKED, "parallel.context_parallel_size=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    _same(steps(root / "cp2"), refs["packed"], "cp2")


def test_moe_dpo_on_expert_parallel_matches_one_process(setup, tmp_path):
    """Qwen3-MoE (its load-balancing loss on, normalised per token as in sft): EP2 equals one
    process."""
    root, _, _ = setup
    model = make_model_dir(tmp_path, moe=True)
    config = write_config(tmp_path, model, root / "train.jsonl", finetuning={"stage": "dpo"},
                          training={"max_steps": 6, "global_batch_size": 4})
    for name, nproc in (("one", 1), ("ep2", 2)):
        proc = run_train(config, tmp_path / name, nproc,
                         f"parallel.expert_model_parallel_size={nproc}")
        assert proc.returncode == 0, proc.stderr[-4000:]
    ref, got = steps(tmp_path / "one"), steps(tmp_path / "ep2")
    assert len(ref) == len(got) == 6 and any(s["rewards/chosen"] != 0 for s in ref)
    for mine, want in zip(got, ref):
        for key in KEYS:
            assert mine[key] == pytest.approx(want[key], abs=1e-5), (key, mine, want)


def test_dpo_resumes_exactly(setup):
    root, config, refs = setup
    run = rewind(root / "reference_unpacked", root / "resumed", 4)
    proc = run_train(config, run, 1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "at step 4" in proc.stdout, proc.stdout[-2000:]
    _same(steps(run), refs["unpacked"], "resumed")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert lines and all(" | reward_acc " in line and " | margin " in line for line in lines)


@pytest.mark.parametrize("record, message", [
    ({"instruction": "1+1=", "output": "2"},
     "finetuning.stage='dpo' needs pairwise records ('chosen' and 'rejected' answers)"),
    ({"instruction": "1+1=", "chosen": "2"}, "finetuning.stage='dpo' needs pairwise records "
     "('chosen' and 'rejected' answers); this one has keys ['chosen', 'instruction']"),
])
def test_bad_pairwise_data_stops_every_rank(setup, tmp_path, record, message):
    root, config, _ = setup
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"instruction": "2+2=", "chosen": "4", "rejected": "5"}) + "\n"
                    + json.dumps(record) + "\n")
    if "output" in record:
        data.write_text(json.dumps(record) + "\n")
    ranks = launch_ranks(2, ["train", str(config), f"training.output_dir={tmp_path / 'run'}",
                             f"data.dataset=[{data}]", "data.eval_dataset=null",
                             "training.eval_steps=null", "training.per_device_eval_batch_size=8"])
    line = assert_bad_input_on_every_rank(ranks, message)
    assert str(data) in line
