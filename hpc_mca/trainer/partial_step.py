"""The last step of an epoch under the interleaved pipeline schedule
(:class:`hpc_mca.data.sampler.EpochPlan`).

Every epoch ends with a partial global batch: fewer micro-batches per rank (each of them full:
the sampler pads an epoch to whole micro-steps, so the pipeline stages always exchange
activations of one shape). Megatron's schedules take any number of micro-batches, except the
interleaved one (virtual pipeline chunks), which needs a multiple of the pipeline size: there
the step is made up to that multiple with masked copies of its first micro-batch (the same
tokens, no label, no loss, no tokens counted), which leave the step's loss and gradients as
they are.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hpc_mca.data.batch import PackedBatch

__all__ = ["masked_copy", "whole_pipeline_rounds"]


def masked_copy(batch: PackedBatch) -> PackedBatch:
    """``batch`` with every label masked: it runs through the model and trains nothing."""
    return dataclasses.replace(batch, labels=torch.full_like(batch.labels, -100),
                               loss_mask=torch.zeros_like(batch.loss_mask))


def whole_pipeline_rounds(micro_batches: list[PackedBatch], pp: int) -> list[PackedBatch]:
    """``micro_batches`` made up to a multiple of ``pp`` with masked copies of the first (the
    interleaved schedule's need); as they are when they already are one."""
    short = -len(micro_batches) % pp
    return micro_batches + [masked_copy(micro_batches[0]) for _ in range(short)]
