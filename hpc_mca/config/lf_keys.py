"""LLaMA-Factory's (and transformers') keys that this config honours by setting fields of its
own (:data:`LF_KEYS`: ``packing``, ``flash_attn``, ``save_strategy`` ...), each applied after
every plain key, and refusing the values it cannot honour in one line. The loader
(:mod:`.loading`) reads them; docs/llama-factory.md's "The keys with their tests" lists each.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .input import KNOWN_ELSEWHERE, Assignments, ConfigError
from .scope import has_eval_data

if TYPE_CHECKING:
    from .sections import TrainConfig

__all__ = ["FLASH_ATTN", "LF_KEYS", "LF_KEY_NOTES", "STRATEGIES", "LfKey", "lf_assignments", "lf_name"]


@dataclass(frozen=True)
class LfKey:
    """A LLaMA-Factory (transformers) key this config honours by setting fields of its own."""

    sets: tuple[str, ...]
    """The dotted fields it may set (empty: accepted, nothing to set)."""
    translate: Callable[[object, TrainConfig], Assignments]
    """(value, the config with every plain key applied) -> the fields it sets; ConfigError in
    one line for a value that is refused. It sees the whole config because some keys mean
    different fields in different runs (export_dir: lora or full)."""
    decides: bool = False
    """Its fields take its values even when a plain key written after it sets them: a
    strategy says whether its ``*_steps`` count at all (transformers ignores ``save_steps``
    under ``save_strategy: no``)."""


def _flag(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{key}={value!r} must be true or false")


def _do_train(value: object, config: TrainConfig) -> Assignments:
    if not _flag("do_train", value):
        raise ConfigError("do_train=false: hpc-mca train always trains (evaluation-only runs are "
                          "not supported); valid: true, or remove the key")
    return {}


def _trust_remote_code(value: object, config: TrainConfig) -> Assignments:
    # Either value is fine: no remote code ever runs, and a model that needs some (auto_map in
    # its config.json) is refused by the model rule whatever this says.
    _flag("trust_remote_code", value)
    return {}


def _packing(key: str) -> Callable[[object, TrainConfig], Assignments]:
    return lambda value, config: {"data.sequence_packing": _flag(key, value)}


def _liger(key: str) -> Callable[[object, TrainConfig], Assignments]:
    """LLaMA-Factory's ``enable_liger_kernel`` and transformers' ``use_liger_kernel``: false is
    what runs here; true is refused, since the kernels in use were as fast or faster on one H200
    (docs/gpu.md: benchmarks/kernel_options.py)."""
    def refuse_true(value: object, config: TrainConfig) -> Assignments:
        if _flag(key, value):
            raise ConfigError(f"{key}=true: liger-kernel is not used here (its fused linear "
                              "cross-entropy, RMSNorm and SwiGLU measured no faster than the "
                              "fusions in use); model.fusions chooses the compiled kernels "
                              "(unset: [layer, cross_entropy] on a GPU); valid: false")
        return {}
    return refuse_true


def _streaming(value: object, config: TrainConfig) -> Assignments:
    if _flag("streaming", value):
        raise ConfigError("streaming=true: datasets are tokenized once into memory-mapped Arrow "
                          "files and read whole, never streamed; valid: false (a corpus too large "
                          "to tokenize whole: data.data_path, Megatron's indexed blend)")
    return {}


FLASH_ATTN = {"auto": "auto", "disabled": "torch", "sdpa": "torch", "fa2": "flash"}
"""LLaMA-Factory's flash_attn -> model.attention_backend. ``disabled`` (eager) and ``sdpa``
both become the torch backend (torch's SDPA / varlen kernels: the same attention, no extra
package); ``fa2`` is the flash-attn package; ``fa3`` has no backend here."""


def _flash_attn(value: object, config: TrainConfig) -> Assignments:
    value = "disabled" if value is False else value  # YAML reads a bare `off` as false
    if value == "fa3":
        raise ConfigError("flash_attn='fa3': no attention backend here runs FlashAttention-3; "
                          "valid: auto, disabled, sdpa, fa2 (or model.attention_backend=te, whose "
                          "fused kernels pick the fastest available)")
    if value not in FLASH_ATTN:
        raise ConfigError(f"flash_attn={value!r} is not valid; valid: {', '.join(FLASH_ATTN)} "
                          "(model.attention_backend auto, torch, torch, flash)")
    return {"model.attention_backend": FLASH_ATTN[value]}


def _gradient_checkpointing(value: object, config: TrainConfig) -> Assignments:
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


def _strategy_value(key: str, value: object) -> str:
    value = "no" if value is False else value  # YAML reads a bare `no` as false
    if value == "epoch":
        raise ConfigError(f"{key}='epoch': an epoch's length in steps is known only once the data "
                          f"is tokenized; valid: steps, with {_STEPS_OF[key]} "
                          "(an epoch is the data line's train rows / global_batch_size steps), "
                          "or no")
    if value not in STRATEGIES:
        raise ConfigError(f"{key}={value!r} is not valid; valid: {', '.join(STRATEGIES)}")
    return str(value)


def _eval_strategy(key: str) -> Callable[[object, TrainConfig], Assignments]:
    def translate(value: object, config: TrainConfig) -> Assignments:
        if _strategy_value(key, value) == "no":
            return {"training.eval_steps": None}  # still evaluated once, after the last step
        tr = config.training
        if tr.eval_steps is None and _has_eval_data(config):
            return {"training.eval_steps": tr.logging_steps}  # transformers' default
        return {}
    return translate


def _has_eval_data(config: TrainConfig) -> bool:
    return has_eval_data(config)


def _save_strategy(value: object, config: TrainConfig) -> Assignments:
    if _strategy_value("save_strategy", value) == "no":
        return {"training.save_steps": None}  # still saved at the end and on a stop signal
    if config.training.save_steps is None:
        return {"training.save_steps": 500}  # transformers' default
    return {}


def _logging_strategy(value: object, config: TrainConfig) -> Assignments:
    if _strategy_value("logging_strategy", value) == "no":
        raise ConfigError("logging_strategy='no': the loss is always logged (every "
                          "training.logging_steps steps and the last step: the run log, "
                          "steps.jsonl, report_to); valid: steps, or remove the key")
    return {}


def _tokenized_path(value: object, config: TrainConfig) -> Assignments:
    return {} if value is None else {"data.preprocessing_cache_dir": value}


def _export_dir(value: object, config: TrainConfig) -> Assignments:
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


def _disable_gradient_checkpointing(value: object, config: TrainConfig) -> Assignments:
    # LLaMA-Factory recomputes every layer unless this is set; here nothing is recomputed unless
    # asked (gradient_checkpointing, parallel.recompute_*): true is that, false asks nothing.
    if _flag("disable_gradient_checkpointing", value):
        return _gradient_checkpointing(False, config)
    return {}


def _jit_checkpoint(value: object, config: TrainConfig) -> Assignments:
    # Either value is fine: a stop signal (Slurm's SIGTERM before the time limit or a preemption)
    # always writes a checkpoint here, then the job is requeued.
    _flag("enable_jit_checkpoint", value)
    return {}


_ZERO_NAME = re.compile(r"(?:zero|z)[_-]?([0-3])(?![0-9])", re.IGNORECASE)
"""A ZeRO stage in a DeepSpeed config's file name (ds_z3_config.json, zero2.json)."""


def _zero_stage(value: object) -> int:
    """The ZeRO stage of transformers' ``deepspeed`` value: a config mapping, a JSON file, or
    (a file that is not on this machine) its name."""
    if isinstance(value, str) and value and os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                value = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"deepspeed={value!r} is not a readable JSON file ({err})") from None
    if isinstance(value, dict):
        stage = (value.get("zero_optimization") or {}).get("stage", 0)
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"deepspeed: zero_optimization.stage={stage!r}; valid: 0, 1, 2 or 3")
        return int(stage)
    if isinstance(value, str) and value:
        found = _ZERO_NAME.search(os.path.basename(value))
        if found:
            return int(found.group(1))
        raise ConfigError(f"deepspeed={value!r}: no such file here and its name gives no ZeRO stage; "
                          "valid: a DeepSpeed JSON config (zero_optimization.stage), or a name with "
                          "its stage such as ds_z3_config.json")
    raise ConfigError(f"deepspeed={value!r} must be a DeepSpeed JSON config file: "
                      f"{KNOWN_ELSEWHERE['deepspeed']}")


def _deepspeed(value: object, config: TrainConfig) -> Assignments:
    """Megatron-Core's parallelism replaces DeepSpeed: ZeRO 1-3's sharding of optimizer state
    over data-parallel ranks is the distributed optimizer; weights are split by tensor and
    pipeline parallelism, not by ZeRO-3."""
    if value is None:
        return {}
    stage = _zero_stage(value)
    if stage > 0 and not config.training.use_mca:
        raise ConfigError(f"deepspeed={value!r} (ZeRO-{stage}) with training.use_mca=false: the standard "
                          "backend keeps the whole optimizer state on every rank (no ZeRO sharding); "
                          "valid: remove the key, or training.use_mca=true (the distributed optimizer)")
    # stage 0 is plain data parallelism, what runs here without the distributed optimizer
    return {"parallel.use_distributed_optimizer": True} if stage > 0 else {}


def lf_name(key: str, sections: tuple[str, ...]) -> str | None:
    """The LLaMA-Factory key that ``key`` names (flat, or under one of ``sections``), or None."""
    section, _, name = key.rpartition(".")
    if key in LF_KEYS or (section in sections and name in LF_KEYS):
        return name
    return None


def lf_assignments(name: str, value: object, config: TrainConfig, at: int,
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
    "deepspeed": LfKey(("parallel.use_distributed_optimizer",), _deepspeed),
    "disable_gradient_checkpointing": LfKey(("parallel.recompute_granularity", "parallel.recompute_method",
                                             "parallel.recompute_num_layers"), _disable_gradient_checkpointing),
    "enable_jit_checkpoint": LfKey((), _jit_checkpoint),
}
"""LLaMA-Factory keys honoured here, by name. Each is applied after every plain key, in the
order written, and a plain key written after it wins unless it ``decides``."""

LF_KEY_NOTES: dict[str, str] = {
    "do_train": "`true` accepted (hpc-mca train always trains); `false` refused: no evaluation-only runs",
    "trust_remote_code": "either value: no remote code runs (a model whose config.json has auto_map is "
                         "refused whatever it says)",
    "packing": "`data.sequence_packing`",
    "neat_packing": "`data.sequence_packing` (packed documents never attend to each other here)",
    "streaming": "`false` accepted; `true` refused: datasets are tokenized once and read whole "
                 "(`data.data_path` for a corpus too large for that)",
    "enable_liger_kernel": "`false` accepted; `true` refused: `model.fusions` chooses the compiled kernels",
    "use_liger_kernel": "as `enable_liger_kernel`",
    "flash_attn": "`model.attention_backend`: auto -> auto, disabled/sdpa -> torch, fa2 -> flash; fa3 refused",
    "gradient_checkpointing": "`true`: `parallel.recompute_granularity: full`, `recompute_method: uniform`, "
                              "`recompute_num_layers: 1`; `false`: none",
    "eval_strategy": "`steps`: `training.eval_steps` (unset with eval data: logging_steps); `no`: no "
                     "interval; `epoch` refused",
    "evaluation_strategy": "as `eval_strategy`",
    "save_strategy": "`steps`: `training.save_steps` (unset: 500); `no`: no interval; `epoch`, `best` refused",
    "logging_strategy": "`steps`: `training.logging_steps`; `no`, `epoch` refused",
    "tokenized_path": "`data.preprocessing_cache_dir` (the cache key covers the data and the settings)",
    "export_dir": "full: `training.export_hf_dir`; LoRA: `training.export_merged_dir`; relative to the "
                  "working directory",
    "deepspeed": "a DeepSpeed config with ZeRO stage 1, 2 or 3 (its JSON's zero_optimization.stage; a "
                 "file not on this machine: the stage in its name, ds_z3_config.json) -> "
                 "`parallel.use_distributed_optimizer: true` (optimizer state and fp32 master weights "
                 "sharded over data-parallel ranks); weights are split by tensor/pipeline parallelism, "
                 "not ZeRO-3; stage 0: nothing to set; refused with `use_mca: false` (no ZeRO sharding there)",
    "disable_gradient_checkpointing": "`true`: no recompute; `false` accepted (LLaMA-Factory then "
                                      "recomputes; here `gradient_checkpointing` / `parallel.recompute_*` "
                                      "ask for it)",
    "enable_jit_checkpoint": "either value: a stop signal always writes a checkpoint before the job "
                             "is requeued",
}
"""What each LLaMA-Factory key becomes, one line for docs/llama-factory-keys.md's table."""
