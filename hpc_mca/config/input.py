"""What a key and a value the user wrote mean: their type check, and what to tell a user about
a config key this trainer does not have.

Values are checked against the field's annotation (:func:`coerce`); numbers written as strings
are parsed, and a list field takes a comma-separated string.

For unknown keys there are two sources of suggestions, and only these two: a curated table of
the names LLaMA-Factory, transformers, TRL, peft and Megatron-LM give to settings (each with
the key it corresponds to here, or why there is none), and close spellings of this config's own keys. A looser match
(``packing`` -> ``pt_chunking``, ``deepspeed`` -> ``seed``) reads as advice and sends the user
to a setting that means something else, so no other guess is offered.

Pure Python; :mod:`hpc_mca.config.sections` calls both.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

from hpc_mca.errors import UserError

__all__ = ["KNOWN_ELSEWHERE", "ConfigError", "coerce", "unknown_key_message"]


class ConfigError(UserError):
    """Bad configuration; the message names the dotted field, its value and the valid choices."""


CLOSE_SPELLING = 0.8
"""difflib ratio above which a key is taken as a misspelling of one of ours (``learnig_rate``,
``warmup_step``, ``tensor_parallel_size``); below it, unrelated words start to match."""

KNOWN_ELSEWHERE: dict[str, str] = {
    # LLaMA-Factory's own keys (its example YAMLs)
    "packing": "use data.sequence_packing",
    "neat_packing": "use data.sequence_packing (packed documents never attend to each other here)",
    "flash_attn": "use model.attention_backend (auto, te, flash, torch)",
    "do_train": "no counterpart: hpc-mca train always trains; remove the key",
    "do_eval": "use data.eval_dataset or data.val_size (evaluation runs whenever there is "
               "eval data)",
    "do_predict": "no counterpart: hpc-mca trains and evaluates, it does not generate predictions",
    "eval_strategy": "use training.eval_steps (None = evaluate after the last step)",
    "evaluation_strategy": "use training.eval_steps (None = evaluate after the last step)",
    "save_strategy": "use training.save_steps (None = save at the end and on a stop signal)",
    "deepspeed": "use the parallel section: Megatron-Core's parallelism replaces DeepSpeed "
                 "(parallel.use_distributed_optimizer shards optimizer state like ZeRO-1)",
    "ddp_timeout": "no counterpart: the process-group timeout is not a setting; remove the key",
    "overwrite_output_dir": "use training.resume_from_checkpoint (never = start afresh)",
    "plot_loss": "no counterpart: `hpc-mca plot` draws the loss of any run; remove the key",
    "save_only_model": "no counterpart: checkpoints hold the optimizer and data position so "
                       "that a requeued job resumes exactly; remove the key",
    "trust_remote_code": "no counterpart: models are built from config.json, no remote code runs",
    "preprocessing_num_workers": "no counterpart: rank 0 tokenizes once into a shared cache",
    "dataloader_num_workers": "no counterpart: rows are read from memory-mapped tokenized data",
    "tokenized_path": "use data.preprocessing_cache_dir",
    "gradient_checkpointing": "use parallel.recompute_granularity (full or selective)",
    "max_length": "use data.cutoff_len",
    "adapter_name_or_path": "no counterpart yet: LoRA starts from fresh adapters",
    # transformers / TRL / peft names
    "per_gpu_train_batch_size": "use training.per_device_train_batch_size",
    "per_gpu_eval_batch_size": "use training.per_device_eval_batch_size",
    "max_seq_length": "use data.cutoff_len",
    "beta": "use finetuning.pref_beta",
    "loss_type": "use finetuning.pref_loss",
    "label_smoothing": "use finetuning.dpo_label_smoothing",
    "lora_r": "use finetuning.lora_rank",
    "r": "use finetuning.lora_rank",
    "target_modules": "use finetuning.lora_target",
    "logging_dir": "use training.output_dir (TensorBoard events go to its tensorboard/ folder)",
    # Megatron-LM's argument names
    "lr": "use training.learning_rate",
    "min_lr": "use training.lr_scheduler_kwargs.min_lr (lr_scheduler_type cosine_with_min_lr)",
    "micro_batch_size": "use training.per_device_train_batch_size",
    "train_iters": "use training.max_steps",
    "lr_warmup_iters": "use training.warmup_steps",
    "lr_warmup_fraction": "use training.warmup_ratio",
    "lr_decay_style": "use training.lr_scheduler_type",
    "clip_grad": "use training.max_grad_norm",
    "adam_eps": "use training.adam_epsilon",
    "save_interval": "use training.save_steps",
    "log_interval": "use training.logging_steps",
    "eval_interval": "use training.eval_steps",
}
"""A key of another tool -> what it corresponds to in this config (or why nothing does)."""


def unknown_key_message(key: str, keys: Mapping[str, str]) -> str:
    """One line for an unknown ``key``; ``keys`` maps every flat name to its dotted name."""
    last = key.rsplit(".", 1)[-1]
    for name in (key, last):
        if name in KNOWN_ELSEWHERE:
            return f"unknown config key {key!r} (another tool's name): {KNOWN_ELSEWHERE[name]}"
    names = list(keys) + list(keys.values())
    close = difflib.get_close_matches(key, names, n=1, cutoff=CLOSE_SPELLING)
    if not close and "." in key:
        close = difflib.get_close_matches(last, names, n=1, cutoff=CLOSE_SPELLING)
    if close:
        return f"unknown config key {key!r}; did you mean {keys.get(close[0], close[0])!r}?"
    return (f"unknown config key {key!r}; valid: the fields of the model, data, finetuning, "
            "training and parallel sections (hpc_mca/config/config.py)")


NULL_MEANS: dict[str, Any] = {"training.resume_from_checkpoint": "auto"}
"""Fields whose YAML null stands for one of their values. LLaMA-Factory's examples all write
``resume_from_checkpoint: null``, which there means "continue from the output directory's last
checkpoint when it has one": this config's ``auto``."""

VALID_VALUES = {"training.resume_from_checkpoint": "auto, never, or a checkpoint directory"}
"""What a free-text field accepts, for the message when a value has the wrong type."""


def coerce(dotted: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against the field's annotation; numbers written as strings are parsed."""
    if value is None and dotted in NULL_MEANS:
        return NULL_MEANS[dotted]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    if dotted == "data.data_path":
        return _blend_items(value)
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and item is int:
            try:
                return [_coerce_scalar(dotted, int(v) if isinstance(v, str) else v, int) for v in value]
            except (ConfigError, ValueError):
                raise ConfigError(f"{dotted}={value!r} must be a list of integers") from None
        if item is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]  # one number on the command line is read as a number, not a list
        if isinstance(value, list) and item is float:
            try:
                return [_coerce_scalar(dotted, v, float) for v in value]
            except ConfigError:
                raise ConfigError(f"{dotted}={value!r} must be a list of numbers") from None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise ConfigError(f"{dotted}={value!r} must be a list of strings")
    if origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{dotted}={value!r} must be a mapping, e.g. {{min_lr: 1e-5}}")
    return _coerce_scalar(dotted, value, hint)


def _blend_items(value: Any) -> list[str]:
    """data.data_path as strings: Megatron writes it space-separated, YAML lists give numbers."""
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and
                                       not isinstance(v, bool) for v in value):
        return [str(v) for v in value]
    raise ConfigError(f"data.data_path={value!r} must be a list of weights and prefixes, e.g. "
                      "[0.7, prefixA, 0.3, prefixB]")


def _coerce_scalar(dotted: str, value: Any, hint: type) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{dotted}={value!r} must be true or false")
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    if hint is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    kind = {int: "an integer", float: "a number", str: "a string"}[hint]
    valid = f"; valid: {VALID_VALUES[dotted]}" if dotted in VALID_VALUES else ""
    raise ConfigError(f"{dotted}={value!r} must be {kind}{valid}")
