"""The standard backend's side of ``hpc-mca export`` (one process): the run's transformers
model, built as the run built it (:func:`hpc_mca.standard.model.build_hf_model`: float32, the
finetuning type applied), with the checkpoint's weights put in, exported by the run's own
export (:func:`hpc_mca.standard.model.export_model`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hpc_mca.config.sections import TrainConfig

from .export_checks import ExportRefused

__all__ = ["export_standard"]


def export_standard(config: TrainConfig, path: Path, out: Path, *, merged: bool) -> str:
    """Export checkpoint ``path`` of a standard-backend run to ``out``; what was written."""
    import time

    from hpc_mca.models.converters import converter_for
    from hpc_mca.standard.model import build_hf_model, export_model

    started = time.perf_counter()
    model = build_hf_model(config, torch.device("cpu"))
    print(f"  built the model ({config.finetuning.finetuning_type}, transformers) in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    started = time.perf_counter()
    if converter_for(config.finetuning).trains_adapters:
        _load_adapter(model, path)
    else:
        _load_weights(model, path)
    print(f"  loaded the model weights of {path.name} in {time.perf_counter() - started:.1f} s", flush=True)
    _as_trained(model)
    export_model(model, out, config.finetuning, Path(config.model.model_name_or_path), merged=merged)
    if not merged and converter_for(config.finetuning).trains_adapters:
        return "PEFT adapter"
    return "HF model (LoRA merged)" if merged else "HF model"


def _as_trained(model: torch.nn.Module) -> None:
    """What transformers' Trainer changed on the model the run exported: its config's
    ``use_cache``, set to the Trainer arguments' (the standard backend leaves transformers'
    default), which config.json records."""
    import dataclasses

    from transformers import TrainingArguments

    default = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}["use_cache"]
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = default


def _load_weights(model: torch.nn.Module, path: Path) -> None:
    """transformers' weight files of the checkpoint (one file or an index and its shards)."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    names = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    state: dict[str, torch.Tensor] = {}
    for name in names:
        state.update(load_file(str(path / name)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # save_pretrained leaves out a tied weight: it is the embedding it is tied to.
    tied = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ())
    wrong = [f"missing {key}" for key in missing if key not in tied] + [f"unexpected {key}" for key in unexpected]
    if wrong:
        raise ExportRefused(f"{path}: the checkpoint's weights do not fit the run's model: "
                            f"{', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}")


def _load_adapter(model: torch.nn.Module, path: Path) -> None:
    """The checkpoint's PEFT adapter into the run's peft model (its adapter weights only)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    loaded = load_file(str(path / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, loaded)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [key for key in getattr(result, "missing_keys", []) or [] if "lora_" in key]
    if unexpected or missing:
        wrong = [f"missing {key}" for key in missing] + [f"unexpected {key}" for key in unexpected]
        raise ExportRefused(f"{path}: the checkpoint's adapter does not fit the run's model: "
                            f"{', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}")
