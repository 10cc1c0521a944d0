"""PEFT LoRA adapter directories as input: merged into the base, or loaded to train further.

The reverse of :mod:`.adapter_export`, on the same plan: ``adapter_config.json`` (peft's
``LoraConfig``) and ``adapter_model.safetensors`` (peft's tensor names, experts stacked as
peft stacks them) onto this rank's Megatron chunks, under any TP/PP/EP layout.

An adapter is loaded by injecting our LoRA layers (:func:`~.lora.apply_lora`) with the
adapter's own rank, alpha and targets and copying this rank's pieces of each HF adapter
tensor into them: the pieces :mod:`.adapter_export` would send back for the same layer, so
the two directions cannot disagree. Merging one (``model.adapter_name_or_path`` as
LLaMA-Factory reads it: every adapter but the one that trains on) then adds
``scaling · B @ A`` to the base weight slice each layer holds (the layer's own
:meth:`~.lora.MegatronLoraLinear.delta_weight`, laid out as the fused qkv / gate-up weight
this rank holds) and puts the plain Megatron linear back, so the next adapter sees a plain
model, as ``peft``'s ``merge_and_unload`` leaves the transformers model.

What an adapter may hold (LoRA on the decoder layers' linears, no ``modules_to_save``, no
DoRA, rsLoRA or per-module ranks) is checked before any allocation by ``config.rules``;
the checks here guard the tensors themselves (shapes, a name the plan does not know).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from hpc_mca.config.adapters import adapter_shape
from hpc_mca.config.sections import FinetuningArguments
from hpc_mca.models.adapter_export import ADAPTER_FILE, layer_pieces
from hpc_mca.models.errors import ModelLoadError
from hpc_mca.models.hf_config import HFModelSpec, read_hf_config
from hpc_mca.models.lora import MegatronLoraLinear, apply_lora, lora_layers
from hpc_mca.models.vl_config import lora_checkpoint_name
from hpc_mca.models.weights import shard_coords, unwrap

__all__ = ["adapter_finetuning", "load_adapter", "merge_adapter", "merge_adapters", "read_adapter_tensors",
           "split_adapters"]

_PEFT_PREFIX = "base_model.model."
_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
"""transformers' fused expert weights, in the order peft nests their wrappers (innermost first)."""


def split_adapters(paths: Sequence[str] | None, create_new: bool) -> tuple[list[str], str | None]:
    """(adapters merged into the base in order, the adapter that trains on or None), as
    LLaMA-Factory splits ``adapter_name_or_path`` for a trainable model."""
    paths = list(paths or [])
    if not paths or create_new:
        return paths, None
    return paths[:-1], paths[-1]


def adapter_finetuning(finetuning: FinetuningArguments, path: str, spec: HFModelSpec) -> FinetuningArguments:
    """``finetuning`` with the rank, alpha, dropout and targets of the adapter at ``path``
    (the shape our LoRA layers must have to hold it; read as the config rules read it)."""
    return dataclasses.replace(finetuning, **adapter_shape("model.adapter_name_or_path", path,
                                                               spec.lora_model()))


def read_adapter_tensors(path: str, spec: HFModelSpec) -> dict[str, torch.Tensor]:
    """The adapter's tensors (float32) under the names :mod:`.adapter_export` plans with:
    ``model.layers.3.self_attn.q_proj.lora_A``, and per expert
    ``model.layers.3.mlp.experts.gate_up_proj[2].lora_B`` (unstacked from peft's layout)."""
    from safetensors.torch import load_file

    config = json.loads((Path(path) / "adapter_config.json").read_text())
    # peft wraps the experts' parameters in the module's order (gate_up_proj inside, then
    # down_proj), whatever order the config lists them in (a set: it varies): the export's.
    listed = {name.rsplit(".", 1)[-1] for name in config.get("target_parameters") or []}
    wrapped = [name for name in _EXPERT_PARAMETERS if name in listed]
    out: dict[str, torch.Tensor] = {}
    for key, tensor in load_file(str(Path(path) / ADAPTER_FILE)).items():
        name = lora_checkpoint_name(key.removeprefix(_PEFT_PREFIX).removesuffix(".weight"))
        if ".experts." not in name:
            out[name] = tensor.float()
            continue
        parent, rest = name.split(".experts.", 1)
        depth, factor = rest.count("base_layer."), rest.rsplit(".", 1)[-1]
        param = wrapped[len(wrapped) - 1 - depth]
        experts = spec.num_experts
        for e in range(experts):
            if factor == "lora_A":  # [E * r, in], expert-major rows
                piece = tensor.unflatten(0, (experts, -1))[e]
            else:  # [out, r * E], column k * E + e is expert e's k-th
                piece = tensor.unflatten(1, (-1, experts))[:, :, e]
            out[f"{parent}.experts.{param}[{e}].{factor}"] = piece.float().contiguous()
    return out


@torch.no_grad()
def load_adapter(chunks: Sequence[torch.nn.Module], path: str, spec: HFModelSpec) -> None:
    """Copy this rank's pieces of the adapter at ``path`` into the LoRA layers of ``chunks``
    (injected with the adapter's own shape: :func:`adapter_finetuning`)."""
    tensors = read_adapter_tensors(path, spec)
    extra = sorted(name for name in tensors if _layer_of(name) is None)
    if extra:  # the config rules refuse these first; a guard for other callers
        raise ModelLoadError(f"{Path(path) / ADAPTER_FILE}: tensors outside the decoder layers' "
                             f"linears: {', '.join(extra)}")
    for chunk in chunks:
        coords = shard_coords(unwrap(chunk))
        for _, layer in lora_layers([chunk]):
            for name, shape, piece, param, _ in layer_pieces(layer, coords, spec.num_experts):
                source = tensors.get(name)
                if source is None or tuple(source.shape) != tuple(shape):
                    got = "missing" if source is None else f"shape {tuple(source.shape)}"
                    raise ModelLoadError(f"{Path(path) / ADAPTER_FILE}: tensor {name} is {got}; "
                                         f"the model's adapter needs shape {tuple(shape)}")
                if piece.dim is None:
                    param.copy_(source)
                else:
                    param.narrow(piece.dim, piece.local_start, piece.length).copy_(
                        source.narrow(piece.dim, piece.hf_start, piece.length))


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return None


@torch.no_grad()
def merge_adapter(chunks: list[torch.nn.Module], finetuning: FinetuningArguments, path: str, *,
                  model_path: str, seed: int) -> None:
    """Add the adapter at ``path`` into the base weights of ``chunks`` (``scaling · B @ A``,
    in the weights' dtype, as peft's merge does) and leave plain Megatron linears behind."""
    spec = read_hf_config(model_path)
    apply_lora(chunks, adapter_finetuning(finetuning, path, spec), model_path=model_path, seed=seed)
    load_adapter(chunks, path, spec)
    for _, layer in lora_layers(chunks):
        weight = layer.base_linear.weight
        weight.add_(layer.delta_weight("default").to(weight.dtype))
    _unwrap_layers(chunks)


def merge_adapters(chunks: list[torch.nn.Module], finetuning: FinetuningArguments, paths: Sequence[str], *,
                   model_path: str, seed: int) -> None:
    """:func:`merge_adapter` for each of ``paths``, in order (LLaMA-Factory's order)."""
    for path in paths:
        merge_adapter(chunks, finetuning, path, model_path=model_path, seed=seed)


def _unwrap_layers(chunks: list[torch.nn.Module]) -> None:
    """Every LoRA layer replaced by its base linear; peft's record of the injection dropped
    (peft's ``unload`` does the same on its own models), so the next injection starts clean."""
    for chunk in chunks:
        for name, module in list(chunk.named_modules()):
            if isinstance(module, MegatronLoraLinear):
                parent, _, child = name.rpartition(".")
                setattr(chunk.get_submodule(parent) if parent else chunk, child,
                        module.get_base_layer())
        for holder in (chunk, unwrap(chunk)):
            if hasattr(holder, "peft_config"):
                del holder.peft_config
