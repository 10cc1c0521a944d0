"""The standard backend's model: the transformers model with packed attention, LoRA through peft,
the optimizer and LR schedule of the Megatron backend, and the exports.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from hpc_mca.config.schedule import build_lr_scheduler, resolve_warmup_steps, scheduler_spec
from hpc_mca.config.sections import FinetuningArguments, TrainConfig
from hpc_mca.loop.optimizer import optimizer_config, use_fused_adam
from hpc_mca.models import hf_attention
from hpc_mca.models.converters import converter_for
from hpc_mca.models.vl_config import VL_MODEL_TYPES
from hpc_mca.models.vocab import grow_hf_model
from hpc_mca.models.vocab_growth import vocab_growth

if TYPE_CHECKING:  # megatron is imported lazily, inside the functions that use it
    from megatron.core.optimizer import OptimizerConfig
    from transformers import PreTrainedModel

__all__ = ["LRSchedule", "build_hf_model", "build_optimizer", "export_model", "load_hf_model"]


class LRSchedule(Protocol):
    """What the standard backend calls of the run's LR schedule, Megatron's scheduler of
    :func:`hpc_mca.config.schedule.build_lr_scheduler` (a class made on first use, so that
    importing the schedule module does not import megatron: nothing to import for a type)."""

    def step(self, increment: int = 1) -> None: ...

    def get_last_lr(self) -> list[float]: ...


def build_hf_model(config: TrainConfig, device: torch.device) -> torch.nn.Module:
    """The transformers model in float32 (bf16/fp16 run under autocast, with float32 weights
    as the Megatron backend's master weights), attention ``hpc_mca_packed``: the directory's
    weights, or (a config-only directory) transformers' own initialisation seeded with
    ``training.seed``; its vocabulary grown when ``model.resize_vocab`` needs it
    (:mod:`hpc_mca.models.vocab`); then as the finetuning type's converter makes it (LoRA:
    wrapped by peft). A vision-language model (``qwen2_vl``, ``qwen2_5_vl``) is transformers'
    image-text-to-text class of its family, the packed attention on its language model only
    (:func:`_attention`)."""
    path = Path(config.model.model_name_or_path)
    model = load_hf_model(path, seed=config.training.seed)
    growth = vocab_growth(path)  # model.resize_vocab, recorded by the run's checks
    if growth is not None:  # the auto classes made a PreTrainedModel
        grow_hf_model(cast("PreTrainedModel", model), growth)
    model = converter_for(config.finetuning, config.model.adapter_name_or_path).convert_hf_model(
        model, model_path=config.model.model_name_or_path, seed=config.training.seed)
    return model.to(device)


def load_hf_model(path: Path, *, seed: int | None = None) -> torch.nn.Module:
    """transformers' model of the directory ``path`` in float32 on the CPU, with the packed
    attention (:func:`_attention`): its weights, or for a config-only directory transformers'
    own initialisation (drawn after ``torch.manual_seed(seed)`` when a seed is given). A
    vision-language config (``qwen2_vl``, ``qwen2_5_vl``) makes the family's image-text-to-text
    class, a text one the causal LM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    hf_config = AutoConfig.from_pretrained(path)
    vl = getattr(hf_config, "model_type", None) in VL_MODEL_TYPES
    auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
    model: torch.nn.Module
    if any(path.glob("*.safetensors")):
        model = auto.from_pretrained(path, attn_implementation=_attention(vl), dtype=torch.float32)
    else:
        if seed is not None:
            torch.manual_seed(seed)
        model = auto.from_config(hf_config, attn_implementation=_attention(vl), dtype=torch.float32)
    return model


def _attention(vl: bool) -> str | dict[str, str]:
    """transformers' ``attn_implementation``: ``hpc_mca_packed`` (registered here); for a
    vision-language model on the language model only. Its vision tower attends within each
    image itself (one call per image, no position ids to tell packed documents apart) and keeps
    sdpa, as the Megatron backend's tower does (:func:`hpc_mca.models.vl_config.build_vision_tower`)."""
    name = hf_attention.register()
    return {"": name, "text_config": name, "vision_config": "sdpa"} if vl else name


def _param_groups(model: torch.nn.Module, opt_config: OptimizerConfig) -> list[dict[str, Any]]:
    """The Megatron backend's param groups for the HF model's trainable parameters: decay, and
    no decay (Megatron's rule: biases and 1-D parameters, i.e. the norms; LoRA's A and B are
    matrices and decay).

    Megatron's scheduler sets each group's ``weight_decay`` to the run's rate × ``wd_mult`` (1
    when absent) at construction and every step, so the no-decay group says so through
    ``wd_mult``, as Megatron's groups do: a bare ``weight_decay: 0`` would be overwritten. The
    rate needs no per-group key: with no ``max_lr`` a group follows the scheduler's, which is
    the ``learning_rate`` Megatron writes into each of its groups. Two groups even when one is
    empty (LoRA), so a checkpoint's optimizer state keeps its shape.
    """
    skips_decay = _megatron_no_decay_rule(opt_config)
    decay: list[torch.nn.Parameter] = []
    plain: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (plain if skips_decay(param, name) else decay).append(param)
    return [{"params": decay, "wd_mult": 1.0, "weight_decay": opt_config.weight_decay},
            {"params": plain, "wd_mult": 0.0, "weight_decay": 0.0}]


def _megatron_no_decay_rule(
        opt_config: OptimizerConfig) -> Callable[[torch.nn.Parameter, str], bool]:
    """Whether a parameter skips weight decay, by the keys Megatron's optimizer builds its
    groups from for the same OptimizerConfig (``*.bias`` or 1-D; HF's names end the same), so
    the backends stay together if Megatron refines the rule."""
    from megatron.core.optimizer import get_standard_config_overrides

    keys = [key for key, override in get_standard_config_overrides(opt_config).items()
            if override.get("wd_mult") == 0.0]
    return lambda param, name: any(key.matches(param, name) for key in keys)


def _keep_wd_mult(optimizer: torch.optim.Optimizer) -> None:
    """Loading a checkpoint replaces the groups' keys with the saved ones, and a checkpoint
    from before the groups had ``wd_mult`` would decay the norms again: this run's rule is
    put back after every load."""
    wd_mults = [group["wd_mult"] for group in optimizer.param_groups]

    def restore(loaded: torch.optim.Optimizer) -> None:
        for group, wd_mult in zip(loaded.param_groups, wd_mults):
            group["wd_mult"] = wd_mult

    optimizer.register_load_state_dict_post_hook(restore)


def build_optimizer(model: torch.nn.Module, config: TrainConfig, max_steps: int
                    ) -> tuple[torch.optim.AdamW, LRSchedule]:
    """AdamW (the Megatron backend's settings, param groups and fused kernel) and the run's LR
    schedule."""
    tr = config.training
    spec = scheduler_spec(tr.lr_scheduler_type, tr.lr_scheduler_kwargs, tr.learning_rate,
                          resolve_warmup_steps(tr.warmup_steps, tr.warmup_ratio, max_steps),
                          max_steps)
    opt_config = optimizer_config(tr, config.parallel, min_lr=spec.min_lr)
    optimizer = torch.optim.AdamW(_param_groups(model, opt_config), lr=tr.learning_rate,
                                  betas=(tr.adam_beta1, tr.adam_beta2), eps=tr.adam_epsilon)
    _keep_wd_mult(optimizer)
    if tr.fused_optimizer:
        use_fused_adam(optimizer)
    return optimizer, build_lr_scheduler(spec, optimizer, weight_decay=tr.weight_decay)


def export_model(model: torch.nn.Module, out: Path, finetuning: FinetuningArguments, model_dir: Path, *,
                 merged: bool) -> None:
    """The trained model as an HF directory, as the finetuning type's converter exports it
    (LoRA: the PEFT adapter; ``merged``: the base with the adapters merged in), with the same
    files beside the weights as the Megatron backend's exports
    (:func:`hpc_mca.models.export.write_companion_files` from ``model_dir``, the base model's
    directory; rank 0)."""
    from hpc_mca.models.export import write_companion_files

    model = getattr(model, "module", model)  # DDP
    out.mkdir(parents=True, exist_ok=True)
    what = converter_for(finetuning).export_hf_model(model, out, merged=merged)
    write_companion_files(out, model_dir)
    print(f"exported {what} to {out}", flush=True)
