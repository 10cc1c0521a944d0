"""Can this run continue from that checkpoint? Decided from checkpoint.json, before loading.

Pure Python (no torch): the trainer calls it on every rank before any tensor is read, and
``hpc-mca resume`` calls it on the login node for the layout of the continuation job.

What may change between the saving and the loading job (dist_checkpointing reshards):
tensor/pipeline/virtual-pipeline/data/expert parallel sizes, the node count, the micro-batch
size and gradient accumulation (the global batch stays), and the run's length (max_steps,
num_train_epochs) and LR settings: the schedule is re-derived from the config for the new
total (see :mod:`hpc_mca.config.schedule`), and a finished run is extended that way
(:func:`nothing_to_train`). A max_steps below the checkpoint's step is refused.

What may not (one line each, naming the config field, both values and the valid choice):
the model's shape, the global batch size, the data seed, sequence length and packing
alignment (the sampler position would point at other rows), the optimizer, the precision, distributed vs. plain
optimizer (their state layouts differ), full vs. LoRA training, and — for the
``dp_reshardable`` optimizer format only — tensor/pipeline/expert parallel sizes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_mca.config.run_length import steps_for
from hpc_mca.config.sections import (
    ConfigError,
    ParallelArguments,
    TrainConfig,
    TrainingArguments,
)
from hpc_mca.data.packing import pack_alignment
from hpc_mca.models.converters import converter_for

from .store import (
    HF_FORMAT,
    CheckpointError,
    CheckpointInfo,
    ResumePoint,
    latest_checkpoint,
    read_finished,
    read_info,
    resolve_checkpoint,
)

if TYPE_CHECKING:
    from hpc_mca.topology import ModelShape


class CheckpointMismatch(ConfigError):
    """The configured run cannot continue from the checkpoint. Raised before anything is
    loaded (before the process group, in the trainer); the entry point prints it as one line
    and exits 2, like any config error."""

# checkpoint.json training key -> the config field a user would change.
_TRAINING_FIELDS = {
    "global_batch_size": "training.global_batch_size",
    "seed": "training.seed",
    "seq_length": "data.seq_length",
    "pack_alignment": "data.pack_alignment",
    "optim": "training.optim",
    "precision": "training.bf16/fp16",
    "use_distributed_optimizer": "parallel.use_distributed_optimizer",
    "finetuning_type": "finetuning.finetuning_type",
}
# Parallel sizes a dp_reshardable optimizer state cannot change (it stores DP-bucket shards).
_DP_RESHARDABLE_FIXED = ("tp", "pp", "vp", "ep", "etp", "cp", "pipeline_layout")


def model_record(shape: ModelShape) -> dict[str, Any]:
    """The model fields a checkpoint records: a ModelShape as a dict, without its label, in
    JSON's types (tuples as lists), so that it equals the record read back from a checkpoint."""
    record = dataclasses.asdict(shape)
    record.pop("name", None)
    return {key: list(value) if isinstance(value, tuple) else value for key, value in record.items()}


def layout_record(par: ParallelArguments, world_size: int, use_mca: bool) -> dict[str, Any]:
    """Parallel sizes of a resolved config on ``world_size`` ranks (``use_mca``: its backend)."""
    return {"tp": par.tensor_model_parallel_size, "pp": par.pipeline_model_parallel_size,
            "vp": par.virtual_pipeline_model_parallel_size, "cp": par.context_parallel_size,
            "ep": par.expert_model_parallel_size, "etp": par.expert_tensor_parallel_size,
            "dp": par.data_parallel_size, "world_size": world_size,
            "pipeline_layout": list(par.pipeline_layout) if par.pipeline_layout is not None else None,
            # Ulysses sequence parallelism of the standard backend (only recorded there).
            **({} if use_mca else {"sp": par.sequence_parallel_size})}


def training_record(config: TrainConfig, optimizer_format: str) -> dict[str, Any]:
    """What the data position and the optimizer state depend on, for a resolved TrainConfig."""
    tr, par = config.training, config.parallel
    return {"global_batch_size": tr.global_batch_size, "seed": tr.seed,
            "seq_length": config.derived.seq_length, "optim": tr.optim,
            # Packed rows depend on where samples may start.
            "pack_alignment": (pack_alignment(config.parallel.context_parallel_size,
                                              config.data.pack_alignment)
                               if config.data.sequence_packing else None),
            "precision": "bf16" if tr.bf16 else "fp16" if tr.fp16 else "fp32",
            "use_distributed_optimizer": par.use_distributed_optimizer,
            "optimizer_format": optimizer_format,
            "finetuning_type": config.finetuning.finetuning_type, "max_steps": tr.max_steps,
            # Not compared: a resume on another world size keeps the global batch and
            # re-derives these (reported by describe_batch_changes).
            "micro_batch_size": tr.per_device_train_batch_size,
            "gradient_accumulation_steps": tr.gradient_accumulation_steps,
            "backend": "megatron" if tr.use_mca else "standard",
            # Not compared: a checkpoint saved without its optimizer state is refused as a
            # resume point whatever the new run says (check_checkpoint).
            "save_only_model": tr.save_only_model,
            # LoRA: the base model the adapters belong to (a checkpoint holds only them).
            **converter_for(config.finetuning, config.model.adapter_name_or_path).resume_record(
                config.model.model_name_or_path)}


def incompatibilities(info: CheckpointInfo, model: dict[str, Any], layout: dict[str, Any],
                      training: dict[str, Any]) -> list[str]:
    """Why a run with ``model``/``layout``/``training`` cannot load ``info``'s checkpoint
    (one line per reason; empty when it can)."""
    reasons = []
    changed = {k: (v, model.get(k)) for k, v in info.model.items() if model.get(k) != v}
    if changed:
        diffs = ", ".join(f"{k} {new} (checkpoint: {old})" for k, (old, new) in changed.items())
        reasons.append(f"the checkpoint at step {info.step} holds a different model: {diffs}; "
                       "valid: the model it was trained with")
    for key, dotted in _TRAINING_FIELDS.items():
        old, new = info.training.get(key), training.get(key)
        if key in info.training and old != new:
            reasons.append(f"{dotted}={new!r} but the checkpoint at step {info.step} was saved "
                           f"with {old!r}; valid: {old!r}")
    reasons += _base_model_changed(info, training)
    reasons += _other_backend(info, training)
    if info.training.get("optimizer_format") == "dp_reshardable":
        for key in _DP_RESHARDABLE_FIXED:
            old, new = info.layout.get(key), layout.get(key)
            if old != new:
                reasons.append(f"parallel size {key}={new} but the checkpoint's optimizer "
                               f"state (dp_reshardable) was saved with {key}={old} and can "
                               f"only change data parallelism; valid: {key}={old}")
    return reasons


def _other_backend(info: CheckpointInfo, training: dict[str, Any]) -> list[str]:
    """A checkpoint is read by the backend that wrote it (their files differ)."""
    standard = training.get("backend") == "standard"
    if (info.format == HF_FORMAT) == standard:
        return []
    wrote = "the standard backend" if info.format == HF_FORMAT else "Megatron-Core"
    return [f"training.use_mca={str(not standard).lower()} but the checkpoint at step "
            f"{info.step} was written by {wrote}; valid: training.use_mca="
            f"{str(standard).lower()}"]


def _base_model_changed(info: CheckpointInfo, training: dict[str, Any]) -> list[str]:
    """LoRA adapters load only onto the base model they were trained on (its weights: the
    fingerprint, wherever the directory now is)."""
    old, new = info.training.get("base_model"), training.get("base_model")
    if not old or not new or old.get("fingerprint") == new.get("fingerprint"):
        return []
    trained = old.get("trained", "the LoRA adapters")  # freeze records its own words
    return [f"model.model_name_or_path={new['path']!r} has other weights than the base model "
            f"{trained} of the checkpoint at step {info.step} were trained on "
            f"({old['path']}, fingerprint {old['fingerprint'][:12]}, now "
            f"{new['fingerprint'][:12]}); valid: that base model"]


def same_layout(info: CheckpointInfo, layout: dict[str, Any]) -> bool:
    """True when every rank of the new job is the rank that saved (per-rank RNG state can be
    restored only then)."""
    return all(info.layout.get(k) == layout.get(k) for k in layout)


def describe_changes(info: CheckpointInfo, layout: dict[str, Any]) -> str:
    """``tp 2->1, dp 2->4`` for the parallel sizes that differ (empty when none)."""
    return ", ".join(f"{k} {info.layout.get(k)}->{v}" for k, v in layout.items()
                     if info.layout.get(k) != v)


def describe_batch_changes(info: CheckpointInfo, training: dict[str, Any]) -> str:
    """``global batch 8 kept: gradient_accumulation_steps 1->2`` when the way the global batch
    is made up changed (empty when not, or the checkpoint did not record it)."""
    changed = [f"{key} {info.training[key]}->{training.get(key)}"
               for key in ("micro_batch_size", "gradient_accumulation_steps")
               if key in info.training and info.training[key] != training.get(key)]
    if not changed:
        return ""
    return f"global batch {training.get('global_batch_size')} kept: {', '.join(changed)}"


def records(config: TrainConfig, world_size: int, shape: ModelShape) -> dict[str, dict[str, Any]]:
    """What a checkpoint of this run records and a resume compares: model, layout, training."""
    optimizer_format = (config.training.save_optimizer_format
                        if config.parallel.use_distributed_optimizer else "plain")
    layout = layout_record(config.parallel, world_size, config.training.use_mca)
    return {"model": model_record(shape), "layout": layout,
            "training": training_record(config, optimizer_format)}


def checkpoint_to_load(training: TrainingArguments) -> Path | None:
    """What ``training.resume_from_checkpoint`` selects: auto = output_dir's latest checkpoint
    (None when there is none), latest = that checkpoint (refused when there is none), never =
    none, else the given checkpoint."""
    spec = training.resume_from_checkpoint
    try:
        if spec in ("", "auto"):
            return latest_checkpoint(training.output_dir)
        if spec == "latest":
            found = latest_checkpoint(training.output_dir)
            if found is None:
                raise CheckpointMismatch(
                    f"training.resume_from_checkpoint=latest (true): output_dir "
                    f"{training.output_dir} holds no checkpoint; valid: auto (null: start afresh "
                    f"when there is none), never, or a checkpoint directory")
            return found
        if spec == "never":
            return None
        return resolve_checkpoint(spec)
    except CheckpointError as err:
        raise CheckpointMismatch(f"training.resume_from_checkpoint={spec!r}: {err}") from None


def check_checkpoint(path: Path, recorded: dict[str, dict[str, Any]]) -> CheckpointInfo:
    """checkpoint.json of ``path``; CheckpointMismatch (one line) if a run with ``recorded``
    (see :func:`records`) cannot continue from it."""
    try:
        info = read_info(path)
    except CheckpointError as err:
        raise CheckpointMismatch(str(err)) from None
    if info.training.get("save_only_model"):
        raise CheckpointMismatch(
            f"cannot resume from {path}: it was saved with training.save_only_model=true (the "
            f"model only, no optimizer or scheduler state); valid: resume_from_checkpoint=never, "
            f"another output_dir, or a checkpoint saved with save_only_model=false")
    reasons = incompatibilities(info, **recorded)
    if reasons:
        raise CheckpointMismatch(f"cannot resume from {path}: " + "; ".join(reasons))
    return info


def resume_check(config: TrainConfig, world_size: int,
                 shape: ModelShape) -> ResumePoint | None:
    """The checkpoint a resolved config will resume from on ``world_size`` ranks and its info,
    None for a fresh start; CheckpointMismatch when it cannot."""
    path = checkpoint_to_load(config.training)
    if path is None:
        return None
    info = check_checkpoint(path, records(config, world_size, shape))
    max_steps = config.training.max_steps
    if 0 < max_steps < info.step:
        raise CheckpointMismatch(f"training.max_steps={max_steps} is below the step of the "
                                 f"checkpoint to resume from ({path}, step {info.step}); valid: "
                                 f"max_steps >= {lowest_max_steps(config.training, info.step)}")
    return ResumePoint(path, info)


def lowest_max_steps(training: TrainingArguments, checkpoint_step: int) -> int:
    """The smallest max_steps that resuming from a checkpoint at ``checkpoint_step`` accepts.
    The step itself for a run that has not finished (a requeue after the final save trains
    nothing more and finishes); one more than the last step of a finished run, because
    :func:`nothing_to_train` refuses a length that adds no step to it."""
    done = read_finished(training.output_dir)
    if done is None or training.resume_from_checkpoint not in ("", "auto", "latest"):
        return checkpoint_step
    return max(checkpoint_step, done["step"] + 1)


def nothing_to_train(training: TrainingArguments, total_steps: int | None = None) -> str | None:
    """Why a run would train nothing (one line, saying how to extend it or start afresh), or
    None. True for a run directory whose run finished at step k when it is resumed
    (``resume_from_checkpoint=auto``) with a length of at most k steps: ``total_steps`` when
    known, else max_steps, else num_train_epochs × the epoch length the finished run recorded
    (None when that cannot be known before the data is read)."""
    tr = training
    done = read_finished(tr.output_dir)
    if done is None or tr.resume_from_checkpoint not in ("", "auto", "latest"):
        return None
    if total_steps is None and tr.max_steps <= 0:
        if not done.get("steps_per_epoch"):
            return None
        total_steps = steps_for(tr, int(done["steps_per_epoch"]))
    total = total_steps if total_steps is not None else tr.max_steps
    if total > done["step"]:
        return None
    return (f"run {tr.output_dir} finished at step {done['step']} and this config trains to step "
            f"{total}: nothing to train. To extend it: max_steps=N with N > {done['step']} (or "
            f"more num_train_epochs; hpc-mca resume JOBID max_steps=N does it as a job); to "
            f"start afresh: another output_dir")
