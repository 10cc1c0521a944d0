"""How many optimizer steps a run takes: ``training.max_steps``, else its epochs counted as
transformers' Trainer counts them: ``ceil(rows / global_batch_size)`` steps per epoch, the last
a partial global batch (:class:`hpc_mca.data.sampler.EpochPlan` lays them out). The trainer,
the standard backend and the resume check (which compares a checkpoint's run with the one
resuming it) all count the same way, from here."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .input import ConfigError

if TYPE_CHECKING:  # the sections import the rules: a runtime import here would be a circle
    from .sections import TrainingArguments


def total_training_steps(training: TrainingArguments, num_rows: int) -> int:
    """Optimizer steps of the run: ``max_steps``, else ``ceil(num_train_epochs × steps per
    epoch)`` (:func:`steps_per_epoch`).

    Needs a resolved config (``global_batch_size`` set). Data smaller than one global batch is
    one partial step per epoch, as in transformers (rows are repeated when there are fewer than
    the data-parallel ranks); only data without rows raises ConfigError.
    """
    if training.max_steps > 0:
        return training.max_steps
    return steps_for(training, steps_per_epoch(num_rows, training.global_batch_size or 1))


def steps_per_epoch(num_rows: int, global_batch_size: int) -> int:
    """Optimizer steps of one epoch over ``num_rows`` rows: ``ceil(num_rows /
    global_batch_size)``, the last step a partial global batch. transformers' count, ``ceil(
    ceil(ceil(rows / world) / micro-batch) / accumulation)``, is the same number."""
    if num_rows < 1:
        raise ConfigError("the training data has no rows; valid: at least one row")
    return math.ceil(num_rows / global_batch_size)


def steps_for(training: TrainingArguments, steps_per_epoch: int) -> int:
    """Optimizer steps of the run when an epoch is ``steps_per_epoch`` steps long."""
    if training.max_steps > 0:
        return training.max_steps
    return max(1, math.ceil(training.num_train_epochs * steps_per_epoch))
