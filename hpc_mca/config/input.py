"""What a key and a value the user wrote mean: the YAML they are read from, their type check,
and what to tell a user about a config key this trainer does not have.

Values are checked against the field's annotation (:func:`coerce`); numbers written as strings
are parsed, and a list field takes a comma-separated string.

For unknown keys there are two sources of suggestions, and only these two: a curated table of
the names LLaMA-Factory, transformers, TRL, peft and Megatron-LM give to settings (each with
the key it corresponds to here, or why there is none), and close spellings of this config's own keys. A looser match
(``packing`` -> ``pt_chunking``, ``deepspeed`` -> ``seed``) reads as advice and sends the user
to a setting that means something else, so no other guess is offered.

LLaMA-Factory's keys that this config honours (:data:`hpc_mca.config.lf_keys.LF_KEYS`:
``packing``, ``flash_attn``, ``save_strategy`` ...) are translated into its own fields, and
transformers' names of ``optim`` values into adam (:func:`optimizer_fields`); the ones it
refuses say why in :data:`KNOWN_ELSEWHERE`. docs/llama-factory.md's "The keys with their tests" lists
each.

Pure Python; :mod:`hpc_mca.config.sections` calls these.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from hpc_mca.errors import UserError

__all__ = ["KNOWN_ELSEWHERE", "ConfigError", "choice_message", "coerce", "optimizer_fields",
           "unknown_key_message"]


class ConfigError(UserError):
    """Bad configuration; the message names the dotted field, its value and the valid choices."""


CLOSE_SPELLING = 0.8
"""difflib ratio above which a key is taken as a misspelling of one of ours (``learnig_rate``,
``warmup_step``, ``tensor_parallel_size``); below it, unrelated words start to match."""

KNOWN_ELSEWHERE: dict[str, str] = {
    # LLaMA-Factory's own keys: every one has its answer in key_answers.py (these texts are
    # its reasons for the keys below, and what a script's TrainingArguments field is told).
    "do_eval": "use data.eval_dataset or data.val_size (evaluation runs whenever there is "
               "eval data)",
    "deepspeed": "a DeepSpeed config's ZeRO stage 1-3 becomes parallel.use_distributed_optimizer=true "
                 "(Megatron-Core's parallelism replaces DeepSpeed: optimizer state sharded over "
                 "data-parallel ranks; tensor_model_parallel_size / pipeline_model_parallel_size "
                 "split the weights)",
    "quantization_bit": "no quantized training (QLoRA) here (LoRA trains adapters on the "
                        "bf16/fp32 base: finetuning_type=lora, bf16=true)",
    "max_length": "use data.cutoff_len",
    "use_llama_pro": "no LLaMA Pro (expanded blocks, every k-th layer trains) here "
                     "(finetuning_type=freeze trains the last or first freeze_trainable_layers "
                     "layers)",
    # transformers / TRL / peft names
    "per_gpu_train_batch_size": "use training.per_device_train_batch_size",
    "per_gpu_eval_batch_size": "use training.per_device_eval_batch_size",
    "max_seq_length": "use data.cutoff_len",
    "beta": "use finetuning.pref_beta",
    "loss_type": "use finetuning.pref_loss",
    "label_smoothing": "use finetuning.dpo_label_smoothing",
    "desirable_weight": "use finetuning.kto_chosen_weight",
    "undesirable_weight": "use finetuning.kto_rejected_weight",
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


def read_yaml(path: Path) -> dict[str, Any]:
    """A config YAML file's top-level mapping (ConfigError, one line, for a missing file or bad YAML)."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    return data


def parse_value(key: str, text: str) -> Any:
    """The value of a ``key=value`` override, read as YAML (``bf16=true`` is a bool)."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"override {key}={text!r}: the value is not valid YAML") from None


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
            "training and parallel sections (hpc_mca/config/sections.py)")


NULL_MEANS: dict[str, Any] = {"training.resume_from_checkpoint": "auto"}
"""Fields whose YAML null stands for one of their values. LLaMA-Factory's examples all write
``resume_from_checkpoint: null``, which there means "continue from the output directory's last
checkpoint when it has one": this config's ``auto``."""

TRUE_MEANS: dict[str, Any] = {"training.resume_from_checkpoint": "latest"}
"""Fields whose YAML true stands for one of their values: transformers' and LLaMA-Factory's
``resume_from_checkpoint: true`` is "the output directory's last checkpoint, which must exist":
this config's ``latest``."""

VALID_VALUES = {"training.resume_from_checkpoint": "auto, never, or a checkpoint directory (also latest "
                                                   "or true: output_dir's latest checkpoint, which must exist)"}
"""What a free-text field accepts, for the message when a value has the wrong type."""


def coerce(dotted: str, value: object, hint: object) -> Any:
    """Check ``value`` against the field's annotation; numbers written as strings are parsed."""
    if value is None and dotted in NULL_MEANS:
        return NULL_MEANS[dotted]
    if value is True and dotted in TRUE_MEANS:
        return TRUE_MEANS[dotted]
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


def _blend_items(value: object) -> list[str]:
    """data.data_path as strings: Megatron writes it space-separated, YAML lists give numbers."""
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and
                                       not isinstance(v, bool) for v in value):
        return [str(v) for v in value]
    raise ConfigError(f"data.data_path={value!r} must be a list of weights and prefixes, e.g. "
                      "[0.7, prefixA, 0.3, prefixB]")


def _coerce_scalar(dotted: str, value: object, hint: object) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{dotted}={value!r} must be true or false")
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    if hint is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    kinds: dict[object, str] = {int: "an integer", float: "a number", str: "a string"}
    kind = kinds[hint]
    valid = f"; valid: {VALID_VALUES[dotted]}" if dotted in VALID_VALUES else ""
    raise ConfigError(f"{dotted}={value!r} must be {kind}{valid}")


HF_OPTIMIZERS = {"adamw_torch": False, "adamw_hf": False, "adamw_torch_fused": True}
"""transformers' ``optim`` names that are this config's adam -> training.fused_optimizer
(adamw_hf, transformers' own deprecated AdamW, computes the same update)."""


Assignments = dict[str, Any]
"""Dotted field -> value: what another tool's key or value sets here."""


def optimizer_fields(value: object, own: tuple[str, ...]) -> Assignments:
    """training.optim: one of ``own``, or a transformers name of AdamW (and the kernel)."""
    if value in own:
        return {"training.optim": value}
    if value in HF_OPTIMIZERS:
        return {"training.optim": "adam", "training.fused_optimizer": HF_OPTIMIZERS[value]}
    raise ConfigError(f"training.optim={value!r} is not valid; valid: {', '.join(own)}, or "
                      f"transformers' {', '.join(HF_OPTIMIZERS)} (adam)")


OTHER_VALUES: dict[str, dict[str, str]] = {
    "training.report_to": {
        "swanlab": "SwanLab is not a tracker here",
        "all": "'every installed tracker' is not offered here: name the trackers",
        "comet_ml": "Comet is not a tracker here", "clearml": "ClearML is not a tracker here",
        "neptune": "Neptune is not a tracker here", "trackio": "Trackio is not a tracker here",
        "dvclive": "DVCLive is not a tracker here", "azure_ml": "Azure ML is not a tracker here",
    },
}
"""Values another tool gives a field of ours that are refused here, with the reason."""


def choice_message(dotted: str, value: object, choices: tuple[Any, ...]) -> str | None:
    """None when ``value`` is one of ``choices``, else the one line refusing it (with the
    reason for another tool's value, or a close spelling)."""
    if value in choices:
        return None
    valid = ", ".join(str(choice) for choice in choices)
    reason = OTHER_VALUES.get(dotted, {}).get(value) if isinstance(value, str) else None
    if reason:
        return f"{dotted}={value!r}: {reason}; valid: {valid}"
    names = [choice for choice in choices if isinstance(choice, str)]
    close = difflib.get_close_matches(str(value), names, n=1, cutoff=CLOSE_SPELLING)
    guess = f"; did you mean {close[0]!r}?" if close else ""
    return f"{dotted}={value!r} is not valid; valid: {valid}{guess}"
