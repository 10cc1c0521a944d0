"""The Megatron-Core side of ``hpc-mca export``: the export's layout, the checkpoint's model
weights into the rebuilt chunks, and the export itself (every rank).

The checkpoint's model tensors carry their model-wide keys and shapes (``decoder.layers.3...``,
experts by their global number), so dist_checkpointing reads them into chunks of any layout:
the export's ranks need not be the run's. Only the model is read, never the optimizer.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from hpc_mca.checkpoint.store import CheckpointInfo
from hpc_mca.config.sections import TrainConfig
from hpc_mca.errors import UserError

from .export_checks import ExportRefused

__all__ = ["export_config", "load_weights", "write_export"]

LAYOUT_KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
               "vp": "virtual_pipeline_model_parallel_size", "ep": "expert_model_parallel_size"}
"""The export's parallel sizes a command line may give, and the config fields they set."""


def export_config(config: TrainConfig, info: CheckpointInfo, given: dict[str, int]) -> TrainConfig:
    """The run's config (as loaded, unresolved) for the export's ranks, resolved: the sizes
    ``given`` (those not given: 1); with none given, one process builds TP1 PP1 EP1 and several
    take the checkpoint's own TP, PP, VP, EP and pipeline layout (CP and DP replicate weights,
    so the rest of the world is DP). Nothing that only training reads can refuse it: batch
    sizes, optimizer and recomputation are reset."""
    from hpc_mca.api.session import choose_fusions
    from hpc_mca.runtime.env import from_environ

    world = from_environ().world_size
    saved = info.layout if world > 1 and not given else {}
    sizes = {key: given.get(key, saved.get(key)) for key in LAYOUT_KEYS}
    par = config.parallel
    for key, name in LAYOUT_KEYS.items():
        setattr(par, name, sizes[key] if key == "vp" else int(sizes[key] or 1))
    par.pipeline_layout = saved.get("pipeline_layout")
    par.context_parallel_size, par.expert_tensor_parallel_size, par.data_parallel_size = 1, None, None
    # Megatron runs a mixture of experts under TP only with sequence parallelism.
    par.sequence_parallel = par.tensor_model_parallel_size > 1 and (par.sequence_parallel or _is_moe(config))
    par.use_distributed_optimizer = par.overlap_grad_reduce = par.overlap_param_gather = False
    par.optimizer_cpu_offload = False
    par.recompute_granularity = par.recompute_method = par.recompute_num_layers = None
    par.recompute_modules = None
    tr = config.training
    tr.per_device_train_batch_size, tr.global_batch_size, tr.gradient_accumulation_steps = 1, None, None
    tr.async_save, tr.report_to = False, []
    # The kernels and fusions this machine has (the run's may be a GPU's): weights are the same.
    config.model.attention_backend, config.model.packed_attention, config.model.fusions = "auto", "auto", None
    try:
        resolved = config.resolve(world)
    except UserError as err:
        raise ExportRefused(f"the export's layout on {world} rank(s): {'; '.join(str(err).splitlines())} "
                            f"(set it with --tp/--pp/--vp/--ep)") from None
    return resolved.amended("model", fusions=choose_fusions(resolved))


def _is_moe(config: TrainConfig) -> bool:
    from hpc_mca.topology import ModelShape

    return ModelShape.from_hf_config(config.model.model_name_or_path).is_moe


def load_weights(chunks: list[torch.nn.Module], path: Path) -> list[torch.nn.Module]:
    """Read the model state of checkpoint ``path`` into ``chunks`` (as built: base weights
    loaded, the finetuning type applied); returns the chunks without wrappers."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    from hpc_mca.checkpoint.reader import direct_reads
    from hpc_mca.checkpoint.state import load_model, model_state, sharded_metadata, unwrap

    models = [unwrap(chunk) for chunk in chunks]
    # "plain": the model's entries do not depend on the optimizer format; only they are read.
    template = model_state(models, sharded_metadata("plain"))
    with direct_reads(), warnings.catch_warnings():
        # torch's notes to Megatron's loader (its argument order, ShardedTensor's deprecation)
        # say nothing to whoever exports.
        for message in ("torch.distributed is disabled", "The argument order of load", "Please use DTensor"):
            warnings.filterwarnings("ignore", message=message)
        loaded = dist_checkpointing.load(template, str(path), get_default_load_sharded_strategy(str(path)))
    for i, model in enumerate(models):
        # A chunk with nothing trained (freeze) saved an empty state, which comes back absent.
        load_model(model, loaded.get("model" if len(models) == 1 else f"model{i}", {}))
    return models


def write_export(config: TrainConfig, chunks: list[torch.nn.Module], out: Path, *, merged: bool,
                 max_shard_bytes: int | None) -> str:
    """The end-of-run export of the finetuning type (its converter, as
    :meth:`hpc_mca.checkpoint.checkpointer.Checkpointer.export` calls it); with
    ``max_shard_bytes``, an HF model in shards of that size (the converter's writer, with
    the size the converter leaves at its default)."""
    from hpc_mca.models.converters import converter_for

    converter = converter_for(config.finetuning)
    model_path = config.model.model_name_or_path
    if max_shard_bytes is None:
        what = converter.export_chunks(chunks, out, model_path=model_path, merged=merged)
    else:
        from hpc_mca.models.export import save_hf_checkpoint

        # Full and freeze export exactly this (ModelConverter.export_chunks); LoRA too when
        # merged; an adapter is refused a shard size before this.
        save_hf_checkpoint(chunks, out, model_path, merge_adapters=merged, max_shard_bytes=max_shard_bytes)
        what = "HF model (LoRA merged)" if merged else "HF model"
    if config.model.mtp_num_layers:
        what += f" without its {config.model.mtp_num_layers} MTP layer(s) (the HF family has none)"
    return what
