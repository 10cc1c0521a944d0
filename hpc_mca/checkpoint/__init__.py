"""Checkpoints on a shared file system, and resuming a run — also on another layout.

* :mod:`.store` — the on-disk layout (``checkpoints/iter_N``, the ``latest`` tracker,
  checkpoint.json, keep-last-K, the ``finished`` marker); pure Python.
* :mod:`.compat` — whether a run can continue from a checkpoint, decided from checkpoint.json
  before anything is loaded; pure Python (the trainer and ``hpc-mca resume`` share it).
* :mod:`.state` — the Megatron sharded state dict (model, optimizer, LR scheduler, RNG,
  trainer counters, config) and how it is put back.
* :mod:`.checkpointer` — :class:`~.checkpointer.Checkpointer`: save with the commit protocol,
  resume, async saves, the end of a run.
* :mod:`.requeue` — the Slurm requeue protocol (the contract with the batch script) and its
  rank side, :class:`~.requeue.StopRequest`.

:func:`train_with_checkpoints` is the one call the training entry point makes.

Room for LoRA (next wave): the model part of the state dict comes from the model chunks'
``sharded_state_dict``; an adapter-only checkpoint is a different model part plus
``finetuning_type`` in checkpoint.json, which :mod:`.compat` already compares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["train_with_checkpoints"]


def train_with_checkpoints(trainer: Any, config: Any, ctx: Any, run_dir: Path, model_shape: Any) -> list[Any]:
    """Resume ``trainer`` from the run's checkpoint (if any), train with interval, end and
    on-signal saves, and mark the run finished (or leave it for a requeue when a stop signal
    ended it early). Returns the step results of this process's part of the run."""
    from .checkpointer import Checkpointer
    from .compat import nothing_to_train
    from .requeue import StopRequest

    checkpointer = Checkpointer(config, ctx, run_dir, model_shape)
    stop = StopRequest(run_dir, ctx.device, ctx.is_main, checkpointer)
    trainer.callbacks.add_callback(stop)
    try:
        checkpointer.attach(trainer)
        if trainer.state.global_step >= trainer.max_steps:
            # Resumed at its end: a finished run started again (say so), or one that died
            # between its last checkpoint and the finished marker (finish() writes it).
            idle = nothing_to_train(config, trainer.max_steps)
            if idle and ctx.is_main:
                print(idle, flush=True)
            history: list[Any] = []
            trainer.metrics.close()
        else:
            checkpointer.begin(trainer)
            history = trainer.train()
        checkpointer.finish(trainer, stopped=stop.stopped)
    finally:
        stop.restore()
    return history
