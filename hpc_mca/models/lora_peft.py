"""A script's own LoRA through peft, as ROLL's scripts apply it to a chunk:

    apply_megatron_lora()
    model.models[0] = get_peft_model(model[0], LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=find_all_linear_modules(model[0])))

peft cannot adapt Megatron's parallel linears by itself. :func:`register_megatron_lora` (what
``hpc_mca.adapters.apply_megatron_lora`` calls) adds one dispatcher in front of peft's LoRA
dispatchers (the only patch of peft: ``LoraModel._create_new_module``, wrapped once): a Megatron
linear that ``AutoModel`` marked with its LoRA site (:func:`mark_lora_sites`) becomes a
:class:`~hpc_mca.models.lora.MegatronLoraLinear`, the layer ``finetuning_type: lora`` builds,
with the same starting values (the run's seed and the HF module's name draw A). Other modules
peft is asked to adapt keep peft's own dispatch, and a Megatron linear without a site (the
output layer) is refused in one line.

The trainer then reads the peft config back (:func:`finetuning_from_peft`) into the run
config's ``finetuning`` section, so that a script's LoRA trains, checkpoints, exports and
serves as dpo's reference exactly as ``hpc-mca train`` with ``finetuning_type: lora`` and the
same rank, alpha, dropout and targets does; a LoraConfig setting that section cannot express
(DoRA, rsLoRA, a rank pattern ...) is refused in one line.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from hpc_mca.config.input import ConfigError
from hpc_mca.config.sections import FinetuningArguments

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = ["adaptable_linears", "finetuning_from_peft", "mark_lora_sites", "register_megatron_lora",
           "trained_chunks"]

_SITE = "_hpc_mca_lora_site"
"""The attribute :func:`mark_lora_sites` sets on each adaptable Megatron linear: (site, seed)."""

_REGISTERED = False


def mark_lora_sites(chunks: list[torch.nn.Module], model_path: str, *, seed: int) -> None:
    """Mark every linear of the chunks' decoder layers that LoRA may adapt with its site (which
    HF modules it holds, where) and the run's seed."""
    from hpc_mca.models.hf_config import read_hf_config
    from hpc_mca.models.lora import lora_sites
    from hpc_mca.topology.lora import resolve_lora_targets

    spec = read_hf_config(model_path)
    every = resolve_lora_targets(["all"], spec.lora_model(), model_type=spec.model_type)
    for chunk in chunks:
        modules = dict(chunk.named_modules())
        for name, site in lora_sites(chunk, every, spec).items():
            setattr(modules[name], _SITE, (site, seed))


def register_megatron_lora() -> None:
    """Put the Megatron dispatcher in front of peft's LoRA dispatchers (module docstring);
    once per process."""
    global _REGISTERED
    if _REGISTERED:
        return
    from peft.tuners.lora.model import LoraModel

    peft_create = LoraModel._create_new_module

    def create_new_module(lora_config: LoraConfig, adapter_name: str, target: torch.nn.Module,
                          **kwargs: Any) -> torch.nn.Module:  # Any: peft's open keywords (r, device_map, ...)
        module = _megatron_module(lora_config, adapter_name, target, **kwargs)
        return module if module is not None else peft_create(lora_config, adapter_name, target, **kwargs)

    LoraModel._create_new_module = staticmethod(create_new_module)  # type: ignore[method-assign]
    _REGISTERED = True


def _megatron_module(lora_config: LoraConfig, adapter_name: str, target: torch.nn.Module,
                     **kwargs: Any) -> torch.nn.Module | None:  # Any: peft's keywords, typed by MegatronLoraLinear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    from hpc_mca.models.lora import MegatronLoraLinear

    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
        return None
    marked = getattr(base, _SITE, None)
    name = kwargs.get("target_name", "?")
    if marked is None:
        raise ConfigError(f"LoRA target_modules reach {name!r}, a Megatron linear outside the "
                          "decoder layers' attention and MLP; valid: the names "
                          "hpc_mca.adapters.find_all_linear_modules(model) gives")
    site, seed = marked
    return MegatronLoraLinear(target, adapter_name, config=lora_config, sites={name: site}, seed=seed,
                              **kwargs)


def trained_chunks(models: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The chunks themselves: a chunk peft wrapped (``get_peft_model``) is its base model,
    with the adapters peft injected into it."""
    from peft import PeftModel

    return [chunk.get_base_model() if isinstance(chunk, PeftModel) else chunk for chunk in models]


_LORA_DEFAULTS = {"bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
                  "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
                  "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
                  "target_parameters": None, "lora_bias": False, "use_qalora": False,
                  "trainable_token_indices": None, "exclude_modules": None, "alora_invocation_tokens": None}
"""LoraConfig fields the run config cannot express: only their defaults are taken."""


def finetuning_from_peft(models: list[torch.nn.Module], finetuning: FinetuningArguments
                         ) -> FinetuningArguments | None:
    """The run config's finetuning section for chunks a script wrapped with peft's
    ``get_peft_model`` (None when none is): lora with the LoraConfig's rank, alpha and
    dropout, and as targets the HF modules whose adapters it injected. ConfigError (one line)
    for what the section cannot express, or for chunks wrapped unlike one another."""
    from peft import PeftModel

    from hpc_mca.models.lora import lora_layers

    wrapped = [chunk for chunk in models if isinstance(chunk, PeftModel)]
    if not wrapped:
        return None
    if len(wrapped) != len(models):
        raise ConfigError(f"{len(wrapped)} of the model's {len(models)} chunks are peft models; "
                          "valid: get_peft_model on every chunk of model.models, or on none")
    configs = {name: config for chunk in wrapped for name, config in chunk.peft_config.items()}
    if list(configs) != ["default"]:
        raise ConfigError(f"peft adapters {sorted(configs)}: valid: one adapter, 'default'")
    lora: Any = configs["default"]
    if type(lora).__name__ != "LoraConfig":
        raise ConfigError(f"a {type(lora).__name__} on the model; valid: peft's LoraConfig")
    for key, default in _LORA_DEFAULTS.items():
        value = getattr(lora, key, default)
        if value != default and not (default is True and value == "default"):
            raise ConfigError(f"LoraConfig({key}={value!r}): the LoRA here is peft's plain LoRA on "
                              f"the attention and MLP linears; valid: {key}={default!r}")
    parts = sorted({part for _, layer in lora_layers(trained_chunks(models)) for part in layer.site.parts})
    if not parts:
        raise ConfigError("get_peft_model put no adapter on the model; valid: target_modules from "
                          "hpc_mca.adapters.find_all_linear_modules(model)")
    return dataclasses.replace(finetuning, finetuning_type="lora", lora_rank=int(lora.r),
                               lora_alpha=float(lora.lora_alpha), lora_dropout=float(lora.lora_dropout),
                               lora_target=parts)


def adaptable_linears(model: torch.nn.Module) -> list[str]:
    """Names of the linears in ``model`` (a chunk, or a peft model of one) that
    :func:`mark_lora_sites` marked."""
    found = []
    for name, module in model.named_modules():
        if name.endswith(".base_layer"):
            continue  # held by a LoRA layer, which is listed under its own name
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        if hasattr(base, _SITE):
            found.append(name)
    return found
