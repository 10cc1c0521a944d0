"""Rules of the settings every run honours at run time whatever its backend (the process-group
timeout, loader workers, starting afresh), checked by :meth:`TrainConfig.resolve` so that
``hpc-mca submit`` refuses them on the login node as the ranks would."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_mca.rundir import STEPS_FILE

from .input import ConfigError

if TYPE_CHECKING:
    from .sections import TrainConfig, TrainingArguments

MIN_HANG_TIMEOUT_S = 5
"""The least ``training.hang_timeout``: a finished step reaches the watchdog up to two beat
intervals (1 s each at the shortest) after it happened, and the watchdog reads once an interval;
below ~5 s a healthy step is indistinguishable from a stalled one (``hang_timeout=1`` declared a
healthy 400-step run hung at step 140 on the local Slurm)."""
STEP_TIME_FACTOR = 3.0
"""A hang timeout must allow this many of the run's median recorded step times."""
_TAIL_BYTES = 65536


def check_run_settings(config: TrainConfig, world_size: int) -> None:
    """training.ddp_timeout, hang_timeout, dataloader_num_workers and _prefetch_factor, and overwrite_output_dir against
    resume_from_checkpoint: one line each, the first found."""
    training = config.training
    if training.ddp_timeout <= 0:
        raise ConfigError(f"training.ddp_timeout={training.ddp_timeout} must be a positive number "
                          "of seconds (default 1800)")
    _check_hang_timeout(training)
    if training.dataloader_num_workers < 0:
        raise ConfigError(f"training.dataloader_num_workers={training.dataloader_num_workers}: "
                          "valid: 0 (load in the training process) or more worker processes")
    prefetch = training.dataloader_prefetch_factor
    if prefetch is not None and (prefetch < 1 or training.dataloader_num_workers == 0):
        raise ConfigError(f"training.dataloader_prefetch_factor={prefetch} with dataloader_num_workers="
                          f"{training.dataloader_num_workers}; valid: null, or a positive number of "
                          "micro-batches with dataloader_num_workers > 0 (torch prefetches only in workers)")
    if training.overwrite_output_dir and training.resume_from_checkpoint == "latest":
        raise ConfigError("training.resume_from_checkpoint=latest (true) with "
                          "training.overwrite_output_dir=true: the first start moves output_dir's run "
                          "aside, leaving nothing to resume; valid: resume_from_checkpoint auto (null) "
                          "or never, or overwrite_output_dir false")


def _check_hang_timeout(training: TrainingArguments) -> None:
    """hang_timeout: 0, null, or seconds in [MIN_HANG_TIMEOUT_S, ddp_timeout), and at least
    STEP_TIME_FACTOR x the median step time the run already recorded (a resume)."""
    hang, ddp = training.hang_timeout, training.ddp_timeout
    if hang is None or hang == 0:
        return
    if hang < 0 or 0 < ddp <= hang:
        raise ConfigError(f"training.hang_timeout={hang} must be 0 (no watchdog), null (automatic) "
                          f"or a number of seconds below training.ddp_timeout={ddp} "
                          "(the collective timeout would end the job first, without naming the node)")
    if hang < MIN_HANG_TIMEOUT_S:
        raise ConfigError(f"training.hang_timeout={hang} is below {MIN_HANG_TIMEOUT_S} s, shorter than "
                          "the heartbeat can tell a healthy step from a stalled one; valid: 0 (no "
                          f"watchdog), null (automatic) or {MIN_HANG_TIMEOUT_S}-{ddp - 1} s")
    median = None if training.overwrite_output_dir else recorded_median_step_s(training.output_dir)
    if median is not None and hang < STEP_TIME_FACTOR * median:
        raise ConfigError(f"training.hang_timeout={hang} is below {STEP_TIME_FACTOR:.0f} x this run's "
                          f"median step time ({median:.1f} s in {training.output_dir}/{STEPS_FILE}): "
                          f"healthy steps would be taken for hangs; valid: 0, null (automatic) or at "
                          f"least {int(STEP_TIME_FACTOR * median) + 1} s")


def recorded_median_step_s(output_dir: str | None) -> float | None:
    """The median ``seconds`` of the last steps output_dir's steps.jsonl recorded (its last
    64 KiB: a few hundred steps), or None without any."""
    if not output_dir:
        return None
    path = Path(output_dir) / STEPS_FILE
    try:
        with open(path, "rb") as steps:
            steps.seek(max(0, os.path.getsize(path) - _TAIL_BYTES))
            lines = steps.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    seconds = []
    for line in lines:
        try:
            value = json.loads(line).get("seconds")
        except (ValueError, AttributeError):
            continue  # a torn first line of the tail
        if isinstance(value, (int, float)) and value > 0:
            seconds.append(float(value))
    return statistics.median(seconds) if seconds else None
