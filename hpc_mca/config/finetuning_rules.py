"""The rules of what trains and how (``finetuning.*`` with the model it applies to): LoRA
targets, adapters as input, freeze's layers, and the stage's loss settings and objective.
:func:`check_finetuning` is one step of :data:`hpc_mca.config.rules.RESOLVE_STEPS`, run after
the stage and the model passed theirs.

What is checked for a stage is read from its registry row (:class:`hpc_mca.stages.Stage`),
never from its name or its kind of rows: each setting its loss reads (``loss_settings``: dpo's
preference loss and reference, kto's weights, β), and what its objective leaves out (MTP
losses, prompt tokens, packed rows, a micro-step of one example). A new stage with these
traits needs no edit here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hpc_mca.errors import UserError
from hpc_mca.stages import REFERENCE_FREE_LOSSES, Stage, get_stage, reference_runs
from hpc_mca.topology import Layout
from hpc_mca.topology.freeze import (
    FreezeError,
    FreezeRule,
    freeze_rule,
    freeze_sizing,
    hf_parameter_sizes,
    idle_pipeline_ranks,
    split_names,
)
from hpc_mca.topology.lora import LoraTargetError, resolve_lora_targets

from .adapters import check_adapters
from .checks import at_least as _at_least
from .checks import choice as _choice
from .choices import PREF_LOSSES
from .input import ConfigError
from .layout import lora_model, model_shape, model_type

if TYPE_CHECKING:  # the sections import the rules: a runtime import here would be a circle
    from hpc_mca.topology.model import ModelShape

    from .sections import TrainConfig

__all__ = ["check_finetuning", "check_micro_step"]

POSITIVE_SETTINGS = ("pref_beta", "kto_chosen_weight", "kto_rejected_weight")
"""Loss settings that must be > 0 where the stage's loss reads them."""


def check_finetuning(config: TrainConfig, world_size: int) -> None:
    """LoRA and freeze settings, adapters as input, and the stage's loss settings."""
    ft = config.finetuning
    _at_least("finetuning.lora_rank", ft.lora_rank, 1)
    if not 0.0 <= ft.lora_dropout < 1.0:
        raise ConfigError(f"finetuning.lora_dropout={ft.lora_dropout} must be in [0, 1)")
    if ft.finetuning_type == "freeze":
        _check_freeze(config)
    _check_vision_freeze(config)
    _check_adapters(config)
    if ft.finetuning_type == "lora":
        if ft.lora_alpha is None:
            ft.lora_alpha = 2.0 * ft.lora_rank
        _check_lora(config)
    elif config.training.export_merged_dir:
        raise ConfigError(f"training.export_merged_dir={config.training.export_merged_dir!r} "
                          "merges LoRA adapters into the base model; valid with "
                          "finetuning.finetuning_type='lora' (full runs: training.export_hf_dir)")
    stage = get_stage(ft.stage)
    _check_loss_settings(config, stage)
    _check_objective(config, stage)


VISION_FREEZE_DEFAULTS = {"freeze_vision_tower": True, "freeze_multi_modal_projector": True,
                          "freeze_language_model": False}
"""LLaMA-Factory's defaults for what of a vision-language model trains: the language model."""


def _check_vision_freeze(config: TrainConfig) -> None:
    """``freeze_vision_tower``/``_multi_modal_projector``/``_language_model`` choose what of a
    vision-language model trains under ``finetuning_type: full``; elsewhere only their defaults
    run (LoRA adapts the language model's linears, freeze picks its layers)."""
    ft = config.finetuning
    changed = {key: getattr(ft, key) for key, default in VISION_FREEZE_DEFAULTS.items()
               if getattr(ft, key) != default}
    if not changed:
        return
    key, value = next(iter(changed.items()))
    if model_shape(config.model.model_name_or_path).vision_params == 0:
        raise ConfigError(f"finetuning.{key}={value} with the text model "
                          f"{config.model.model_name_or_path!r}: it has no vision tower; valid: "
                          f"{VISION_FREEZE_DEFAULTS[key]} (a qwen2_vl or qwen2_5_vl model)")
    if ft.finetuning_type != "full":
        raise ConfigError(f"finetuning.{key}={value} with finetuning.finetuning_type="
                          f"{ft.finetuning_type!r}: only full fine-tuning trains the vision side "
                          f"or freezes the language model here; valid: {VISION_FREEZE_DEFAULTS[key]}, "
                          "or finetuning_type='full'")
    if ft.freeze_language_model and ft.freeze_vision_tower and ft.freeze_multi_modal_projector:
        raise ConfigError("finetuning.freeze_language_model=true with the vision tower and the "
                          "projector frozen: nothing would train; valid: freeze_vision_tower=false "
                          "or freeze_multi_modal_projector=false")


def _check_adapters(config: TrainConfig) -> None:
    """PEFT adapters as input (``config/adapters.py``): LoRA only, each a directory our LoRA
    layers can hold; the one that trains on gives ``finetuning.lora_*`` its shape."""
    if config.model.adapter_name_or_path or config.finetuning.ref_model_adapters:
        check_adapters(config, lora_model(model_shape(config.model.model_name_or_path)))


def _check_lora(config: TrainConfig) -> None:
    """The targets name modules of this model (one line naming the valid ones otherwise)."""
    ft = config.finetuning
    if isinstance(ft.lora_target, str):
        ft.lora_target = [ft.lora_target]
    shape = model_shape(config.model.model_name_or_path)
    try:
        targets = resolve_lora_targets(ft.lora_target, lora_model(shape),
                                       model_type=model_type(config.model.model_name_or_path))
    except LoraTargetError as err:
        raise ConfigError(str(err)) from None
    if config.model.mtp_num_layers:
        raise ConfigError(f"model.mtp_num_layers={config.model.mtp_num_layers} with "
                          "finetuning.finetuning_type='lora': MTP layers start untrained and "
                          "LoRA freezes them; valid: model.mtp_num_layers=0 or "
                          "finetuning_type='full'")
    tr = config.training
    if tr.use_mca and (tr.bf16 or tr.fp16):
        # The adapters stay float32 under bf16/fp16, and only the distributed optimizer keeps
        # (and checkpoints) float32 parameters: Megatron's other mixed-precision optimizer maps
        # half-precision ones only. Derived rather than refused so that LLaMA-Factory's LoRA
        # examples (bf16: true) run as written; with one data-parallel rank it shards nothing.
        config.parallel.use_distributed_optimizer = True
    if ft.lora_dropout and (targets.expert_fc1 or targets.expert_fc2):
        raise ConfigError(f"finetuning.lora_dropout={ft.lora_dropout} with adapters on MoE "
                          "experts: peft's expert adapters (target_parameters) apply no dropout, "
                          "so the exported adapter would not be the one trained; valid: 0, or "
                          "a finetuning.lora_target without gate_up_proj/down_proj")


def _check_freeze(config: TrainConfig) -> None:
    """LLaMA-Factory's freeze settings name layers and whole modules of this (dense) model."""
    ft, model_dir = config.finetuning, config.model.model_name_or_path
    shape = model_shape(model_dir)
    if shape.is_moe:
        raise ConfigError(f"finetuning.finetuning_type='freeze' with the MoE model {model_dir!r}: "
                          "transformers fuses its experts while its checkpoint numbers them, so "
                          "the layer patterns would pick other parameters on each backend; "
                          "valid: a dense model, or finetuning_type 'full' or 'lora'")
    if config.model.mtp_num_layers:
        raise ConfigError(f"model.mtp_num_layers={config.model.mtp_num_layers} with "
                          "finetuning.finetuning_type='freeze': MTP layers have no HF names for "
                          "the freeze rule; valid: model.mtp_num_layers=0")
    ft.freeze_trainable_modules = split_names(ft.freeze_trainable_modules)
    ft.freeze_extra_modules = split_names(ft.freeze_extra_modules) or None
    try:
        rule = freeze_rule(hf_parameter_sizes(shape), shape.num_layers, ft.freeze_trainable_layers,
                           ft.freeze_trainable_modules, ft.freeze_extra_modules)
    except FreezeError as err:
        raise ConfigError(str(err)) from None
    if config.training.use_mca:
        _check_freeze_stages(config, shape, rule)


def _check_freeze_stages(config: TrainConfig, shape: ModelShape, rule: FreezeRule) -> None:
    """Every pipeline rank trains something: a rank with nothing to train has an empty
    optimizer, whose state Megatron can neither save (the distributed optimizer) nor, written
    by rank 0 as the checkpoint's common state, load on the others."""
    par = config.parallel
    try:  # only the pipeline matters here (TP, EP... are derived later)
        layout = Layout(pp=par.pipeline_model_parallel_size, vp=par.virtual_pipeline_model_parallel_size,
                        pipeline_layout=tuple(par.pipeline_layout) if par.pipeline_layout else None)
    except UserError:
        return  # the parallel rules report the layout
    idle = idle_pipeline_ranks(shape, layout, freeze_sizing(shape, rule))
    if idle:
        ft = config.finetuning
        raise ConfigError(f"finetuning.freeze_trainable_layers={ft.freeze_trainable_layers} with "
                          f"parallel.pipeline_model_parallel_size={layout.pp}: pipeline stage(s) "
                          f"{', '.join(map(str, idle))} would train nothing, which Megatron's "
                          "optimizer checkpoints cannot hold; valid: trained layers (or "
                          "freeze_extra_modules) on every stage, a smaller pipeline size, or "
                          "parallel.pipeline_layout moving trained layers there")


def _check_loss_settings(config: TrainConfig, stage: Stage) -> None:
    """Each ``finetuning.*`` setting the stage's loss reads (its row's ``loss_settings``)."""
    ft, reads = config.finetuning, stage.loss_settings
    if "pref_loss" in reads:
        _choice("finetuning.pref_loss", ft.pref_loss, PREF_LOSSES)
    for name in POSITIVE_SETTINGS:
        value = getattr(ft, name)
        if name in reads and not value > 0:
            raise ConfigError(f"finetuning.{name}={value} must be > 0 with finetuning.stage={stage.name!r}")
    if "dpo_label_smoothing" in reads:
        if not 0.0 <= ft.dpo_label_smoothing < 0.5:
            raise ConfigError(f"finetuning.dpo_label_smoothing={ft.dpo_label_smoothing} must be in "
                              "[0, 0.5)")
        if ft.dpo_label_smoothing and ft.pref_loss != "sigmoid":
            raise ConfigError(f"finetuning.dpo_label_smoothing={ft.dpo_label_smoothing} applies to "
                              f"pref_loss='sigmoid' only, not {ft.pref_loss!r}; valid: 0")
    if "pref_ftx" in reads:
        _at_least("finetuning.pref_ftx", ft.pref_ftx, 0.0)
    if "ref_model" in reads:
        _check_reference(config)


def _check_objective(config: TrainConfig, stage: Stage) -> None:
    """What the stage's objective leaves out (its row's traits): MTP losses, prompt tokens,
    packed rows; a packed row holds a whole example."""
    data, name = config.data, stage.name
    if config.model.mtp_num_layers and not stage.mtp_loss:
        raise ConfigError(f"model.mtp_num_layers={config.model.mtp_num_layers} with "
                          f"finetuning.stage={name!r}: MTP losses are not part of the {name} "
                          "objective; valid: model.mtp_num_layers=0")
    if data.train_on_prompt and stage.answers_only:
        raise ConfigError(f"data.train_on_prompt=true with finetuning.stage={name!r}: its loss "
                          "scores answers only; valid: false")
    if data.sequence_packing and not stage.packing:
        raise ConfigError(f"data.sequence_packing=true with finetuning.stage={name!r}: its loss "
                          "reads unpacked rows (built per micro-batch); valid: false")
    need = stage.rows_per_example * data.cutoff_len
    if data.sequence_packing and stage.rows_per_example > 1 and (data.seq_length or data.cutoff_len) < need:
        whole = "pair" if stage.rows_per_example == 2 else "example"
        raise ConfigError(f"data.seq_length={data.seq_length or data.cutoff_len} with "
                          f"sequence_packing and finetuning.stage={name!r}: a packed row must hold "
                          f"a whole {whole} of up to {stage.rows_per_example} × cutoff_len={need} "
                          f"tokens; valid: data.seq_length >= {need}")


def _check_reference(config: TrainConfig) -> None:
    """simpo_gamma only with simpo; use_ref_model true only where the loss has a reference;
    ref_model only where a reference runs, a model of the policy's family and shape (the
    reference is built in the policy's layout, and the log-ratios compare the same tokens)."""
    ft = config.finetuning
    if ft.simpo_gamma != type(ft).simpo_gamma and ft.pref_loss != "simpo":  # not the default
        raise ConfigError(f"finetuning.simpo_gamma={ft.simpo_gamma} acts only with "
                          f"pref_loss='simpo', not {ft.pref_loss!r}; valid: remove it, or "
                          "pref_loss simpo")
    if ft.use_ref_model and ft.pref_loss in REFERENCE_FREE_LOSSES:
        raise ConfigError(f"finetuning.use_ref_model=true with pref_loss={ft.pref_loss!r}: "
                          f"{ft.pref_loss} is reference-free; valid: remove it (or false), or "
                          "pref_loss sigmoid, ipo or hinge")
    if ft.ref_model is None:
        return
    if not reference_runs(ft.stage, ft.pref_loss, ft.use_ref_model):
        raise ConfigError(f"finetuning.ref_model={ft.ref_model!r} with a reference-free run "
                          f"(pref_loss={ft.pref_loss!r}, use_ref_model={ft.use_ref_model}); "
                          "valid: remove it, or pref_loss sigmoid, ipo or hinge with a reference")
    if not (Path(ft.ref_model) / "config.json").is_file():
        raise ConfigError(f"finetuning.ref_model={ft.ref_model!r} has no config.json; valid: "
                          "an HF model directory (models are never downloaded)")
    policy, theirs = config.model.model_name_or_path, ft.ref_model
    if model_type(theirs) != model_type(policy) or model_shape(theirs) != model_shape(policy):
        raise ConfigError(f"finetuning.ref_model={ft.ref_model!r} is a {model_type(theirs)} "
                          f"of another shape than model.model_name_or_path ({model_type(policy)}); "
                          "valid: a model of the same family, sizes and vocabulary")


def check_micro_step(config: TrainConfig, world_size: int) -> None:
    """A micro-step (``per_device_train_batch_size`` × data-parallel ranks) holds at least the
    examples the stage's loss relates (its row's ``micro_step_examples``): kto pairs each
    example's KL row with another example's answer within the micro-step
    (hpc_mca.data.feedback), so with one example there it would pair with itself, and the KL
    estimate would be its own reward (TRL's KTOTrainer refuses that micro-batch too). Run after
    the parallel rules derive the data-parallel size."""
    stage = get_stage(config.finetuning.stage)
    least = stage.micro_step_examples
    micro, dp = config.training.per_device_train_batch_size, config.parallel.data_parallel_size or 1
    if micro * dp < least:
        raise ConfigError(f"training.per_device_train_batch_size={micro} on {dp} data-parallel "
                          f"rank(s) with finetuning.stage={stage.name!r}: its loss relates each "
                          f"example to another of its micro-step, which needs {least} or more; "
                          f"valid: per_device_train_batch_size >= {-(-least // dp)}, or {least} or "
                          "more data-parallel ranks")
