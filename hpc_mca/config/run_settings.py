"""Rules of the settings every run honours at run time whatever its backend (the process-group
timeout, loader workers, starting afresh), checked by :meth:`TrainConfig.resolve` so that
``hpc-mca submit`` refuses them on the login node as the ranks would."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .input import ConfigError

if TYPE_CHECKING:
    from .sections import TrainConfig


def check_run_settings(config: TrainConfig, world_size: int) -> None:
    """training.ddp_timeout, hang_timeout, dataloader_num_workers and _prefetch_factor, and overwrite_output_dir against
    resume_from_checkpoint: one line each, the first found."""
    training = config.training
    if training.ddp_timeout <= 0:
        raise ConfigError(f"training.ddp_timeout={training.ddp_timeout} must be a positive number "
                          "of seconds (default 1800)")
    hang = training.hang_timeout
    if hang is not None and (hang < 0 or 0 < training.ddp_timeout <= hang):
        raise ConfigError(f"training.hang_timeout={hang} must be 0 (no watchdog), null (automatic) "
                          f"or a number of seconds below training.ddp_timeout={training.ddp_timeout} "
                          "(the collective timeout would end the job first, without naming the node)")
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
