"""The standard backend: the same run on a plain transformers model (``training.use_mca: false``).

For single-GPU development and jobs too small for model parallelism. transformers' Trainer runs
the loop (:mod:`.trainer`); the data pipeline (packed rows told apart by restarting position
ids, attention through :mod:`hpc_mca.models.hf_attention`), the loss contract (mean over the
global batch's real tokens), the optimizer and LR schedulers, the run-dir outputs (steps.jsonl,
progress.json, TensorBoard scalars under the same names), the checkpoint commit protocol and
the requeue contract are the Megatron backend's, so both give the same losses from the same
weights and the same batch scripts run both. Data parallelism is DDP (accelerate); sequence
parallelism is Ulysses (:mod:`hpc_mca.runtime.sequence_parallel`).

- ``run``: the entry, from :func:`hpc_mca.launch.run.run_training`.
- ``trainer``: the Trainer subclass (data, loss, step end, evaluation).
- ``dpo``: stage dpo's subclass (preference loss, the reference model).
- ``data``: micro-batches as packed streams, sliced for sequence parallelism.
- ``model``: the transformers model (LoRA through peft), optimizer, schedule, exports.
- ``checkpoint``: transformers' checkpoint files under hpc-mca's commit protocol.
"""
