"""The rules of what trains and how (``finetuning.*`` with the model it applies to): LoRA
targets, adapters as input, freeze's layers, and each stage's loss settings (dpo's preference
losses and reference, kto's weights). :func:`check_finetuning` is one step of
:data:`hpc_mca.config.rules.RESOLVE_STEPS`, run after the stage and the model passed theirs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_mca.errors import UserError
from hpc_mca.stages import (
    FEEDBACK,
    PREFERENCE_PAIR,
    REFERENCE_FREE_LOSSES,
    get_stage,
    reference_runs,
)
from hpc_mca.topology import Layout
from hpc_mca.topology.freeze import (
    FreezeError,
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
from .layout import model_shape, model_type

if TYPE_CHECKING:  # the sections import the rules: a runtime import here would be a circle
    from .sections import TrainConfig

__all__ = ["check_finetuning", "check_kto_micro_step"]


def check_finetuning(config: TrainConfig, world_size: int) -> None:
    """LoRA and freeze settings, adapters as input, and the stage's loss settings."""
    ft = config.finetuning
    _at_least("finetuning.lora_rank", ft.lora_rank, 1)
    if not 0.0 <= ft.lora_dropout < 1.0:
        raise ConfigError(f"finetuning.lora_dropout={ft.lora_dropout} must be in [0, 1)")
    if ft.finetuning_type == "freeze":
        _check_freeze(config)
    _check_adapters(config)
    if ft.finetuning_type == "lora":
        if ft.lora_alpha is None:
            ft.lora_alpha = 2.0 * ft.lora_rank
        _check_lora(config)
    elif config.training.export_merged_dir:
        raise ConfigError(f"training.export_merged_dir={config.training.export_merged_dir!r} "
                          "merges LoRA adapters into the base model; valid with "
                          "finetuning.finetuning_type='lora' (full runs: training.export_hf_dir)")
    if get_stage(ft.stage).reads == PREFERENCE_PAIR:
        _check_dpo(config)
    if get_stage(ft.stage).reads == FEEDBACK:
        _check_kto(config)


def _check_adapters(config: TrainConfig) -> None:
    """PEFT adapters as input (``config/adapters.py``): LoRA only, each a directory our LoRA
    layers can hold; the one that trains on gives ``finetuning.lora_*`` its shape."""
    if config.model.adapter_name_or_path or config.finetuning.ref_model_adapters:
        check_adapters(config, model_shape(config.model.model_name_or_path).is_moe)


def _check_lora(config: TrainConfig) -> None:
    """The targets name modules of this model (one line naming the valid ones otherwise)."""
    ft = config.finetuning
    if isinstance(ft.lora_target, str):
        ft.lora_target = [ft.lora_target]
    shape = model_shape(config.model.model_name_or_path)
    try:
        targets = resolve_lora_targets(ft.lora_target, is_moe=shape.is_moe,
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


def _check_freeze_stages(config: TrainConfig, shape: Any, rule: Any) -> None:
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


def _check_dpo(config: TrainConfig) -> None:
    ft, data = config.finetuning, config.data
    _choice("finetuning.pref_loss", ft.pref_loss, PREF_LOSSES)
    if not ft.pref_beta > 0:
        raise ConfigError(f"finetuning.pref_beta={ft.pref_beta} must be > 0")
    if not 0.0 <= ft.dpo_label_smoothing < 0.5:
        raise ConfigError(f"finetuning.dpo_label_smoothing={ft.dpo_label_smoothing} must be in "
                          "[0, 0.5)")
    if ft.dpo_label_smoothing and ft.pref_loss != "sigmoid":
        raise ConfigError(f"finetuning.dpo_label_smoothing={ft.dpo_label_smoothing} applies to "
                          f"pref_loss='sigmoid' only, not {ft.pref_loss!r}; valid: 0")
    _at_least("finetuning.pref_ftx", ft.pref_ftx, 0.0)
    _check_reference(config)
    if config.model.mtp_num_layers:
        raise ConfigError(f"model.mtp_num_layers={config.model.mtp_num_layers} with "
                          "finetuning.stage='dpo': MTP losses are not part of the preference "
                          "objective; valid: model.mtp_num_layers=0")
    if data.train_on_prompt:
        raise ConfigError("data.train_on_prompt=true with finetuning.stage='dpo': the "
                          "preference compares answers only; valid: false")
    need = 2 * data.cutoff_len
    if data.sequence_packing and (data.seq_length or data.cutoff_len) < need:
        raise ConfigError(f"data.seq_length={data.seq_length or data.cutoff_len} with "
                          f"sequence_packing and finetuning.stage='dpo': a packed row must hold "
                          f"a whole pair of up to 2 × cutoff_len={need} tokens; valid: "
                          f"data.seq_length >= {need}")


def _check_kto(config: TrainConfig) -> None:
    """kto (hpc_mca.loop.kto): β and both weights positive; what its objective leaves out
    (MTP, prompt training) and packed rows (each micro-batch builds its KL rows) refused."""
    ft, data = config.finetuning, config.data
    for name in ("pref_beta", "kto_chosen_weight", "kto_rejected_weight"):
        value = getattr(ft, name)
        if not value > 0:
            raise ConfigError(f"finetuning.{name}={value} must be > 0 with finetuning.stage='kto'")
    if config.model.mtp_num_layers:
        raise ConfigError(f"model.mtp_num_layers={config.model.mtp_num_layers} with "
                          "finetuning.stage='kto': MTP losses are not part of the kto objective; "
                          "valid: model.mtp_num_layers=0")
    if data.train_on_prompt:
        raise ConfigError("data.train_on_prompt=true with finetuning.stage='kto': kto scores "
                          "answers only; valid: false")
    if data.sequence_packing:
        raise ConfigError("data.sequence_packing=true with finetuning.stage='kto': each "
                          "micro-batch builds its KL rows unpacked; valid: false")


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


def check_kto_micro_step(config: TrainConfig, world_size: int) -> None:
    """kto pairs each example's KL row with another example's answer within the micro-step
    (``per_device_train_batch_size`` × data-parallel ranks, hpc_mca.data.feedback): with one
    example there it would pair with itself, and the KL estimate would be its own reward
    (TRL's KTOTrainer refuses that micro-batch too). Run after the parallel rules derive the
    data-parallel size."""
    if get_stage(config.finetuning.stage).reads != FEEDBACK:
        return
    micro, dp = config.training.per_device_train_batch_size, config.parallel.data_parallel_size or 1
    if micro * dp < 2:
        raise ConfigError(f"training.per_device_train_batch_size={micro} on {dp} data-parallel "
                          "rank(s) with finetuning.stage='kto': a micro-step of one example pairs "
                          "its KL row with its own answer, so the KL estimate is its own reward; "
                          "valid: per_device_train_batch_size >= 2, or 2 or more data-parallel ranks")
