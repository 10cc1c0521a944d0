"""``finetuning_type: freeze`` applied to a model: every parameter the rule
(:mod:`hpc_mca.topology.freeze`, LLaMA-Factory's) does not pick stops requiring gradients.

On the Megatron backend a parameter holds pieces of HF tensors (:mod:`.mapping`): it trains
when the HF tensors it holds do, numbered model-wide (``layer_number``), so a pipeline stage
trains exactly its share of what the whole model trains. A tied output layer holds
``embed_tokens`` and trains with it. Done before DDP wraps the chunks: Megatron's DDP gives
gradient buffers, and its optimizer state, to trainable parameters only, and a checkpoint then
holds only them (``checkpoint.state``), the frozen rest coming from the HF weights again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hpc_mca.config.sections import FinetuningArguments
from hpc_mca.models.errors import ModelLoadError
from hpc_mca.models.hf_config import HFModelSpec, read_hf_config
from hpc_mca.models.mapping import hf_tensor_shapes
from hpc_mca.topology.freeze import FreezeRule, freeze_rule

if TYPE_CHECKING:  # transformers is imported by the standard backend, not here
    from transformers import PreTrainedModel

__all__ = ["freeze_chunks", "freeze_hf_model", "freeze_vision_parts", "rule_for", "trains_part"]

_TRAINS_PART = "_hpc_mca_trains_part"


def trains_part(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a GPTModel chunk) was frozen in part by :func:`freeze_chunks`: its
    checkpoint holds its trained layers one by one, whatever this chunk alone trains, so that
    every rank of the job writes the same kind of keys."""
    return getattr(model, _TRAINS_PART, False)


def rule_for(finetuning: FinetuningArguments, names: list[str], num_layers: int) -> FreezeRule:
    """The freeze rule of ``finetuning`` for a model with these HF parameter names."""
    ft = finetuning
    return freeze_rule(names, num_layers, ft.freeze_trainable_layers, ft.freeze_trainable_modules,
                       ft.freeze_extra_modules)


def freeze_chunks(chunks: list[torch.nn.Module], finetuning: FinetuningArguments, *,
                  model_path: str) -> list[torch.nn.Module]:
    """Freeze what the rule does not train in this rank's Megatron chunks (in place)."""
    from hpc_mca.models.weights import local_plans, unwrap

    spec = read_hf_config(model_path)
    rule = rule_for(finetuning, list(hf_tensor_shapes(spec)), spec.num_layers)
    for chunk in chunks:
        setattr(unwrap(chunk), _TRAINS_PART, True)
        for plan, param in local_plans(chunk, spec):
            if not isinstance(param, torch.nn.Parameter):
                continue  # a buffer (a router's expert bias): never trained
            param.requires_grad_(_trains(rule, plan.name, [p.hf_name for p in plan.pieces], spec))
        for name, param in chunk.named_parameters():
            if name.startswith("mtp."):  # the config rules refuse MTP with freeze: a guard
                raise ModelLoadError(f"freeze: MTP parameter {name} has no HF name to match")
    return chunks


def _trains(rule: FreezeRule, name: str, hf_names: list[str], spec: HFModelSpec) -> bool:
    """Whether Megatron parameter ``name`` trains: all the HF tensors it holds do, or none."""
    verdicts = {hf: rule.trains(hf) for hf in hf_names}
    if not verdicts:  # a TP shard of vocabulary padding only: follows its table
        table = "lm_head.weight" if name == "output_layer.weight" and not spec.tie_word_embeddings \
            else "model.embed_tokens.weight"
        return rule.trains(table)
    if len(set(verdicts.values())) > 1:
        trained = sorted(hf for hf, on in verdicts.items() if on)
        raise ModelLoadError(f"freeze: Megatron parameter {name} holds {', '.join(verdicts)} "
                             f"but only {', '.join(trained)} would train; valid: whole modules "
                             "(freeze_trainable_modules: all, self_attn, mlp, ...)")
    return next(iter(verdicts.values()))


def freeze_hf_model(model: PreTrainedModel, finetuning: FinetuningArguments) -> PreTrainedModel:
    """Freeze what the rule does not train in the transformers model (in place), by the
    model's own parameter names, as LLaMA-Factory applies it."""
    names = [name for name, _ in model.named_parameters()]
    rule = rule_for(finetuning, names, model.config.num_hidden_layers)
    for name, param in model.named_parameters():
        param.requires_grad_(rule.trains(name))
    return model


VISION_TOWER = ("visual.patch_embed", "visual.blocks", "visual.pos_embed",
                "visual.deepstack_merger_list")
"""A Qwen2-VL/Qwen2.5-VL/Qwen3-VL vision encoder's parameters, by name (LLaMA-Factory's keys;
Qwen3-VL's also name its position embeddings and deepstack mergers, which the other towers lack;
the same in the HF model and in a Megatron chunk, which holds transformers' tower as
``visual``)."""
PROJECTOR = ("visual.merger",)
"""The merger that projects vision features into the language model's width."""


def freeze_vision_parts(model: torch.nn.Module, finetuning: FinetuningArguments) -> None:
    """``freeze_vision_tower``/``freeze_multi_modal_projector``/``freeze_language_model`` on a
    vision-language model (a Megatron chunk or the HF model): the parts they name stop
    requiring gradients, as LLaMA-Factory's full fine-tuning does. The language model is
    every parameter outside ``visual``; a text model has none of these parts to freeze."""
    frozen = (VISION_TOWER if finetuning.freeze_vision_tower else ()) + \
        (PROJECTOR if finetuning.freeze_multi_modal_projector else ())
    for name, param in model.named_parameters():
        vision = ".visual." in f".{name}"
        if (vision and any(key in name for key in frozen)) or \
                (not vision and finetuning.freeze_language_model):
            param.requires_grad_(False)
