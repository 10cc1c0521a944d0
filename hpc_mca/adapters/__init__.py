"""LoRA on a Megatron chunk by a script's own peft calls, under mcore_adapter's names:

    from hpc_mca.adapters import apply_megatron_lora, find_all_linear_modules, set_linear_is_expert

    apply_megatron_lora()
    set_linear_is_expert(model[0])
    model[0].enable_input_require_grads()
    model.models[0] = get_peft_model(model[0], LoraConfig(
        r=8, lora_alpha=16, target_modules=find_all_linear_modules(model[0])))

The adapters are this trainer's own LoRA layers (:mod:`hpc_mca.models.lora_peft`), so the run
is the one ``finetuning_type: lora`` gives with the same rank, alpha, dropout and targets.
"""

from __future__ import annotations

import torch

__all__ = ["apply_megatron_lora", "find_all_linear_modules", "set_linear_is_expert"]


def apply_megatron_lora() -> None:
    """Let peft's ``get_peft_model`` / ``inject_adapter_in_model`` put LoRA on the Megatron
    linears of a chunk ``AutoModel`` built (:func:`hpc_mca.models.lora_peft.register_megatron_lora`)."""
    from hpc_mca.models.lora_peft import register_megatron_lora

    register_megatron_lora()


def find_all_linear_modules(model: torch.nn.Module) -> list[str]:
    """The names (last part: ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``)
    of the linears LoRA may adapt in ``model``'s decoder layers, sorted: peft's
    ``target_modules`` for every one (the output layer and the router are left out)."""
    from hpc_mca.models.lora_peft import adaptable_linears

    return sorted({name.rsplit(".", 1)[-1] for name in adaptable_linears(model)})


def set_linear_is_expert(model: torch.nn.Module) -> None:
    """Mark the linears of MoE experts as expert parameters (``is_expert``), which Megatron's
    DDP reduces over the expert-data-parallel group. Megatron's local experts mark themselves
    when built; this marks any that are not (it changes nothing in a chunk AutoModel built)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for name, module in model.named_modules():
        if ".experts." in f".{name}." and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.is_expert = True
