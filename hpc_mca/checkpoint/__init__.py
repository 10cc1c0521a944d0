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
* :mod:`.requeue` — the Slurm requeue protocol (the contract with the batch script) and its
  rank side, :class:`~.requeue.StopSignal`.

Room for LoRA (next wave): the model part of the state dict comes from the model chunks'
``sharded_state_dict``; an adapter-only checkpoint is a different model part plus
``finetuning_type`` in checkpoint.json, which :mod:`.compat` already compares.
"""
