"""The last step of an epoch under pipeline parallelism (:class:`hpc_mca.data.sampler.EpochPlan`).

Every epoch ends with a partial global batch: fewer micro-batches, and the last one may hold
fewer rows than ``per_device_train_batch_size``. Megatron's schedules take any number of
micro-batches (at least one), but the pipeline stages exchange activations of one shape per
schedule call, and the interleaved schedule needs a multiple of the pipeline size. So, under
pipeline parallelism, a short unpacked micro-batch is filled up with masked copies of its
first row (no label, no loss, no tokens counted); what cannot be filled that way is refused
before step 1, in one line saying what is valid.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from hpc_mca.data.errors import DataError
from hpc_mca.stages import get_stage

if TYPE_CHECKING:
    from hpc_mca.data.batch import PackedBatch
    from hpc_mca.data.sampler import EpochPlan

__all__ = ["check_partial_steps", "filled_rows"]


def check_partial_steps(plan: EpochPlan, *, pp: int, vp: int | None, packed: bool, stage: str) -> None:
    """Refuse (DataError) an epoch whose last step the pipeline schedules cannot run."""
    if pp == 1:
        return
    last = (plan.steps_per_epoch - 1) * plan.global_batch_size
    micro = plan.micro_steps_in_step(last)
    short = plan.step_samples(last) // plan.data_parallel_size % plan.micro_batch_size
    what = (f"the training data's {plan.num_rows} rows end every epoch with a step of {micro} "
            f"micro-batch(es) per rank, the last of {short or plan.micro_batch_size} row(s)")
    if vp and micro % pp:
        raise DataError(f"{what}: the interleaved schedule (virtual_pipeline_model_parallel_size={vp}) "
                        f"needs a multiple of pipeline_model_parallel_size={pp}; valid: "
                        f"{_valid_rows(plan, pp)} rows, or no virtual pipeline")
    if short and micro > 1 and (packed or get_stage(stage).rows_per_example > 1):
        kind = "packed rows" if packed else f"{stage}'s examples"
        raise DataError(f"{what}, fewer than per_device_train_batch_size={plan.micro_batch_size}, "
                        f"which pipeline parallelism cannot fill up with {kind}; valid: a multiple "
                        f"of {plan.micro_step_size} rows (micro-batch × data-parallel size)")


def _valid_rows(plan: EpochPlan, pp: int) -> str:
    """Row counts near ``plan.num_rows`` whose epoch ends with a multiple of ``pp`` micro-batches."""
    def fits(rows: int) -> bool:
        other = dataclasses.replace(plan, num_rows=rows)
        return other.micro_steps_in_step((other.steps_per_epoch - 1) * other.global_batch_size) % pp == 0

    below = next((n for n in range(plan.num_rows - 1, 0, -1) if fits(n)), None)
    above = next((n for n in range(plan.num_rows + 1, plan.num_rows + plan.global_batch_size + 1) if fits(n)),
                 None)
    return " or ".join(str(n) for n in (below, above) if n) or f"a multiple of {plan.global_batch_size}"


def filled_rows(batch: PackedBatch, rows: int) -> PackedBatch:
    """An unpacked ``batch`` with masked copies of its first row appended up to ``rows`` rows:
    the same tokens and positions, no label, no document, no loss."""
    extra = rows - batch.rows
    if extra <= 0:
        return batch

    def more(tensor: torch.Tensor, value: int | None = None) -> torch.Tensor:
        copies = tensor[:1].expand(extra, *tensor.shape[1:])
        return torch.cat([tensor, copies if value is None else torch.full_like(copies, value)])

    return dataclasses.replace(batch, input_ids=more(batch.input_ids), labels=more(batch.labels, -100),
                               loss_mask=more(batch.loss_mask, 0), position_ids=more(batch.position_ids),
                               documents=more(batch.documents, 0))
