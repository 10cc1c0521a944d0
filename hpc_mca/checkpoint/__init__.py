"""Checkpoints on a shared file system, and resuming a run — also on another layout.

* :mod:`.store` — the on-disk layout (``checkpoints/iter_N``, the ``latest`` tracker,
  checkpoint.json, keep-last-K, the ``finished`` marker); pure Python.
* :mod:`.compat` — whether a run can continue from a checkpoint, decided from checkpoint.json
  before anything is loaded; pure Python (the trainer and ``hpc-mca resume`` share it).
* :mod:`.state` — the Megatron sharded state dict (model, optimizer, and the training loop's
  own state through the :class:`~.state.Resumable` protocol) and how it is put back.
* :mod:`.checkpointer` — :class:`~.checkpointer.Checkpointer`: save with the commit protocol,
  resume, async saves, the end of a run. The trainer owns one and calls it; it decides
  nothing about when to save.
* :mod:`.afresh` — ``training.overwrite_output_dir``: whether a launch is a run's first start,
  and moving an older run aside (never deleting it); pure Python.
* :mod:`.requeue` — the Slurm requeue protocol (the contract with the batch script) and its
  rank side, :class:`~.requeue.StopSignal`.

What the finetuning type changes (LoRA: the base model a checkpoint's adapters belong to, an
adapter export) comes from its converter (:mod:`hpc_mca.models.converters`); checkpoint.json's
``finetuning_type`` is compared by :mod:`.compat` like every other training field.
"""
