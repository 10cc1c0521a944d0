"""Epochs counted as transformers' Trainer counts them: ``ceil(rows / global_batch_size)`` steps
per epoch, every row trained, the last step a partial global batch.

* the run length equals the one transformers' own Trainer computes for the same rows, batch
  sizes, accumulation, data-parallel size and (fractional) epochs;
* the sampler visits each row of an epoch once (plus DistributedSampler's padding to the DP
  size), and a resume at any step boundary continues with the uninterrupted run's rows;
* both backends, 2 gloo ranks, 9 rows in global batches of 8: 2 steps an epoch (the second of
  one micro-batch of one row per rank), and a resume from the mid-epoch step-3 checkpoint
  (after a partial step) gives the uninterrupted run's losses.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from trainer_fixtures import make_model_dir, make_sft_data, rewind, run_train, steps, write_config

from hpc_mca.config.run_length import total_training_steps
from hpc_mca.config.sections import TrainingArguments
from hpc_mca.data.sampler import DataSampler

CASES = [  # rows, DP size, micro-batch, accumulation, epochs
    (11, 1, 1, 4, 3.0), (11, 2, 2, 1, 3.0), (9, 2, 2, 2, 2.5), (100, 4, 3, 2, 1.0),
    (3, 4, 1, 1, 2.0), (7, 3, 2, 3, 0.5), (64, 2, 4, 2, 1.7), (1, 1, 2, 2, 4.0),
]


def _transformers_count(tmp_path, rows: int, dp: int, mbs: int, ga: int, epochs: float) -> tuple[int, int]:
    """(max_steps, steps per epoch) of transformers' Trainer over ``rows`` rows, from its own
    methods; the loader one of ``dp`` ranks gets, sharded by accelerate as under DDP."""
    import torch
    from accelerate.data_loader import prepare_data_loader
    from transformers import Trainer
    from transformers import TrainingArguments as HFArguments

    args = HFArguments(output_dir=str(tmp_path), per_device_train_batch_size=mbs, gradient_accumulation_steps=ga,
                       num_train_epochs=epochs, max_steps=-1, use_cpu=True, report_to=[])
    data = [{"x": torch.zeros(1)} for _ in range(rows)]
    trainer = Trainer(model=torch.nn.Linear(1, 1), args=args, train_dataset=data)
    loader = trainer.get_train_dataloader()
    if dp > 1:  # what accelerator.prepare does for rank 0 of dp processes
        loader = prepare_data_loader(torch.utils.data.DataLoader(data, batch_size=mbs), num_processes=dp,
                                     process_index=0)
    values = trainer.set_initial_training_values(args, loader)
    return values[-1], values[1]  # max_steps, num_update_steps_per_epoch


@pytest.mark.parametrize("rows, dp, mbs, ga, epochs", CASES)
def test_run_length_is_transformers(tmp_path, rows, dp, mbs, ga, epochs):
    want_steps, want_per_epoch = _transformers_count(tmp_path, rows, dp, mbs, ga, epochs)
    gbs = mbs * ga * dp
    ours = TrainingArguments(num_train_epochs=epochs, max_steps=-1, global_batch_size=gbs)
    assert total_training_steps(ours, rows) == want_steps
    sampler = DataSampler(rows, micro_batch_size=mbs, data_parallel_size=dp, global_batch_size=gbs)
    assert sampler.steps_per_epoch == want_per_epoch
    # ... and the sampler's epoch is that many steps: step sizes add up to the padded epoch
    consumed, taken = 0, 0
    while consumed < sampler.samples_per_epoch:
        consumed += sampler.plan.step_samples(consumed)
        taken += 1
    assert taken == want_per_epoch and consumed == sampler.samples_per_epoch


def _run_steps(rows: int, dp: int, mbs: int, gbs: int, consumed: int, count: int) -> list[list[list[int]]]:
    """``count`` steps from ``consumed`` on: each step's micro-batches, ranks side by side."""
    plan = DataSampler(rows, micro_batch_size=mbs, data_parallel_size=dp, global_batch_size=gbs).plan
    ranks = [iter(DataSampler(rows, micro_batch_size=mbs, data_parallel_rank=r, data_parallel_size=dp,
                              global_batch_size=gbs, seed=5, consumed_samples=consumed)) for r in range(dp)]
    out = []
    for _ in range(count):
        micro = plan.micro_steps_in_step(consumed)
        consumed += plan.step_samples(consumed)
        out.append([[next(rank) for _ in range(micro)] for rank in ranks])
    return out


@pytest.mark.parametrize("rows, dp, mbs, ga", [(9, 2, 2, 2), (11, 3, 2, 1), (3, 4, 1, 2), (20, 2, 3, 2)])
def test_every_row_once_per_epoch_and_exact_resume(rows, dp, mbs, ga):
    gbs = mbs * ga * dp
    per_epoch = math.ceil(rows / gbs)
    padded = math.ceil(rows / (dp * mbs)) * dp * mbs  # whole micro-steps
    full = _run_steps(rows, dp, mbs, gbs, 0, 3 * per_epoch)
    for epoch in range(3):
        seen = [i for step in full[epoch * per_epoch:(epoch + 1) * per_epoch]
                for rank in step for micro in rank for i in micro]
        assert len(seen) == padded and set(seen) == set(range(rows))
        counts = np.bincount(seen, minlength=rows)
        assert counts.max() - counts.min() <= math.ceil(padded / rows) - (padded == rows)  # padding repeats
        last = full[(epoch + 1) * per_epoch - 1]
        assert len({len(rank) for rank in last}) == 1  # every rank: as many micro-batches
        assert {len(micro) for rank in last for micro in rank} == {mbs}  # every micro-batch full
    consumed = 0
    plan = DataSampler(rows, micro_batch_size=mbs, data_parallel_size=dp, global_batch_size=gbs).plan
    for k in range(3 * per_epoch):  # resumed after every step, partial ones included
        assert _run_steps(rows, dp, mbs, gbs, consumed, 3 * per_epoch - k) == full[k:]
        consumed += plan.step_samples(consumed)


@pytest.fixture(scope="module")
def epochs_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("epochs")
    model = make_model_dir(root, layers=1)
    train = make_sft_data(root, 9, seed=3, name="train")
    config = write_config(root, model, train, training={
        "per_device_train_batch_size": 2, "global_batch_size": 8, "max_steps": -1, "num_train_epochs": 3,
        "save_steps": 3, "logging_steps": 1, "report_to": ["none"], "warmup_steps": 0})
    return root, config


def _losses(run_dir) -> list[tuple[int, float, float]]:
    return [(s["step"], s["loss"], s["grad_norm"]) for s in steps(run_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["training.use_mca=true", "training.use_mca=false"])
def test_both_backends_train_partial_steps_and_resume_exactly(epochs_setup, backend):
    root, config = epochs_setup
    name = "megatron" if backend.endswith("true") else "standard"
    full = root / name
    proc = run_train(config, full, 2, backend)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = _losses(full)
    assert [s[0] for s in log] == list(range(1, 7))  # ceil(9 / 8) = 2 steps × 3 epochs
    assert all(math.isfinite(loss) and math.isfinite(norm) for _, loss, norm in log)
    assert (full / "finished").exists() and '"steps_per_epoch": 2' in (full / "finished").read_text()
    resumed = rewind(full, root / f"{name}_resumed", 3)  # mid epoch 1, after epoch 0's partial step
    proc = run_train(config, resumed, 2, backend)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "at step 3 (20 samples)" in proc.stdout  # 8 + 4 (the partial step: 9 rows padded to 12) + 8
    assert _losses(resumed) == log


@pytest.mark.slow
def test_interleaved_pipeline_trains_the_partial_step_like_one_process(tmp_path):
    """9 rows in steps of 4 micro-batches of 1: each epoch ends with a step of 1 micro-batch,
    which the interleaved schedule (PP2 × VP2) runs made up to 2 with a masked copy: the losses
    and gradient norms still equal one process's, across two epoch ends."""
    model = make_model_dir(tmp_path, layers=4)
    train = make_sft_data(tmp_path, 9, seed=3, name="train")
    config = write_config(tmp_path, model, train, training={
        "per_device_train_batch_size": 1, "global_batch_size": 4, "max_steps": -1,
        "num_train_epochs": 2, "logging_steps": 1, "report_to": ["none"], "warmup_steps": 0})
    one = run_train(config, tmp_path / "one", 1)
    assert one.returncode == 0, one.stderr[-4000:]
    vpp = run_train(config, tmp_path / "vpp", 2, "parallel.pipeline_model_parallel_size=2",
                    "parallel.virtual_pipeline_model_parallel_size=2")
    assert vpp.returncode == 0, vpp.stderr[-4000:]
    ref, got = _losses(tmp_path / "one"), _losses(tmp_path / "vpp")
    assert [s[0] for s in ref] == [s[0] for s in got] == list(range(1, 7))  # 3 steps × 2 epochs
    for (_, loss, norm), (_, want_loss, want_norm) in zip(got, ref):
        assert loss == pytest.approx(want_loss, abs=1e-5) and norm == pytest.approx(want_norm, abs=1e-5)
