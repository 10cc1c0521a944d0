"""The script arguments (:mod:`hpc_mca.training_args`) as a view onto the run config: what each
of their fields becomes in it (:func:`config_of`), and the fields' values for a config
(:func:`view_values`). See the arguments' module docstring for the rules; :data:`MEGATRON_FIELDS`
is ROLL's 57 Megatron fields, each honoured or refused in one line. Pure Python: transformers'
classes are only read through the arguments given.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_mca.frozen import thawed_copy
from hpc_mca.rundir import PLAN_OVERRIDES_ENV, RUN_DIR_ENV

from .input import KNOWN_ELSEWHERE, ConfigError, parse_value
from .key_answers import REFUSED
from .loading import load_items, set_value
from .sections import TrainConfig, field_section

if TYPE_CHECKING:
    from _typeshed import DataclassInstance  # the script arguments (hpc_mca.training_args), a layer above

__all__ = ["FUSION_FLAGS", "MEGATRON_FIELDS", "NOT_IN_VIEW", "SCRIPT_FIELDS", "STRATEGIES", "config_of",
           "view_values"]

Items = list[tuple[str, object]]
"""(key, value) pairs for the config loader: flat or dotted keys, as a YAML file writes them."""


def config_of(args: DataclassInstance, base: TrainConfig | None) -> TrainConfig:
    """The run config of script arguments ``args``: ``base`` (None: the defaults) with every
    field read over it as a YAML file's keys, then the fusion flags, the batch script's run
    directory and planned layout. Nothing of ``args`` or ``base`` changes. ConfigError with
    every problem, one line each."""
    problems: list[str] = []
    items: Items = []
    for name, value in _changed_fields(args):
        try:
            items += _translate(args, name, value)
        except ConfigError as err:
            problems.append(str(err))
    config, load_problems = load_items([(key, value, None) for key, value in items],
                                       thawed_copy(base) if base is not None else None)
    _apply_fusions(config, args)
    problems += load_problems + _apply_environment(config)
    if problems:
        raise ConfigError("\n".join(problems))
    # a script may hand the trainer its datasets as objects (how this config was made)
    config.datasets_in_code = True  # type: ignore[misc]
    return config


Rule = Callable[[object, "DataclassInstance"], Items]
"""(the field's value, the arguments) -> the config keys it sets; ConfigError to refuse."""


def _to(key: str, convert: Callable[[Any], object] | None = None) -> Rule:
    """The field sets ``key`` (flat or dotted) to its value (converted)."""
    return lambda value, args: [(key, convert(value) if convert else value)]


def _default_or_none(default: object) -> Callable[[object], object]:
    return lambda value: default if value is None else value


def _refused(default: object, why: str) -> Rule:
    """Only ``default`` (or None) is valid: anything else is refused with ``why``."""
    def rule(value: object, args: DataclassInstance) -> Items:
        if value is None or value == default:
            return []
        raise ConfigError(f"{type(args).__name__}.{_field_name(rule)}={value!r}: {why}; "
                          f"valid: {default!r}")
    rule.__name__ = "refused"
    return rule


FUSION_FLAGS = {"bias_activation_fusion": "swiglu", "cross_entropy_loss_fusion": "cross_entropy",
                "apply_rope_fusion": "rope"}
"""ROLL's fusion flags -> the model.fusions entry each is."""


def _apply_fusions(config: TrainConfig, args: DataclassInstance) -> None:
    """The fusion flags as model.fusions entries: a flag on adds its fusion, off removes it;
    the config's other fusions (layer) stay. With no flag on, an unset model.fusions (the
    automatic choice) stays unset; naming one replaces the automatic choice, as a YAML list
    of fusions does."""
    flags = {name: bool(getattr(args, flag)) for flag, name in FUSION_FLAGS.items()}
    current = config.model.fusions
    if current is None and not any(flags.values()):
        return
    kept = [name for name in (current or []) if flags.get(name, True)]
    config.model.fusions = kept + [name for name, on in flags.items() if on and name not in kept]


def _transformer_impl(value: object, args: DataclassInstance) -> Items:
    if value in (None, "local"):
        return []
    raise ConfigError(f"{type(args).__name__}.transformer_impl={value!r}: this trainer builds "
                      "Megatron's local layers (model.attention_backend te runs Transformer "
                      "Engine's attention in them); valid: local")


def _reshardable(value: object, args: DataclassInstance) -> Items:
    return [("training.save_optimizer_format", "fully_reshardable")] if value else []


def _optimizer(value: object, args: DataclassInstance) -> Items:
    # ROLL's name beside transformers' ``optim``: its default (adam) leaves ``optim`` in force.
    return [] if value == "adam" else [("training.optim", value)]


def _accumulate_fp32(value: object, args: DataclassInstance) -> Items:
    return []  # gradients are reduced in fp32 here: true is what runs, false only in fp32 runs


def _check_for_nan(value: object, args: DataclassInstance) -> Items:
    if value:
        return []
    raise ConfigError(f"{type(args).__name__}.check_for_nan_in_loss_and_grad=False: non-finite "
                      "losses and gradients are always found here (the step is skipped and "
                      "counted, and a run that had any is not finished); valid: true")


_NO_FP8 = "no fp8 training here (bf16 or fp16 with fp32 master weights)"
_DROPLESS = "MoE routing is dropless here (every token reaches its top-k experts)"

MEGATRON_FIELDS: dict[str, Rule] = {
    "tensor_model_parallel_size": _to("parallel.tensor_model_parallel_size", _default_or_none(1)),
    "pipeline_model_parallel_size": _to("parallel.pipeline_model_parallel_size", _default_or_none(1)),
    "sequence_parallel": _to("parallel.sequence_parallel"),
    "virtual_pipeline_model_parallel_size": _to("parallel.virtual_pipeline_model_parallel_size"),
    "context_parallel_size": _to("parallel.context_parallel_size", _default_or_none(1)),
    "expert_model_parallel_size": _to("parallel.expert_model_parallel_size", _default_or_none(1)),
    "expert_tensor_parallel_size": _to("parallel.expert_tensor_parallel_size"),
    "account_for_embedding_in_pipeline_split": _refused(False, "stages are split by "
                                                        "pipeline_layout (layers per stage)"),
    "account_for_loss_in_pipeline_split": _refused(False, "stages are split by pipeline_layout "
                                                   "(layers per stage)"),
    "pipeline_model_parallel_layout": _refused(None, "stages are split by pipeline_layout "
                                               "(transformer layers per stage, e.g. [3, 4])"),
    "overlap_p2p_comm": _refused(False, "pipeline stages exchange activations with blocking "
                                 "sends here"),
    "variable_seq_lengths": _refused(False, "under pipeline parallelism the micro-batches of a "
                                     "step are padded to the longest here (ROLL's behaviour "
                                     "with false)"),
    "recompute_granularity": _to("parallel.recompute_granularity"),
    "recompute_method": _to("parallel.recompute_method"),
    "recompute_modules": _to("parallel.recompute_modules"),
    "recompute_num_layers": _to("parallel.recompute_num_layers"),
    "bias_activation_fusion": lambda value, args: [],  # the three fusion flags: _apply_fusions
    "apply_rope_fusion": lambda value, args: [],
    "cross_entropy_loss_fusion": lambda value, args: [],
    "moe_layer_recompute": _refused(False, "use recompute_granularity=selective with "
                                    "recompute_modules=moe"),
    "moe_token_dispatcher_type": _refused("alltoall", "experts exchange tokens with Megatron's "
                                          "alltoall dispatcher here (gloo has no reduce-scatter "
                                          "for allgather); the routing is the same"),
    "moe_aux_loss_coeff": _refused(None, "the load-balancing loss weight is the model's "
                                   "router_aux_loss_coef (its config.json)"),
    "moe_grouped_gemm": _refused(False, "experts run as separate GEMMs (Megatron's local spec)"),
    "moe_expert_capacity_factor": _refused(None, _DROPLESS),
    "moe_pad_expert_input_to_capacity": _refused(False, _DROPLESS),
    "moe_token_drop_policy": _refused(None, _DROPLESS),
    "moe_shared_expert_overlap": _refused(False, "shared experts run after the routed ones here"),
    "moe_enable_routing_replay": _refused(False, "routing is not recorded or replayed here"),
    "moe_router_dtype": _refused(None, "the router runs in the model's dtype here"),
    "mtp_num_layers": _to("model.mtp_num_layers", _default_or_none(0)),
    "calculate_per_token_loss": _to("parallel.calculate_per_token_loss"),
    "transformer_impl": _transformer_impl,
    "cuda_graph_impl": _refused(None, "no CUDA graphs here"),
    "cuda_graph_scope": lambda value, args: [],  # read only with cuda_graph_impl (refused)
    "fp8_recipe": _refused(None, _NO_FP8),
    "fp8_param": _refused(False, _NO_FP8),
    "fp8": _refused(None, _NO_FP8),
    "additional_configs": _refused({}, "name each setting by its own field"),
    "accumulate_allreduce_grads_in_fp32": _accumulate_fp32,
    "use_distributed_optimizer": _to("parallel.use_distributed_optimizer"),
    "distrib_optim_fully_reshardable": _reshardable,
    "distrib_optim_fully_reshardable_mem_efficient": _refused(False, "use save_optimizer_format "
                                                              "(model_space, fully_reshardable "
                                                              "or dp_reshardable)"),
    "overlap_grad_reduce": _to("parallel.overlap_grad_reduce"),
    "delay_grad_reduce": _refused(False, "gradient reductions start as their buckets fill, on "
                                  "every pipeline stage alike"),
    "overlap_param_gather": _to("parallel.overlap_param_gather"),
    "check_for_nan_in_loss_and_grad": _check_for_nan,
    "ddp_average_in_collective": _refused(False, "gradients are summed, then divided by the "
                                          "global batch's tokens"),
    "ddp_bucket_size": _refused(None, "Megatron's default bucket size is used"),
    "optimizer": _optimizer,
    "optimizer_cpu_offload": _to("parallel.optimizer_cpu_offload"),
    "optimizer_offload_fraction": _refused(0.0, "optimizer_cpu_offload offloads all of it"),
    "save_hf_model": _refused(False, "use export_hf_dir=DIR (the HF model, after the last step)"),
    "save_merged_model": _refused(False, "use export_merged_dir=DIR (LoRA: the merged HF model, "
                                  "after the last step)"),
    "ckpt_format": _refused("torch_dist", "checkpoints are Megatron's distributed checkpoints"),
    "ckpt_d2h_non_blocking": _refused(False, "use async_save to write shards in the background"),
    "sequence_packing": _to("data.sequence_packing"),
    "compile_warmup": _refused(False, "nothing is compiled ahead of the first step"),
}
"""ROLL's 57 Megatron fields -> what each sets in the run config, or its one-line refusal."""

SCRIPT_FIELDS = frozenset({
    "do_train", "do_eval", "do_predict", "predict_with_generate", "generation_max_length",
    "generation_num_beams", "generation_config", "local_rank", "use_cpu",
})
"""transformers fields a script reads and the trainer does not (transformers' own Trainer does
not read them either): left to the script. (``use_cpu`` only says where transformers' own
helpers put tensors; the ranks run where CUDA is.)"""

STRATEGIES = ("eval_strategy", "save_strategy", "logging_strategy")
"""Read whatever their value: each decides whether its ``*_steps`` counts (config.input)."""

NOT_IN_VIEW: dict[str, str] = {
    "use_mca": "McaTrainer is the Megatron backend (LLaMA-Factory's FinetuningArguments has use_mca)",
    "plot_loss": "LLaMA-Factory's FinetuningArguments has it (hpc-mca plot draws a run's curves)",
    "fused_optimizer": "optim says it: adamw_torch_fused or adamw_torch",
    "warmup_ratio": "warmup_steps below 1 is the ratio (transformers 5)",
}
"""The run config's training and parallel fields that are not fields here, and why."""

_OWN = frozenset({"global_batch_size", "overwrite_output_dir", "profile_steps", "hang_timeout",
                  "async_save", "save_optimizer_format", "export_hf_dir", "export_merged_dir",
                  "pipeline_layout", "cp_comm_type", "data_parallel_size", "sequence_parallel_size",
                  "gradient_accumulation_steps"})
"""Fields of the run config under their own names (hpc-mca's, and transformers' that have
the same meaning there are found in the config's index: :func:`_is_config_field`)."""


def _field_name(rule: Rule) -> str:
    return next(name for name, r in MEGATRON_FIELDS.items() if r is rule)


def _is_config_field(name: str) -> bool:
    return field_section(name) is not None


def _changed_fields(args: DataclassInstance) -> list[tuple[str, Any]]:
    """(name, value) of every field to read: the run-config fields and strategies always, the
    Megatron fields always (their rules skip defaults), transformers' others when they differ
    from transformers' defaults."""
    defaults = _transformers_defaults(type(args), bool(getattr(args, "use_cpu", False)))
    out = []
    for f in dataclasses.fields(args):
        if not f.init or f.name in SCRIPT_FIELDS:
            continue
        value = getattr(args, f.name)
        known = (f.name in MEGATRON_FIELDS or f.name in _OWN or f.name in STRATEGIES
                 or _is_config_field(f.name))
        if known or value != defaults.get(f.name, value):
            out.append((f.name, value))
    return out


_DEFAULTS: dict[tuple[str, bool], dict[str, Any]] = {}


def _transformers_defaults(cls: type, use_cpu: bool = False) -> dict[str, Any]:
    """transformers' fields of ``cls`` as its own ``__post_init__`` leaves them when nothing is
    given (``report_to`` becomes [], ``debug`` [] ...; on the CPU, ``dataloader_pin_memory``
    false): a value equal to these was not given. Computed once per class."""
    base = next(c for c in cls.__mro__ if c.__module__.startswith("transformers."))
    key = (f"{base.__module__}.{base.__qualname__}", use_cpu)
    if key not in _DEFAULTS:
        pristine = base(use_cpu=use_cpu)
        _DEFAULTS[key] = {f.name: getattr(pristine, f.name) for f in dataclasses.fields(base) if f.init}
    return _DEFAULTS[key]


def _translate(args: DataclassInstance, name: str, value: object) -> Items:
    """The config keys one field sets (module docstring)."""
    if name in MEGATRON_FIELDS:
        return MEGATRON_FIELDS[name](value, args)
    if name == "warmup_steps" and isinstance(value, (int, float)):  # transformers 5: below 1, a ratio
        if 0 < value < 1:
            return [("training.warmup_ratio", float(value)), ("training.warmup_steps", 0)]
        if value == 0:
            return [("training.warmup_ratio", 0.0), ("training.warmup_steps", 0)]
        return [("training.warmup_steps", _config_value(name, value))]  # steps win over a ratio
    if name in _OWN or name in STRATEGIES or _is_config_field(name):
        return [(name, _config_value(name, value))]
    why = REFUSED[name].why if name in REFUSED else KNOWN_ELSEWHERE.get(
        name, "a setting of transformers' Trainer that this trainer does not run")
    default = _transformers_defaults(type(args), bool(getattr(args, "use_cpu", False))).get(name)
    raise ConfigError(f"{type(args).__name__}.{name}={value!r}: {why}; valid: {default!r} "
                      f"(transformers' default)")


def _config_value(name: str, value: object) -> Any:
    """transformers' representation of a value as the config reads it: enums as their
    names, an unset ``lr_scheduler_kwargs`` as {}, a ``warmup_steps`` below 1 as a ratio."""
    value = getattr(value, "value", value)  # OptimizerNames, SchedulerType, IntervalStrategy
    if name == "lr_scheduler_kwargs" and value is None:
        return {}
    if isinstance(value, float) and name in ("logging_steps", "save_steps", "eval_steps", "warmup_steps") \
            and value.is_integer():
        return int(value)
    return value


def view_values(cls: type, config: TrainConfig) -> dict[str, Any]:
    """This class's fields that ``config`` has a value for, in transformers' and ROLL's
    representation."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for section in ("training", "parallel"):
        for f in dataclasses.fields(getattr(config, section)):
            if f.name in names:
                values[f.name] = getattr(getattr(config, section), f.name)
    tr, par = config.training, config.parallel
    values.update(mtp_num_layers=config.model.mtp_num_layers, sequence_packing=config.data.sequence_packing,
                  optimizer=tr.optim, optim="adamw_torch_fused" if tr.fused_optimizer else "adamw_torch",
                  report_to=list(tr.report_to), eval_strategy="steps" if tr.eval_steps else "no",
                  save_strategy="steps" if tr.save_steps else "no",
                  distrib_optim_fully_reshardable=tr.save_optimizer_format == "fully_reshardable")
    values.update({flag: name in (config.model.fusions or ()) for flag, name in FUSION_FLAGS.items()})
    if tr.optim != "adam":
        values["optim"] = tr.optim
    values["warmup_steps"] = tr.warmup_steps or tr.warmup_ratio
    if tr.resume_from_checkpoint in ("auto", "latest"):
        values["resume_from_checkpoint"] = None if tr.resume_from_checkpoint == "auto" else "latest"
    values["recompute_modules"] = par.recompute_modules
    return values


def _apply_environment(config: TrainConfig) -> list[str]:
    """The batch script's run directory and planned layout (the arguments' module docstring);
    problems."""
    problems: list[str] = []
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        given = config.training.output_dir
        if not given:
            config.training.output_dir = run_dir
        elif Path(given).resolve() != Path(run_dir).resolve():
            problems.append(f"training.output_dir={given!r} but this job's run directory is "
                            f"{RUN_DIR_ENV}={run_dir!r}; valid: leave output_dir unset or set it "
                            f"to {run_dir!r}")
    defaults = TrainConfig()
    for item in shlex.split(os.environ.get(PLAN_OVERRIDES_ENV, "")):
        key, _, text = item.partition("=")
        dotted = field_section(key.split(".")[-1])
        if dotted is None:
            problems.append(f"{PLAN_OVERRIDES_ENV}: unknown key {key!r}; valid: layout fields "
                            "such as tensor_model_parallel_size")
            continue
        section, name = dotted.split(".")
        if getattr(getattr(config, section), name) != getattr(getattr(defaults, section), name):
            continue  # the script chose this one itself
        try:
            set_value(config, key, parse_value(key, text))
        except ConfigError as err:
            problems.append(f"{PLAN_OVERRIDES_ENV}: {err}")
    return problems
