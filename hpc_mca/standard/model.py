"""The standard backend's model: the transformers model with packed attention, LoRA through peft,
the optimizer and LR schedule of the Megatron backend, and the exports.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from hpc_mca.models import hf_attention
from hpc_mca.trainer.config import TrainConfig
from hpc_mca.trainer.fused_optimizer import use_fused_adam
from hpc_mca.trainer.lr_scheduler import build_lr_scheduler, resolve_warmup_steps, scheduler_spec

__all__ = ["build_hf_model", "build_optimizer", "export_model"]


def build_hf_model(config: TrainConfig, device: torch.device) -> torch.nn.Module:
    """The transformers model in float32 (bf16/fp16 run under autocast, with float32 weights
    as the Megatron backend's master weights), attention ``hpc_mca_packed``: the directory's
    weights, or (a config-only directory) transformers' own initialisation seeded with
    ``training.seed``; with ``finetuning_type: lora`` wrapped by peft."""
    from transformers import AutoConfig, AutoModelForCausalLM

    name = hf_attention.register()
    path = Path(config.model.model_name_or_path)
    if any(path.glob("*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name,
                                                     dtype=torch.float32)
    else:
        torch.manual_seed(config.training.seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                                 attn_implementation=name, dtype=torch.float32)
    if config.finetuning.finetuning_type == "lora":
        model = _with_lora(model, config)
    return model.to(device)


def _with_lora(model: torch.nn.Module, config: TrainConfig) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    from hpc_mca.models.hf_config import read_hf_config
    from hpc_mca.topology.lora import resolve_lora_targets

    ft = config.finetuning
    spec = read_hf_config(config.model.model_name_or_path)
    targets = resolve_lora_targets(ft.lora_target, is_moe=spec.is_moe)
    parameters = targets.hf_parameters(spec.moe_prefix)
    lora = LoraConfig(r=ft.lora_rank, lora_alpha=ft.lora_alpha, lora_dropout=ft.lora_dropout,
                      target_modules=targets.hf_modules() or None,
                      target_parameters=parameters or None, task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    _seed_adapters(model, config.training.seed)
    return model


@torch.no_grad()
def _seed_adapters(model: torch.nn.Module, seed: int) -> None:
    """Each A from the Megatron backend's seeded draw for its HF module (B stays zero), so
    both backends start a LoRA run from the same adapters."""
    from peft.tuners.lora import LoraLayer

    from hpc_mca.models.lora import initial_a

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            hf_name = name.removeprefix("base_model.model.")
            for a in module.lora_A.values():
                a.weight.copy_(initial_a(hf_name, *a.weight.shape, seed))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Megatron's default: no weight decay on biases and 1-D parameters (norms)."""
    decay, plain = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (plain if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": plain, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, config: TrainConfig, max_steps: int) -> tuple[Any, Any]:
    """AdamW (the Megatron backend's settings and fused kernel) and the run's LR schedule."""
    tr = config.training
    optimizer = torch.optim.AdamW(_param_groups(model, tr.weight_decay), lr=tr.learning_rate,
                                  betas=(tr.adam_beta1, tr.adam_beta2), eps=tr.adam_epsilon)
    if tr.fused_optimizer:
        use_fused_adam(optimizer)
    spec = scheduler_spec(tr.lr_scheduler_type, tr.lr_scheduler_kwargs, tr.learning_rate,
                          resolve_warmup_steps(tr.warmup_steps, tr.warmup_ratio, max_steps),
                          max_steps)
    return optimizer, build_lr_scheduler(spec, optimizer, weight_decay=tr.weight_decay)


def export_model(model: torch.nn.Module, out: Path, config: TrainConfig, *, merged: bool) -> None:
    """The trained model as an HF directory (LoRA: the PEFT adapter; ``merged``: the base with
    the adapters merged in), with the source directory's tokenizer files (rank 0)."""
    from hpc_mca.models.export import TOKENIZER_FILES

    model = getattr(model, "module", model)  # DDP
    if merged:
        model = copy.deepcopy(model).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    source = Path(config.model.model_name_or_path)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            (out / name).write_bytes((source / name).read_bytes())
    print(f"exported {'HF model (LoRA merged)' if merged else 'model'} to {out}", flush=True)
