"""What a run log shows of the libraries under us: the warnings that matter, not the ones
every rank prints at every start.

:func:`quiet_library_noise` runs first in the rank commands (``train``, ``smoke``), before
megatron is imported. Each filter below names one message, where it comes from and why it
says nothing a user should act on; any other warning still prints. What the silenced notices
told (no Transformer Engine or Apex) is said once, by rank 0, in :func:`library_line`.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings

IGNORED_WARNINGS: tuple[tuple[str, str], ...] = (
    (r"Transformer Engine and Apex are not installed",
     "megatron.core.optimizer/clip_grads and megatron_fsdp, at import: without TE/Apex they "
     "use torch's optimizers and multi-tensor helpers; said once in library_line()"),
    (r"Apex is not installed\. Falling back to Torch Norm",
     "megatron.core.models.backends and gpt_layer_specs, per model chunk: the local spec's "
     "norm is torch's; said once in library_line()"),
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
     "torch.distributed, once per rank at Megatron-Core's first sequence-parallel gather or "
     "reduce-scatter (and the distributed optimizer's): torch 2.13 renamed the collectives "
     "Megatron-Core 0.19 calls; they work as they are"),
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
     "megatron.core.optimizer.optimizer._zero_grad_group_helper, every step with the "
     "distributed optimizer: it asks each shard of the main params (views, not leaves) for a "
     ".grad it never has; nothing reads a missing gradient"),
    (r"MimoModelConfig is experimental",
     "megatron.core.models.mimo, at import (reached through megatron.core.models): a model "
     "family hpc-mca does not build"),
)
"""(message regex, why it is silenced) for ``warnings.warn`` notices."""

IGNORED_LOG_RECORDS: tuple[tuple[str, str, str], ...] = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED",
     "per model chunk: GPTModel is Megatron-Core 0.19's model for the families hpc-mca builds "
     "(Llama, Qwen, Mistral, Mixtral); the notice is about Megatron's own roadmap"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated",
     "at a process's first save: Megatron's in-tree async writer is the one usable without "
     "nvidia-resiliency-ext (not a dependency)"),
    ("megatron.core.distributed.distributed_data_parallel",
     "DistributedDataParallel: full_param_layout not provided",
     "per model chunk with the distributed optimizer: DDP computes the bucket layout the "
     "optimizer's own helper would (the notice asks callers to precompute the same one)"),
    ("transformers.training_args", "torch.distributed process group is initialized, but",
     "the standard backend on one rank: hpc-mca brings the process group up whatever the rank "
     "count (collectives of one rank); transformers' Trainer uses DDP from two ranks on"),
)
"""(logger, message prefix, why it is silenced) for ``logging`` records."""


class _DropRecords(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_library_noise() -> None:
    """Install the filters above (idempotent; the warning filters apply process-wide)."""
    for pattern, _ in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name, prefix, _ in IGNORED_LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropRecords) for f in logger.filters):
            logger.addFilter(_DropRecords((prefix,)))


def library_line() -> str:
    """One line naming the optional fast paths present on this rank, e.g.
    ``kernels: Transformer Engine no, Apex no, flash-attn no (torch optimizers and norms)``."""
    found = {name: importlib.util.find_spec(module) is not None
             for name, module in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"),
                                  ("flash-attn", "flash_attn"))}
    listed = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in found.items())
    fallback = "" if found["Transformer Engine"] or found["Apex"] else \
        " (torch optimizers and norms)"
    return f"kernels: {listed}{fallback}"
