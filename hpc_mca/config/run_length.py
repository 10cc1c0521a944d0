"""How many optimizer steps a run takes: ``training.max_steps``, else its epochs over whole
global batches. The trainer, the standard backend and the resume check (which compares a
checkpoint's run with the one resuming it) all count the same way, from here."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .input import ConfigError

if TYPE_CHECKING:  # the sections import the rules: a runtime import here would be a circle
    from .sections import TrainingArguments


def total_training_steps(training: TrainingArguments, num_rows: int) -> int:
    """Optimizer steps of the run: ``max_steps``, else epochs × whole global batches per epoch.

    Needs a resolved config (``global_batch_size`` set). Raises ConfigError when the data holds
    less than one global batch.
    """
    if training.max_steps > 0:
        return training.max_steps
    gbs = training.global_batch_size or 1
    per_epoch = num_rows // gbs
    if per_epoch < 1:
        raise ConfigError(f"the training data has {num_rows} rows, fewer than one "
                          f"training.global_batch_size={gbs}; valid: global_batch_size <= "
                          f"{num_rows}")
    return steps_for(training, per_epoch)


def steps_for(training: TrainingArguments, steps_per_epoch: int) -> int:
    """Optimizer steps of the run when an epoch is ``steps_per_epoch`` steps long."""
    if training.max_steps > 0:
        return training.max_steps
    return max(1, math.ceil(training.num_train_epochs * steps_per_epoch))
