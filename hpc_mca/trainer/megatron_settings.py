"""Megatron-Core's own checks of a run's settings, run on every rank before the process group.

Megatron validates its config objects when they are constructed (``TransformerConfig``,
``OptimizerConfig``, ``DistributedDataParallelConfig``: ``__post_init__`` raising ValueError or
asserting). Built where the trainer builds them, after tokenizing, such a refusal is a
traceback and exit 1, which the batch script takes for a crash and requeues. So every rank
builds the same three objects from the run config first (:func:`check_megatron_settings`),
and a refusal becomes a :class:`ConfigError`: one line in this config's names, exit 2.

The objects are built by the functions the trainer itself uses, so what is checked here is
what the ranks would build.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path
from typing import Any

import torch

from hpc_mca.config.sections import (
    ConfigError,
    ModelArguments,
    ParallelArguments,
    TrainConfig,
    TrainingArguments,
    flat_fields,
)
from hpc_mca.topology import Layout

__all__ = ["check_megatron_settings", "default_fusions", "megatron_refusal", "model_overrides",
           "torch_dtype"]

_MEGATRON_NAMES = {"clip_grad": "training.max_grad_norm", "adam_eps": "training.adam_epsilon",
                   "lr": "training.learning_rate"}
"""Megatron's names for settings this config names otherwise (the rest share their names)."""


def torch_dtype(training: TrainingArguments) -> torch.dtype:
    """The parameters' dtype: bf16, fp16 or fp32 (the optimizer keeps fp32 master weights)."""
    if training.bf16:
        return torch.bfloat16
    return torch.float16 if training.fp16 else torch.float32


FAST_GPU_FUSIONS = ("layer", "cross_entropy")
"""model.fusions of a bf16 run on CUDA when unset: the fastest setting measured on one H200
(Llama-3.2-1B shape, seq 4096, micro-batch 2): 53,350 tokens/s against 47,784 unfused and
52,879 with [swiglu, cross_entropy, rope] (docs/gpu.md); 55,317 once the
cross-entropy was hpc_mca.models.cross_entropy's."""


def default_fusions(config: TrainConfig, *, cuda: bool, backend: str, moe: bool) -> list[str]:
    """The fusions of a run whose ``model.fusions`` is unset: :data:`FAST_GPU_FUSIONS` for a
    bf16 Megatron-backend run of a dense model on CUDA whose layers are not Transformer
    Engine's (``backend``, the attention backend it gets), else none. Left out, unmeasured:
    TE's fused layers compiled, and MoE layers (``moe``), whose token counts per expert change
    every micro-batch; on CPU compiling cost ~11 s of start-up and gained nothing measurable.
    Without ``layer`` where the norms' recompute is asked for."""
    if config.model.fusions is not None:
        return list(config.model.fusions)
    fast = config.training.use_mca and config.training.bf16 and cuda and backend != "te" and not moe
    # layernorm recompute's checkpoint does not run inside compiled layers (rules.py refuses both).
    compiled = "layernorm" not in (config.parallel.recompute_modules or ())
    return [f for f in FAST_GPU_FUSIONS if compiled or f != "layer"] if fast else []


def model_overrides(model: ModelArguments, par: ParallelArguments,
                    training: TrainingArguments) -> dict[str, Any]:
    """The TransformerConfig fields the run config sets (the rest come from the HF model)."""
    out: dict[str, Any] = {
        "calculate_per_token_loss": par.calculate_per_token_loss,
        "sequence_parallel": par.sequence_parallel,
        "bf16": training.bf16,
        "fp16": training.fp16,
    }
    fusions = model.fusions or ()  # None before a rank chose (api.session.choose_fusions)
    if "swiglu" in fusions:
        out["bias_activation_fusion"] = True
    if "cross_entropy" in fusions:
        out.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")
    if "rope" in fusions:
        out["apply_rope_fusion"] = True  # the rotation compiled (hpc_mca.models.rope)
    if par.context_parallel_size > 1:
        out["cp_comm_type"] = par.cp_comm_type
    if model.mtp_num_layers:
        out.update(mtp_num_layers=model.mtp_num_layers,
                   mtp_loss_scaling_factor=model.mtp_loss_scaling_factor)
    if par.recompute_granularity:
        out.update(recompute_granularity=par.recompute_granularity,
                   recompute_method=par.recompute_method,
                   recompute_num_layers=par.recompute_num_layers)
        if par.recompute_modules is not None:
            out["recompute_modules"] = list(par.recompute_modules)
    return out


def check_megatron_settings(config: TrainConfig, layout: Layout) -> None:
    """Build this run's TransformerConfig, OptimizerConfig and DDP config as the ranks will;
    ConfigError (one line) when Megatron-Core refuses one."""
    from hpc_mca.loop.optimizer import optimizer_config
    from hpc_mca.models import rope
    from hpc_mca.models.hf_config import read_hf_config
    from hpc_mca.models.megatron_config import transformer_config

    from .trainer import ddp_config

    if config.parallel.optimizer_cpu_offload and not torch.cuda.is_available():
        # Megatron's offloading optimizer moves state off the GPU; on a machine without one
        # it fails at its first step ("can't optimize a non-leaf Tensor").
        raise ConfigError("parallel.optimizer_cpu_offload=true on a machine without CUDA, "
                          "where the optimizer state is on the CPU already; valid: false")
    model_dir = Path(config.model.model_name_or_path)
    overrides = model_overrides(config.model, config.parallel, config.training)
    spec = read_hf_config(model_dir)
    try:
        transformer_config(spec, layout, dtype=torch_dtype(config.training),
                           gloo=not torch.cuda.is_available(), loading=any(model_dir.glob("*.safetensors")),
                           overrides=rope.configure(overrides, spec))
        optimizer_config(config.training, config.parallel, min_lr=0.0)
        ddp_config(config.parallel)
    except (ValueError, AssertionError) as err:
        raise ConfigError(megatron_refusal(err)) from None


def megatron_refusal(err: BaseException) -> str:
    """Megatron's message as one line, the names of its config fields rewritten as this
    config's dotted names (``recompute_method`` -> ``parallel.recompute_method``)."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    text = " ".join(str(err).split())
    if not text:  # a bare assert: say where it is
        frame = traceback.extract_tb(err.__traceback__)[-1]
        text = f"{type(err).__name__} at {Path(frame.filename).name}:{frame.lineno}"
    fields = {f.name for cls in (TransformerConfig, OptimizerConfig, DistributedDataParallelConfig)
              for f in dataclasses.fields(cls)}
    flat = flat_fields()
    names = {name: flat[name] for name in fields & set(flat)} | _MEGATRON_NAMES
    pattern = re.compile(r"(?<![\w.])(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b")
    return ("Megatron-Core refuses these settings: "
            + pattern.sub(lambda m: names[m.group(1)], text))
