"""The model and layout facts the config rules read: the model's type and shape from its
config.json, the parallel section as a topology ``Layout``, and the planner's Megatron field
names rewritten as this config's dotted names. Pure Python, like the rules."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_mca.topology import Layout, LayoutError, ModelShape
from hpc_mca.topology.lora import LoraModel

from .input import ConfigError

if TYPE_CHECKING:  # the sections import the rules: a runtime import here would be a circle
    from .sections import ParallelArguments

__all__ = ["layout_of", "model_shape", "model_type", "our_names"]


def model_type(model_dir: str) -> str:
    try:
        return str(json.loads((Path(model_dir) / "config.json").read_text()).get("model_type"))
    except (OSError, ValueError, AttributeError):
        return "?"  # read_hf_config reports the broken config.json in its own words


def layout_of(par: ParallelArguments) -> Layout:
    try:
        return Layout(
            tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
            cp=par.context_parallel_size, ep=par.expert_model_parallel_size,
            etp=par.expert_tensor_parallel_size, vp=par.virtual_pipeline_model_parallel_size,
            dp=par.data_parallel_size,
            pipeline_layout=tuple(par.pipeline_layout) if par.pipeline_layout is not None else None)
    except LayoutError as err:
        raise ConfigError("\n".join(our_names(line) for line in err.violations)) from None


def lora_model(shape: ModelShape) -> LoraModel:
    """What decides the model's LoRA targets (the builder's HFModelSpec.lora_model says the
    same from the same config: tests/test_models_config.py)."""
    latent = (shape.q_lora_rank is not None) if shape.is_mla else None
    return LoraModel(is_moe=shape.is_moe, mla_query_latent=latent)


def model_shape(model_dir: str) -> ModelShape:
    try:
        return ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    except (LayoutError, ValueError) as err:
        raise ConfigError(f"model.model_name_or_path={model_dir!r}: config.json: "
                          f"{str(err).splitlines()[0]}") from None


_TOPOLOGY_NAMES = {
    "tensor_parallel_size": "parallel.tensor_model_parallel_size",
    "pipeline_parallel_size": "parallel.pipeline_model_parallel_size",
    "virtual_pipeline_parallel_size": "parallel.virtual_pipeline_model_parallel_size",
    "pipeline_layout": "parallel.pipeline_layout",
    "context_parallel_size": "parallel.context_parallel_size",
    "expert_parallel_size": "parallel.expert_model_parallel_size",
    "expert_tensor_parallel_size": "parallel.expert_tensor_parallel_size",
    "data_parallel_size": "parallel.data_parallel_size",
    "global_batch_size": "training.global_batch_size",
    "micro_batch_size": "training.per_device_train_batch_size",
    "seq_length": "data.seq_length",
    "mtp_num_layers": "model.mtp_num_layers",
}
_TOPOLOGY_RE = re.compile(r"\b(" + "|".join(_TOPOLOGY_NAMES) + r")\b")


def our_names(line: str) -> str:
    """The planner's Megatron field names, rewritten as this config's dotted names."""
    return _TOPOLOGY_RE.sub(lambda m: _TOPOLOGY_NAMES[m.group(1)], line)
