"""The one module where the standard backend reaches into transformers' ``Trainer`` internals.

Everything else in :mod:`hpc_mca.standard` uses transformers' public API: ``TrainerCallback``
events, ``compute_loss``, ``get_batch_samples``, ``get_train_dataloader``, ``evaluate``,
``save_model`` and ``TrainerState``. Two things have no public hook:

* **the step's gradient norm** (before clipping), which the Trainer computes and hands only to
  its private step end; :class:`AdaptedTrainer` keeps it for the step-end callback;
* **the optimizer, scheduler and RNG files** of a checkpoint, which only the Trainer's private
  savers write in the layout its own ``train(resume_from_checkpoint=...)`` reads back.

``tests/test_hf_api.py`` checks these names against the installed transformers, which must
lie in the range ``pyproject.toml`` declares; a transformers upgrade that moves them fails that
test instead of training silently without a grad norm or a resumable checkpoint.
"""

from __future__ import annotations

import torch
from transformers import Trainer

__all__ = ["PRIVATE_MEMBERS", "AdaptedTrainer", "save_training_state"]

PRIVATE_MEMBERS = ("_get_grad_norm", "_save_optimizer_and_scheduler", "_save_rng_state")
"""transformers.Trainer's private methods this module uses (checked by the pinned test)."""


class AdaptedTrainer(Trainer):
    """transformers' Trainer that keeps each optimizer step's gradient norm
    (``step_grad_norm``: the pre-clip norm, or the plain norm without clipping)."""

    step_grad_norm: torch.Tensor | float | None = None

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: torch.Tensor | float | None = None
                       ) -> torch.Tensor | float:
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.step_grad_norm = norm
        return norm


def save_training_state(trainer: Trainer, output_dir: str) -> None:
    """Write ``trainer``'s optimizer, LR scheduler and RNG files into ``output_dir`` (every
    rank calls it; the optimizer and scheduler are written where transformers decides)."""
    trainer._save_optimizer_and_scheduler(output_dir)
    trainer._save_rng_state(output_dir)
