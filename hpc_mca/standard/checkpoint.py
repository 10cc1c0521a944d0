"""Checkpoints of the standard backend: transformers' files, hpc-mca's commit protocol.

A checkpoint holds what transformers' Trainer writes and reads back on
``train(resume_from_checkpoint=...)``: the model (``model.safetensors``; with LoRA the PEFT
adapter alone), ``optimizer.pt``, ``scheduler.pt``, one ``rng_state_<rank>.pth`` per rank and
``trainer_state.json``. Around them the same protocol as the Megatron backend's
(:mod:`hpc_mca.checkpoint.commit`): every rank writes into ``checkpoints/iter_N.tmp``; only after
all of them did rank 0 adds ``checkpoint.json`` (the records a resume is checked against: the
model, the layout, the data position), renames the directory to ``iter_N`` and moves the
``latest`` tracker, so a save killed half-way is never resumed from, and ``hpc-mca status`` and
``hpc-mca resume`` read these runs like any other.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from hpc_mca.checkpoint.commit import publish, tmp_dir
from hpc_mca.checkpoint.store import CheckpointInfo, checkpoints_dir, iter_name

from .hf_adapter import save_training_state

if TYPE_CHECKING:
    from transformers import Trainer

__all__ = ["save_checkpoint"]


def save_checkpoint(trainer: Trainer, run_dir: Path, info: CheckpointInfo, keep: int | None) -> Path:
    """Save ``trainer`` (a transformers Trainer, every rank calls this) at its current step and
    commit it; returns the checkpoint directory."""
    root = checkpoints_dir(run_dir)
    name = iter_name(info.step)
    tmp, final = tmp_dir(root, name), root / name
    started = time.perf_counter()
    if trainer.args.should_save:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save of this step left
        tmp.mkdir(parents=True)
    _barrier()
    trainer.save_model(str(tmp))
    if not info.training.get("save_only_model"):  # such a checkpoint is never resumed from
        save_training_state(trainer, str(tmp))
    if trainer.args.should_save:
        trainer.state.save_to_json(str(tmp / "trainer_state.json"))
    _barrier()  # every rank's files are in place before the checkpoint is published
    if trainer.args.should_save:
        # transformers' writers do not fsync: the commit flushes their files first.
        publish(root, name, info, keep, fsync_files=True)
        print(f"checkpoint {final} saved ({info.reason}) in {time.perf_counter() - started:.2f} s",
              flush=True)
    _barrier()  # nobody moves on (or exits for a requeue) before the tracker is durable
    return final


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
