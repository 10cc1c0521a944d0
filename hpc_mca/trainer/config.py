"""The run configuration: five dataclasses under the names LLaMA-Factory / ROLL users know.

A config is read from YAML plus ``key=value`` overrides (:func:`load_config`); keys are flat
(``learning_rate``, as LLaMA-Factory YAMLs write them) or dotted (``training.learning_rate``),
and a YAML file may also nest them under the section names. Values are YAML-typed
(``bf16=true``, ``lr_scheduler_kwargs={min_lr_rate: 0.1}``, ``lr_scheduler_kwargs.min_lr=1e-5``).
Relative input paths (model, tokenizer, datasets) in a YAML file are taken relative to that
file's directory when they exist there, else relative to the working directory.

:meth:`TrainConfig.resolve` checks the cross-field rules for a world size, before anything is
allocated, and fills in the derived values (data-parallel size, accumulation steps, global
batch, sequence length); :meth:`TrainConfig.save_resolved` writes the result to the run dir.
Every error is a :class:`ConfigError` whose message names the dotted field, its value and the
valid choices. Nothing here imports torch.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpc_mca.topology import Layout, LayoutError, ModelShape, check_layout

from .lr_scheduler import SchedulerError, resolve_warmup_steps, scheduler_spec

STAGES = ("pt", "sft")
"""Training stages with a data pipeline and a loss; routed by ``finetuning.stage``."""
RESERVED_STAGES = ("dpo",)
"""Stages the entry point will route later (their seam: add the name to STAGES and a builder)."""
DATASET_FORMATS = ("auto", "text", "alpaca", "sharegpt", "indexed")
TEMPLATES = ("chat", "plain")
ATTENTION_BACKENDS = ("auto", "te", "flash", "torch")
OPTIMIZERS = ("adam", "sgd")
OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")
REPORT_TO = ("tensorboard", "none")
RESOLVED_CONFIG_NAME = "resolved_config.yaml"


class ConfigError(ValueError):
    """Bad configuration; the message names the dotted field, its value and the valid choices."""


@dataclass
class ModelArguments:
    """Which model to build and how its attention runs."""

    model_name_or_path: str = ""
    """Local Hugging Face model directory (weights + config.json) or a config-only directory
    (config.json, random init). Nothing is downloaded."""
    tokenizer_name_or_path: str | None = None
    """Tokenizer directory; None = ``model_name_or_path``."""
    attention_backend: str = "auto"
    """Core attention: auto (te, else flash, else torch), te, flash or torch."""


@dataclass
class DataArguments:
    """What to train on and how samples become fixed-length rows."""

    dataset: list[str] = field(default_factory=list)
    """Training files: .jsonl/.json/.parquet records, or Megatron indexed data (path prefix of a
    .bin/.idx pair). A comma-separated string is split."""
    eval_dataset: list[str] | None = None
    """Evaluation files, same formats; None = none (or ``val_size`` held out of the train set)."""
    val_size: float = 0.0
    """Hold out this fraction (< 1) or count (>= 1) of the training samples for evaluation."""
    dataset_format: str = "auto"
    """auto (text for pt, alpaca or sharegpt by the first record's keys for sft), text,
    alpaca, sharegpt or indexed."""
    text_field: str = "text"
    """Field holding the document of a pt record."""
    template: str = "chat"
    """sft rendering: chat (the tokenizer's chat_template) or plain (prompt + response + eos)."""
    cutoff_len: int = 1024
    """Most tokens one sample keeps (inputs after the causal shift); longer ones are truncated
    (pt: split into pieces)."""
    seq_length: int | None = None
    """Tokens per training row (packed or padded); None = ``cutoff_len``."""
    sequence_packing: bool = False
    """Pack several samples per row (best-fit decreasing, cu_seqlens per row) instead of
    padding each sample to a row of its own."""
    pt_chunking: str = "concat"
    """pt only: concat (join documents with eos and cut rows of ``cutoff_len``) or document
    (every document on its own, long ones split)."""
    train_on_prompt: bool = False
    """sft: also train on prompt tokens (default: loss on responses only)."""
    max_samples: int | None = None
    """Keep at most this many records per dataset file (for quick runs)."""
    preprocessing_cache_dir: str | None = None
    """Where tokenized datasets are cached; None = $HPC_MCA_CACHE_DIR or ~/.cache/hpc_mca."""
    overwrite_cache: bool = False
    """Tokenize again even when a cached copy exists."""


@dataclass
class FinetuningArguments:
    """Which training stage runs and which parameters it updates."""

    stage: str = "sft"
    """pt (next-token loss on all tokens) or sft (loss on responses); dpo is reserved."""
    finetuning_type: str = "full"
    """full (every parameter) or lora (adapters only)."""
    lora_rank: int = 8
    """LoRA rank r."""
    lora_alpha: float | None = None
    """LoRA scaling numerator; None = 2 * lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_target: list[str] = field(default_factory=lambda: ["all"])
    """Module names that get adapters, or ``all`` (every linear layer)."""


@dataclass
class TrainingArguments:
    """Optimisation, schedule, logging and precision, in transformers' TrainingArguments names."""

    output_dir: str = ""
    """Run directory: checkpoints, TensorBoard events, the resolved config."""
    per_device_train_batch_size: int = 1
    """Micro-batch size: rows per forward/backward on one data-parallel rank."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches per optimizer step on each rank; None = 1, or derived from
    ``global_batch_size``."""
    global_batch_size: int | None = None
    """Rows per optimizer step over all ranks (Megatron style); None = micro × accumulation ×
    data-parallel size."""
    per_device_eval_batch_size: int = 8
    """Rows per evaluation micro-batch on one rank."""
    learning_rate: float = 5e-5
    """Peak learning rate."""
    lr_scheduler_type: str = "linear"
    """constant, constant_with_warmup, linear, cosine, cosine_with_min_lr, inverse_sqrt, wsd."""
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra scheduler arguments (min_lr, min_lr_rate; wsd: num_decay_steps or decay_ratio,
    wsd_decay_style)."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of the run's steps (used when ``warmup_steps`` is 0)."""
    warmup_steps: int = 0
    """Warmup steps; overrides ``warmup_ratio`` when positive."""
    max_steps: int = -1
    """Optimizer steps of the run; -1 = ``num_train_epochs`` passes over the data."""
    num_train_epochs: float = 3.0
    """Passes over the training rows when ``max_steps`` is -1."""
    logging_steps: int = 10
    """Log every N optimizer steps."""
    save_steps: int | None = None
    """Checkpoint every N steps; None = only at the end (and when a stop signal arrives)."""
    save_total_limit: int | None = None
    """Keep only the newest N checkpoints in output_dir/checkpoints; None = keep all."""
    resume_from_checkpoint: str = "auto"
    """auto (continue from output_dir's latest checkpoint when there is one), never, or a
    checkpoint to start from: its directory, a checkpoints/ directory or a run directory."""
    async_save: bool = False
    """Write checkpoint shards in a background process; the commit (tracker) follows at a later
    step boundary, only once every rank finished."""
    save_optimizer_format: str = "fully_reshardable"
    """Distributed-optimizer state in checkpoints: fully_reshardable (model-space tensors,
    gathered over DP before writing: resumes on any TP/PP/DP) or dp_reshardable (each rank
    writes its own shard, no gather: faster, but a resume may change only DP)."""
    export_hf_dir: str | None = None
    """After the last step, also write the model as an HF safetensors directory here
    (relative paths are under output_dir); None = no export."""
    eval_steps: int | None = None
    """Evaluate every N steps; None = only after the last step (when there is an eval set)."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Log sinks: tensorboard, or none."""
    seed: int = 42
    """Seed of initialisation and data order."""
    bf16: bool = False
    """Train in bfloat16 (fp32 master weights)."""
    fp16: bool = False
    """Train in float16 with loss scaling."""
    optim: str = "adam"
    """adam (AdamW-style decoupled weight decay) or sgd."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_epsilon: float = 1e-8
    """Adam epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 = no clipping."""


@dataclass
class ParallelArguments:
    """Megatron-Core parallelism, memory and communication settings."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel ranks (split every matmul)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved schedule); None = not interleaved."""
    context_parallel_size: int = 1
    """Ranks each sequence is split over."""
    expert_model_parallel_size: int = 1
    """Ranks the experts of MoE layers are spread over."""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallel ranks inside an expert; None = ``tensor_model_parallel_size``."""
    data_parallel_size: int | None = None
    """Derived: world / (TP·PP·CP). Giving it only checks it."""
    sequence_parallel: bool = False
    """Split LayerNorm/dropout activations over TP ranks (turned off when TP is 1)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks."""
    overlap_grad_reduce: bool = False
    """Overlap the gradient reduce-scatter/all-reduce with backward."""
    overlap_param_gather: bool = False
    """Overlap the parameter all-gather with forward (needs the distributed optimizer)."""
    recompute_granularity: str | None = None
    """Activation recomputation: None, full or selective."""
    recompute_method: str | None = None
    """With full recomputation: uniform or block."""
    recompute_num_layers: int | None = None
    """With full recomputation: layers per recomputed group (uniform) or recomputed layers per
    stage (block)."""
    calculate_per_token_loss: bool = True
    """Normalise the loss by real (non-padded) tokens over micro-batches and DP ranks."""
    optimizer_cpu_offload: bool = False
    """Keep optimizer state on the CPU."""


@dataclass
class TrainConfig:
    """A whole run: the five argument groups."""

    model: ModelArguments = field(default_factory=ModelArguments)
    """The model."""
    data: DataArguments = field(default_factory=DataArguments)
    """The data."""
    finetuning: FinetuningArguments = field(default_factory=FinetuningArguments)
    """The stage and trainable parameters."""
    training: TrainingArguments = field(default_factory=TrainingArguments)
    """Optimisation and logging."""
    parallel: ParallelArguments = field(default_factory=ParallelArguments)
    """Megatron parallelism."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save_resolved(self, run_dir: str | os.PathLike[str]) -> Path:
        """Write the config to ``run_dir/resolved_config.yaml`` (atomically); return the path."""
        path = Path(run_dir) / RESOLVED_CONFIG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(self.to_yaml())
        os.replace(tmp, path)
        return path

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches per optimizer step on one rank (after :meth:`resolve`)."""
        return self.training.gradient_accumulation_steps or 1

    def resolve(self, world_size: int) -> TrainConfig:
        """A copy with the cross-field rules checked for ``world_size`` ranks and the derived
        fields filled in; raises ConfigError (one line per problem)."""
        config = copy.deepcopy(self)
        for check in _RESOLVE_STEPS:
            check(config, world_size)
        return config


_SECTION_TYPES = {"model": ModelArguments, "data": DataArguments,
                  "finetuning": FinetuningArguments, "training": TrainingArguments,
                  "parallel": ParallelArguments}
_INPUT_PATHS = {"model.model_name_or_path", "model.tokenizer_name_or_path", "data.dataset",
                "data.eval_dataset"}


def _field_index() -> dict[str, str]:
    """Flat field name -> dotted name; a flat name must be unique across sections."""
    index: dict[str, str] = {}
    for section, cls in _SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            if f.name in index:
                raise RuntimeError(f"config field {f.name} appears in two sections")
            index[f.name] = f"{section}.{f.name}"
    return index


_FLAT = _field_index()


# --- loading -------------------------------------------------------------------------------


def load_config(path: str | os.PathLike[str] | None = None,
                overrides: typing.Iterable[str] = ()) -> TrainConfig:
    """Defaults, then the YAML file at ``path``, then ``key=value`` overrides, in that order."""
    config = TrainConfig()
    if path is not None:
        base = Path(path).resolve().parent
        for key, value in _flatten(_read_yaml(Path(path))):
            set_value(config, key, value, base_dir=base)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value")
        set_value(config, key.strip(), _parse_value(key, text))
    return config


def _read_yaml(path: Path) -> dict[str, Any]:
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


def _flatten(data: dict[str, Any]) -> list[tuple[str, Any]]:
    """Section mappings (``training: {...}``) become dotted keys; other keys pass through."""
    items: list[tuple[str, Any]] = []
    for key, value in data.items():
        if key in _SECTION_TYPES and isinstance(value, dict):
            items += [(f"{key}.{sub}", v) for sub, v in value.items()]
        else:
            items.append((str(key), value))
    return items


def _parse_value(key: str, text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"override {key}={text!r}: the value is not valid YAML") from None


def set_value(config: TrainConfig, key: str, value: Any,
              base_dir: Path | None = None) -> None:
    """Set one flat or dotted key (``lr_scheduler_kwargs.min_lr`` sets a kwarg), type-checked."""
    dotted, subkey = _lookup(key)
    section, name = dotted.split(".")
    if subkey is not None:
        getattr(getattr(config, section), name)[subkey] = value
        return
    hint = typing.get_type_hints(_SECTION_TYPES[section])[name]
    value = _coerce(dotted, value, hint)
    if base_dir is not None and dotted in _INPUT_PATHS and value is not None:
        value = _relative_to(base_dir, value)
    setattr(getattr(config, section), name, value)


def _lookup(key: str) -> tuple[str, str | None]:
    """``(dotted field, dict subkey or None)`` for a flat or dotted key."""
    parts = key.split(".")
    if parts[0] in _SECTION_TYPES and len(parts) >= 2 and _FLAT.get(parts[1]) == ".".join(
            parts[:2]):
        dotted, rest = ".".join(parts[:2]), parts[2:]
    elif parts[0] in _FLAT:
        dotted, rest = _FLAT[parts[0]], parts[1:]
    else:
        raise ConfigError(_unknown_key_message(key))
    if not rest:
        return dotted, None
    if dotted != "training.lr_scheduler_kwargs" or len(rest) != 1:
        raise ConfigError(_unknown_key_message(key))
    return dotted, rest[0]


def _unknown_key_message(key: str) -> str:
    names = list(_FLAT) + list(_FLAT.values())
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    if not close and "." in key:
        close = difflib.get_close_matches(key.rsplit(".", 1)[-1], names, n=1, cutoff=0.5)
    hint = f"; did you mean {_FLAT.get(close[0], close[0])!r}?" if close else ""
    return f"unknown config key {key!r}{hint}"


def _relative_to(base: Path, value: Any) -> Any:
    if isinstance(value, list):
        return [_relative_to(base, v) for v in value]
    if not isinstance(value, str) or not value or os.path.isabs(value):
        return value
    candidate = base / value
    exists = candidate.exists() or Path(f"{candidate}.idx").exists()
    return str(candidate) if exists else value


def _coerce(dotted: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against the field's annotation; numbers written as strings are parsed."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise ConfigError(f"{dotted}={value!r} must be a list of strings")
    if origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{dotted}={value!r} must be a mapping, e.g. {{min_lr: 1e-5}}")
    return _coerce_scalar(dotted, value, hint)


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
    raise ConfigError(f"{dotted}={value!r} must be {kind}")


# --- resolve: cross-field rules ------------------------------------------------------------


def _choice(dotted: str, value: Any, choices: typing.Iterable[Any]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{dotted}={value!r} is not valid; valid: "
                          + ", ".join(str(c) for c in choices))


def _at_least(dotted: str, value: int | float | None, low: int | float) -> None:
    if value is not None and value < low:
        raise ConfigError(f"{dotted}={value} must be >= {low}")


def _check_model(config: TrainConfig, world_size: int) -> None:
    model = config.model
    _choice("model.attention_backend", model.attention_backend, ATTENTION_BACKENDS)
    if not model.model_name_or_path:
        raise ConfigError("model.model_name_or_path is required (a local HF model or "
                          "config directory)")
    if not (Path(model.model_name_or_path) / "config.json").is_file():
        raise ConfigError(f"model.model_name_or_path={model.model_name_or_path!r} has no "
                          "config.json (models are never downloaded)")


def _check_finetuning(config: TrainConfig, world_size: int) -> None:
    ft = config.finetuning
    if ft.stage in RESERVED_STAGES:
        raise ConfigError(f"finetuning.stage={ft.stage!r} is not yet supported; valid: "
                          + ", ".join(STAGES))
    _choice("finetuning.stage", ft.stage, STAGES)
    _choice("finetuning.finetuning_type", ft.finetuning_type, ("full", "lora"))
    _at_least("finetuning.lora_rank", ft.lora_rank, 1)
    if not 0.0 <= ft.lora_dropout < 1.0:
        raise ConfigError(f"finetuning.lora_dropout={ft.lora_dropout} must be in [0, 1)")
    if ft.lora_alpha is None:
        ft.lora_alpha = 2.0 * ft.lora_rank


def _check_data(config: TrainConfig, world_size: int) -> None:
    data, stage = config.data, config.finetuning.stage
    if not data.dataset:
        raise ConfigError("data.dataset is required (one or more dataset files)")
    _choice("data.dataset_format", data.dataset_format, DATASET_FORMATS)
    _choice("data.template", data.template, TEMPLATES)
    _choice("data.pt_chunking", data.pt_chunking, ("concat", "document"))
    fits = {"pt": ("auto", "text", "indexed"), "sft": ("auto", "alpaca", "sharegpt")}[stage]
    if data.dataset_format not in fits:
        raise ConfigError(f"data.dataset_format={data.dataset_format!r} does not fit "
                          f"finetuning.stage={stage!r}; valid: {', '.join(fits)}")
    _at_least("data.cutoff_len", data.cutoff_len, 1)
    _at_least("data.max_samples", data.max_samples, 1)
    _at_least("data.val_size", data.val_size, 0)
    if data.val_size and data.eval_dataset:
        raise ConfigError("data.val_size and data.eval_dataset are both set; valid: one of them")
    data.seq_length = data.seq_length or data.cutoff_len
    if data.seq_length < data.cutoff_len:
        raise ConfigError(f"data.seq_length={data.seq_length} is shorter than data.cutoff_len="
                          f"{data.cutoff_len}; valid: >= {data.cutoff_len}")


def _check_training(config: TrainConfig, world_size: int) -> None:
    tr = config.training
    if not tr.output_dir:
        raise ConfigError("training.output_dir is required")
    _choice("training.optim", tr.optim, OPTIMIZERS)
    _choice("training.save_optimizer_format", tr.save_optimizer_format, OPTIMIZER_FORMATS)
    for name in tr.report_to:
        _choice("training.report_to", name, REPORT_TO)
    if tr.bf16 and tr.fp16:
        raise ConfigError("training.bf16 and training.fp16 are both true; valid: at most one")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "logging_steps",
                 "save_steps", "eval_steps", "gradient_accumulation_steps", "global_batch_size",
                 "save_total_limit"):
        _at_least(f"training.{name}", getattr(tr, name), 1)
    for name in ("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon"):
        _at_least(f"training.{name}", getattr(tr, name), 0.0)
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(tr, name) < 1.0:
            raise ConfigError(f"training.{name}={getattr(tr, name)} must be in [0, 1)")


def _check_schedule(config: TrainConfig, world_size: int) -> None:
    tr = config.training
    if tr.max_steps <= 0 and tr.num_train_epochs <= 0:
        raise ConfigError(f"training.max_steps={tr.max_steps} and training.num_train_epochs="
                          f"{tr.num_train_epochs}: set max_steps > 0 or num_train_epochs > 0")
    if not 0.0 <= tr.warmup_ratio < 1.0:
        raise ConfigError(f"training.warmup_ratio={tr.warmup_ratio} must be in [0, 1)")
    _at_least("training.warmup_steps", tr.warmup_steps, 0)
    if tr.warmup_steps > 0 and tr.warmup_ratio > 0:
        raise ConfigError(f"training.warmup_steps={tr.warmup_steps} and training.warmup_ratio="
                          f"{tr.warmup_ratio} are both set; valid: one of them")
    # Without max_steps the run length depends on the data; check with a stand-in length
    # that the ratio-based warmup always fits.
    total = tr.max_steps if tr.max_steps > 0 else max(tr.warmup_steps + 1, 1000)
    try:
        scheduler_spec(tr.lr_scheduler_type, tr.lr_scheduler_kwargs, tr.learning_rate,
                       resolve_warmup_steps(tr.warmup_steps, tr.warmup_ratio, total), total)
    except SchedulerError as err:
        raise ConfigError(str(err)) from None


def _check_parallel(config: TrainConfig, world_size: int) -> None:
    par, tr, data = config.parallel, config.training, config.data
    _choice("parallel.recompute_granularity", par.recompute_granularity,
            (None, "full", "selective"))
    _choice("parallel.recompute_method", par.recompute_method, (None, "uniform", "block"))
    if par.recompute_method is not None and par.recompute_granularity != "full":
        raise ConfigError(f"parallel.recompute_method={par.recompute_method!r} needs "
                          "parallel.recompute_granularity='full'")
    if par.recompute_granularity == "full" and (par.recompute_num_layers or 0) < 1:
        raise ConfigError(f"parallel.recompute_num_layers={par.recompute_num_layers!r} must be "
                          ">= 1 with parallel.recompute_granularity='full'")
    if par.overlap_param_gather and not par.use_distributed_optimizer:
        raise ConfigError("parallel.overlap_param_gather=true needs "
                          "parallel.use_distributed_optimizer=true")
    if par.tensor_model_parallel_size == 1:
        par.sequence_parallel = False
    if par.expert_tensor_parallel_size is None:
        par.expert_tensor_parallel_size = par.tensor_model_parallel_size
    layout = _layout(par)
    lines = check_layout(
        layout, world_size, _model_shape(config.model.model_name_or_path),
        global_batch_size=tr.global_batch_size, micro_batch_size=tr.per_device_train_batch_size,
        seq_length=data.seq_length, sequence_packing=data.sequence_packing,
        sequence_parallel=par.sequence_parallel)
    if lines:
        raise ConfigError("\n".join(_our_names(line) for line in lines))
    par.data_parallel_size = world_size // layout.model_parallel_size
    _derive_batch(tr, par.data_parallel_size)


def _layout(par: ParallelArguments) -> Layout:
    try:
        return Layout(
            tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
            cp=par.context_parallel_size, ep=par.expert_model_parallel_size,
            etp=par.expert_tensor_parallel_size, vp=par.virtual_pipeline_model_parallel_size,
            dp=par.data_parallel_size)
    except LayoutError as err:
        raise ConfigError("\n".join(_our_names(line) for line in err.violations)) from None


def _model_shape(model_dir: str) -> ModelShape:
    try:
        return ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    except (LayoutError, ValueError) as err:
        raise ConfigError(f"model.model_name_or_path={model_dir!r}: config.json: "
                          f"{str(err).splitlines()[0]}") from None


_TOPOLOGY_NAMES = {
    "tensor_parallel_size": "parallel.tensor_model_parallel_size",
    "pipeline_parallel_size": "parallel.pipeline_model_parallel_size",
    "virtual_pipeline_parallel_size": "parallel.virtual_pipeline_model_parallel_size",
    "context_parallel_size": "parallel.context_parallel_size",
    "expert_parallel_size": "parallel.expert_model_parallel_size",
    "expert_tensor_parallel_size": "parallel.expert_tensor_parallel_size",
    "data_parallel_size": "parallel.data_parallel_size",
    "global_batch_size": "training.global_batch_size",
    "micro_batch_size": "training.per_device_train_batch_size",
    "seq_length": "data.seq_length",
}
_TOPOLOGY_RE = re.compile(r"\b(" + "|".join(_TOPOLOGY_NAMES) + r")\b")


def _our_names(line: str) -> str:
    """The planner's Megatron field names, rewritten as this config's dotted names."""
    return _TOPOLOGY_RE.sub(lambda m: _TOPOLOGY_NAMES[m.group(1)], line)


def _derive_batch(tr: TrainingArguments, dp: int) -> None:
    per_step = tr.per_device_train_batch_size * dp
    if tr.global_batch_size is None:
        tr.gradient_accumulation_steps = tr.gradient_accumulation_steps or 1
        tr.global_batch_size = per_step * tr.gradient_accumulation_steps
        return
    derived = tr.global_batch_size // per_step  # divisibility checked by check_layout
    if tr.gradient_accumulation_steps not in (None, derived):
        raise ConfigError(
            f"training.gradient_accumulation_steps={tr.gradient_accumulation_steps} disagrees "
            f"with training.global_batch_size={tr.global_batch_size} / (per_device_train_batch_"
            f"size×data_parallel_size={per_step}); valid: {derived} or leave it unset")
    tr.gradient_accumulation_steps = derived


_RESOLVE_STEPS = (_check_model, _check_finetuning, _check_data, _check_training,
                  _check_schedule, _check_parallel)


def total_training_steps(training: TrainingArguments, num_rows: int) -> int:
    """Optimizer steps of the run: ``max_steps``, else epochs × whole global batches per epoch.

    Needs a resolved config (``global_batch_size`` set). Raises ConfigError when the data holds
    less than one global batch.
    """
    if training.max_steps > 0:
        return training.max_steps
    gbs = training.global_batch_size or 1
    per_epoch = num_rows // gbs
    if per_epoch < 1:
        raise ConfigError(f"the training data has {num_rows} rows, fewer than one "
                          f"training.global_batch_size={gbs}; valid: global_batch_size <= "
                          f"{num_rows}")
    return max(1, math.ceil(training.num_train_epochs * per_epoch))
