"""PEFT adapter directories given as input: the checks before any rank allocates a model.

``model.adapter_name_or_path`` (the adapters the policy starts from) and dpo's
``finetuning.ref_model_adapters`` name PEFT LoRA adapter directories. What the Megatron
backend can place on its layers (``models.adapter_import``) is LoRA on the decoder layers'
linears with one rank and alpha; everything else peft can save (DoRA, rsLoRA, per-module
ranks, ``modules_to_save``, adapters on embeddings or the head, regex targets) is refused
here in one line naming the adapter and the key, as is a directory without
``adapter_config.json``.

The adapter that trains on (the last one, unless ``finetuning.create_new_adapter``) keeps its
own shape, as LLaMA-Factory keeps it (peft's ``PeftModel.from_pretrained`` reads the
adapter's config): its rank, alpha, dropout and targets become ``finetuning.lora_*``, so the
planner, the checkpoints and the export see the adapter that trains. A ``lora_*`` field the
user set (not its default) to another value than the adapter's is refused rather than
silently replaced.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_mca.topology.lora import LoraModel, LoraTargetError, resolve_lora_targets

from .input import ConfigError

if TYPE_CHECKING:  # the sections import the rules: a runtime import here would be a circle
    from .sections import TrainConfig

__all__ = ["adapter_shape", "check_adapters"]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

_TENSOR = re.compile(r"base_model\.model\.model\.layers\.\d+\.\w+\."
                     r"(?:\w+_proj|experts(?:\.base_layer)*)\.lora_[AB]\.weight")
"""peft's names for LoRA factors on a decoder layer's linear (or an MoE layer's experts)."""

_UNSUPPORTED: dict[str, object] = {"use_dora": False, "use_rslora": False, "modules_to_save": None,
                "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
                "bias": "none", "fan_in_fan_out": False, "exclude_modules": None,
                "trainable_token_indices": None, "lora_bias": False, "layer_replication": None,
                "alora_invocation_tokens": None, "use_qalora": False, "use_bdlora": None}
"""adapter_config.json keys whose non-default values change what the adapter computes in a
way the Megatron LoRA layers do not (value: peft's default, which is fine)."""


def check_adapters(config: TrainConfig, model: LoraModel) -> None:
    """The adapter directories' checks (one line each) and, for the adapter that trains on,
    its shape as ``finetuning.lora_*`` (see the module docstring)."""
    ft, paths = config.finetuning, config.model.adapter_name_or_path
    if paths and ft.finetuning_type != "lora":
        raise ConfigError(f"model.adapter_name_or_path={paths!r} with finetuning.finetuning_type="
                          f"{ft.finetuning_type!r}: adapters load only under LoRA "
                          "(LLaMA-Factory's rule); valid: finetuning_type='lora', or no "
                          "adapter_name_or_path")
    if ft.ref_model_adapters and ft.ref_model is None:
        raise ConfigError(f"finetuning.ref_model_adapters={ft.ref_model_adapters!r} without "
                          "finetuning.ref_model: they are merged onto the reference model "
                          "ref_model names (LLaMA-Factory reads them only with it); valid: set "
                          "finetuning.ref_model (model_name_or_path for the starting model), or "
                          "remove them")
    shapes = {}
    for dotted, given in (("model.adapter_name_or_path", paths),
                          ("finetuning.ref_model_adapters", ft.ref_model_adapters)):
        for path in given or []:
            shapes[path] = adapter_shape(dotted, path, model)
    if paths and not ft.create_new_adapter:
        _adopt(config, paths[-1], shapes[paths[-1]])


def adapter_shape(dotted: str, path: str, model: LoraModel) -> dict[str, Any]:
    """The LoRA shape of the adapter at ``path`` (lora_rank, lora_alpha, lora_dropout,
    lora_target), after checking that our LoRA layers can hold it; ``dotted`` names the
    setting that gave the path."""
    directory = Path(path)
    missing = [name for name in ADAPTER_FILES if not (directory / name).is_file()]
    if missing:
        raise ConfigError(f"{dotted} entry {path!r} is not a PEFT adapter directory (no "
                          f"{' or '.join(missing)} there); valid: a directory peft's "
                          "save_pretrained wrote, or an hpc-mca LoRA export")
    config = json.loads((directory / ADAPTER_FILES[0]).read_text())
    where = f"{dotted} entry {path!r}"
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{where} is a {config.get('peft_type')} adapter; valid: LORA adapters")
    for key, fine in _UNSUPPORTED.items():
        if config.get(key, fine) not in (fine, None, {}, [], False):
            raise ConfigError(f"{where} has {key}={config[key]!r}, which the Megatron LoRA "
                              f"layers do not compute; valid: {key}={fine!r} (plain LoRA)")
    modules = config.get("target_modules") or []
    if isinstance(modules, str):
        raise ConfigError(f"{where} has target_modules={modules!r} (a regular expression); "
                          "valid: a list of module names (q_proj, ..., down_proj)")
    names = sorted({*modules, *(p.rsplit(".", 1)[-1] for p in config.get("target_parameters") or [])})
    try:
        resolve_lora_targets(names, model)
    except LoraTargetError as err:
        raise ConfigError(f"{where}: {err}".replace("finetuning.lora_target=", "target_modules=")) from None
    outside = [name for name in _tensor_names(directory / ADAPTER_FILES[1]) if not _TENSOR.fullmatch(name)]
    if outside:
        raise ConfigError(f"{where} holds tensors outside the decoder layers' linears, which no "
                          f"Megatron LoRA layer holds: {', '.join(outside[:4])}"
                          f"{' ...' if len(outside) > 4 else ''}; valid: LoRA on q/k/v/o and "
                          "the MLP projections only")
    return {"lora_rank": int(config["r"]), "lora_alpha": float(config["lora_alpha"]),
            "lora_dropout": float(config.get("lora_dropout") or 0.0), "lora_target": names}


def _tensor_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header (8-byte length, then JSON)."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return sorted(name for name in header if name != "__metadata__")


_DEFAULTS = {"lora_rank": 8, "lora_alpha": None, "lora_dropout": 0.0, "lora_target": ["all"]}
"""FinetuningArguments' defaults of the fields an adapter that trains on decides."""


def _adopt(config: TrainConfig, path: str, shape: dict[str, Any]) -> None:
    """The adapter that trains on keeps its shape; a conflicting user value is refused."""
    ft = config.finetuning
    for name, theirs in shape.items():
        mine = getattr(ft, name)
        if name == "lora_target":
            mine = sorted({n.strip() for m in ([mine] if isinstance(mine, str) else mine)
                           for n in str(m).split(",") if n.strip()})
        if mine != _DEFAULTS[name] and mine != theirs:
            raise ConfigError(f"finetuning.{name}={mine!r} differs from the adapter that trains "
                              f"on ({path!r}: {theirs!r}), which keeps its own shape as in "
                              f"LLaMA-Factory; valid: {theirs!r}, or leave finetuning.{name} "
                              "unset (or set finetuning.create_new_adapter=true for a new "
                              "adapter of that shape)")
        setattr(ft, name, theirs)
