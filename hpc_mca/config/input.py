"""What a key and a value the user wrote mean: the YAML they are read from, their type check,
and what to tell a user about a config key this trainer does not have.

Values are checked against the field's annotation (:func:`coerce`); numbers written as strings
are parsed, and a list field takes a comma-separated string.

For unknown keys there are two sources of suggestions, and only these two: a curated table of
the names LLaMA-Factory, transformers, TRL, peft and Megatron-LM give to settings (each with
the key it corresponds to here, or why there is none), and close spellings of this config's own keys. A looser match
(``packing`` -> ``pt_chunking``, ``deepspeed`` -> ``seed``) reads as advice and sends the user
to a setting that means something else, so no other guess is offered.

LLaMA-Factory's keys that this config honours (:data:`LF_KEYS`: ``packing``, ``flash_attn``,
``save_strategy`` ...) are translated into its own fields, and transformers' names of
``optim`` values into adam (:func:`optimizer_fields`); the ones it refuses say why in
:data:`KNOWN_ELSEWHERE`. README.md's "LLaMA-Factory keys" lists each with its test.

Pure Python; :mod:`hpc_mca.config.sections` calls these.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpc_mca.errors import UserError

__all__ = ["KNOWN_ELSEWHERE", "LF_KEYS", "ConfigError", "LfKey", "choice_message", "coerce",
           "optimizer_fields", "unknown_key_message"]


class ConfigError(UserError):
    """Bad configuration; the message names the dotted field, its value and the valid choices."""


CLOSE_SPELLING = 0.8
"""difflib ratio above which a key is taken as a misspelling of one of ours (``learnig_rate``,
``warmup_step``, ``tensor_parallel_size``); below it, unrelated words start to match."""

KNOWN_ELSEWHERE: dict[str, str] = {
    # LLaMA-Factory's own keys (its example YAMLs) that are refused here; the ones honoured
    # are in LF_KEYS below.
    "do_eval": "use data.eval_dataset or data.val_size (evaluation runs whenever there is "
               "eval data)",
    "do_predict": "no counterpart: hpc-mca trains and evaluates, it does not generate predictions",
    "deepspeed": "Megatron-Core's parallelism replaces DeepSpeed: remove the key and shard "
                 "with the parallel section (parallel.use_distributed_optimizer=true shards "
                 "optimizer state and fp32 master weights over data-parallel ranks like ZeRO-1; "
                 "tensor_model_parallel_size / pipeline_model_parallel_size split the weights)",
    "quantization_bit": "no quantized training (QLoRA) here: remove the key (LoRA trains "
                        "adapters on the bf16/fp32 base: finetuning_type=lora, bf16=true)",
    "quantization_method": "no quantized training (QLoRA) here: remove the key",
    "max_length": "use data.cutoff_len",
    "use_llama_pro": "no LLaMA Pro (expanded blocks, every k-th layer trains) here: remove the "
                     "key (finetuning_type=freeze trains the last or first "
                     "freeze_trainable_layers layers)",
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


def coerce(dotted: str, value: Any, hint: Any) -> Any:
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


# --- LLaMA-Factory's keys and values ---------------------------------------------------------

Assignments = dict[str, Any]
"""Dotted field -> value: what an honoured key of another tool sets here."""


@dataclass(frozen=True)
class LfKey:
    """A LLaMA-Factory (transformers) key this config honours by setting fields of its own."""

    sets: tuple[str, ...]
    """The dotted fields it may set (empty: accepted, nothing to set)."""
    translate: Callable[[Any, Any], Assignments]
    """(value, the config with every plain key applied) -> the fields it sets; ConfigError in
    one line for a value that is refused. It sees the whole config because some keys mean
    different fields in different runs (export_dir: lora or full)."""
    decides: bool = False
    """Its fields take its values even when a plain key written after it sets them: a
    strategy says whether its ``*_steps`` count at all (transformers ignores ``save_steps``
    under ``save_strategy: no``)."""


def _flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{key}={value!r} must be true or false")


def _do_train(value: Any, config: Any) -> Assignments:
    if not _flag("do_train", value):
        raise ConfigError("do_train=false: hpc-mca train always trains (evaluation-only runs are "
                          "not supported); valid: true, or remove the key")
    return {}


def _trust_remote_code(value: Any, config: Any) -> Assignments:
    # Either value is fine: no remote code ever runs, and a model that needs some (auto_map in
    # its config.json) is refused by the model rule whatever this says.
    _flag("trust_remote_code", value)
    return {}


def _packing(key: str) -> Callable[[Any, Any], Assignments]:
    return lambda value, config: {"data.sequence_packing": _flag(key, value)}


def _liger(key: str) -> Callable[[Any, Any], Assignments]:
    """LLaMA-Factory's ``enable_liger_kernel`` and transformers' ``use_liger_kernel``: false is
    what runs here; true is refused, since the kernels in use were as fast or faster on one H200
    (README, "On one GPU": benchmarks/kernel_options.py)."""
    def refuse_true(value: Any, config: Any) -> Assignments:
        if _flag(key, value):
            raise ConfigError(f"{key}=true: liger-kernel is not used here (its fused linear "
                              "cross-entropy, RMSNorm and SwiGLU measured no faster than the "
                              "fusions in use); model.fusions chooses the compiled kernels "
                              "(unset: [layer, cross_entropy] on a GPU); valid: false")
        return {}
    return refuse_true


def _streaming(value: Any, config: Any) -> Assignments:
    if _flag("streaming", value):
        raise ConfigError("streaming=true: datasets are tokenized once into memory-mapped Arrow "
                          "files and read whole, never streamed; valid: false (a corpus too large "
                          "to tokenize whole: data.data_path, Megatron's indexed blend)")
    return {}


FLASH_ATTN = {"auto": "auto", "disabled": "torch", "sdpa": "torch", "fa2": "flash"}
"""LLaMA-Factory's flash_attn -> model.attention_backend. ``disabled`` (eager) and ``sdpa``
both become the torch backend (torch's SDPA / varlen kernels: the same attention, no extra
package); ``fa2`` is the flash-attn package; ``fa3`` has no backend here."""


def _flash_attn(value: Any, config: Any) -> Assignments:
    value = "disabled" if value is False else value  # YAML reads a bare `off` as false
    if value == "fa3":
        raise ConfigError("flash_attn='fa3': no attention backend here runs FlashAttention-3; "
                          "valid: auto, disabled, sdpa, fa2 (or model.attention_backend=te, whose "
                          "fused kernels pick the fastest available)")
    if value not in FLASH_ATTN:
        raise ConfigError(f"flash_attn={value!r} is not valid; valid: {', '.join(FLASH_ATTN)} "
                          "(model.attention_backend auto, torch, torch, flash)")
    return {"model.attention_backend": FLASH_ATTN[value]}


def _gradient_checkpointing(value: Any, config: Any) -> Assignments:
    # Every layer recomputed in backward, as transformers' gradient checkpointing does.
    on = _flag("gradient_checkpointing", value)
    return {"parallel.recompute_granularity": "full" if on else None,
            "parallel.recompute_method": "uniform" if on else None,
            "parallel.recompute_num_layers": 1 if on else None}


STRATEGIES = ("steps", "no")
"""The transformers interval strategies honoured here (``epoch`` is refused: an epoch's steps
are known only once the data is tokenized)."""


_STEPS_OF = {"eval_strategy": "training.eval_steps", "evaluation_strategy": "training.eval_steps",
             "save_strategy": "training.save_steps", "logging_strategy": "training.logging_steps"}


def _strategy_value(key: str, value: Any) -> str:
    value = "no" if value is False else value  # YAML reads a bare `no` as false
    if value == "epoch":
        raise ConfigError(f"{key}='epoch': an epoch's length in steps is known only once the data "
                          f"is tokenized; valid: steps, with {_STEPS_OF[key]} "
                          "(an epoch is the data line's train rows / global_batch_size steps), "
                          "or no")
    if value not in STRATEGIES:
        raise ConfigError(f"{key}={value!r} is not valid; valid: {', '.join(STRATEGIES)}")
    return str(value)


def _eval_strategy(key: str) -> Callable[[Any, Any], Assignments]:
    def translate(value: Any, config: Any) -> Assignments:
        if _strategy_value(key, value) == "no":
            return {"training.eval_steps": None}  # still evaluated once, after the last step
        tr = config.training
        if tr.eval_steps is None and _has_eval_data(config):
            return {"training.eval_steps": tr.logging_steps}  # transformers' default
        return {}
    return translate


def _has_eval_data(config: Any) -> bool:
    from .scope import has_eval_data  # scope needs the sections, which import this module

    return has_eval_data(config)


def _save_strategy(value: Any, config: Any) -> Assignments:
    if _strategy_value("save_strategy", value) == "no":
        return {"training.save_steps": None}  # still saved at the end and on a stop signal
    if config.training.save_steps is None:
        return {"training.save_steps": 500}  # transformers' default
    return {}


def _logging_strategy(value: Any, config: Any) -> Assignments:
    if _strategy_value("logging_strategy", value) == "no":
        raise ConfigError("logging_strategy='no': the loss is always logged (every "
                          "training.logging_steps steps and the last step: the run log, "
                          "steps.jsonl, report_to); valid: steps, or remove the key")
    return {}


def _tokenized_path(value: Any, config: Any) -> Assignments:
    return {} if value is None else {"data.preprocessing_cache_dir": value}


def _export_dir(value: Any, config: Any) -> Assignments:
    if value is None:
        return {}
    if not isinstance(value, str) or not value:
        raise ConfigError(f"export_dir={value!r} must be a directory")
    # LLaMA-Factory resolves it against the working directory; this config's export fields
    # are relative to output_dir, so make it absolute here.
    path = os.path.abspath(value)
    if config.finetuning.finetuning_type == "lora":
        return {"training.export_merged_dir": path}  # LF's export merges the adapters
    return {"training.export_hf_dir": path}


def lf_name(key: str, sections: tuple[str, ...]) -> str | None:
    """The LLaMA-Factory key that ``key`` names (flat, or under one of ``sections``), or None."""
    section, _, name = key.rpartition(".")
    if key in LF_KEYS or (section in sections and name in LF_KEYS):
        return name
    return None


def lf_assignments(name: str, value: Any, config: Any, at: int,
                   written: Mapping[str, int]) -> Assignments:
    """The fields LLaMA-Factory's key ``name`` (item ``at`` of the config) sets, less those a
    plain key written after it set (``written``: field -> position), unless the key decides
    them."""
    spec = LF_KEYS[name]
    return {dotted: field_value for dotted, field_value in spec.translate(value, config).items()
            if spec.decides or written.get(dotted, -1) < at}


LF_KEYS: dict[str, LfKey] = {
    "do_train": LfKey((), _do_train),
    "trust_remote_code": LfKey((), _trust_remote_code),
    "packing": LfKey(("data.sequence_packing",), _packing("packing")),
    "neat_packing": LfKey(("data.sequence_packing",), _packing("neat_packing")),
    "streaming": LfKey((), _streaming),
    "enable_liger_kernel": LfKey((), _liger("enable_liger_kernel")),
    "use_liger_kernel": LfKey((), _liger("use_liger_kernel")),
    "flash_attn": LfKey(("model.attention_backend",), _flash_attn),
    "gradient_checkpointing": LfKey(("parallel.recompute_granularity", "parallel.recompute_method",
                                     "parallel.recompute_num_layers"), _gradient_checkpointing),
    "eval_strategy": LfKey(("training.eval_steps",), _eval_strategy("eval_strategy"), decides=True),
    "evaluation_strategy": LfKey(("training.eval_steps",), _eval_strategy("evaluation_strategy"),
                                 decides=True),
    "save_strategy": LfKey(("training.save_steps",), _save_strategy, decides=True),
    "logging_strategy": LfKey((), _logging_strategy),
    "tokenized_path": LfKey(("data.preprocessing_cache_dir",), _tokenized_path),
    "export_dir": LfKey(("training.export_hf_dir", "training.export_merged_dir"), _export_dir),
}
"""LLaMA-Factory keys honoured here, by name. Each is applied after every plain key, in the
order written, and a plain key written after it wins unless it ``decides``."""


HF_OPTIMIZERS = {"adamw_torch": False, "adamw_hf": False, "adamw_torch_fused": True}
"""transformers' ``optim`` names that are this config's adam -> training.fused_optimizer
(adamw_hf, transformers' own deprecated AdamW, computes the same update)."""


def optimizer_fields(value: Any, own: tuple[str, ...]) -> Assignments:
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


def choice_message(dotted: str, value: Any, choices: tuple[Any, ...]) -> str | None:
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
