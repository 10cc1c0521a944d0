"""The one module where the standard backend reaches into transformers' ``Trainer`` internals.

Everything else in :mod:`hpc_mca.standard` uses transformers' public API: ``TrainerCallback``
events, ``compute_loss``, ``get_batch_samples``, ``get_train_dataloader``, ``evaluate``,
``save_model`` and ``TrainerState``. Two things have no public hook:

* **the step's gradient norm** (before clipping), which the Trainer computes and hands only to
  its private step end; :class:`AdaptedTrainer` keeps it for the step-end callback;
* **the optimizer, scheduler and RNG files** of a checkpoint, which only the Trainer's private
  savers write in the layout its own ``train(resume_from_checkpoint=...)`` reads back;
* **the model weights of a resumed checkpoint**, which the Trainer loads with a non-strict
  ``load_state_dict`` of the file's names: a model that ``save_pretrained`` writes under other
  names than its modules' (transformers 5's Qwen2-VL: ``model.layers.*`` for
  ``model.language_model.layers.*``) would silently resume from its initial weights, so
  :class:`AdaptedTrainer` loads those through ``from_pretrained``, which renames them back.

``tests/test_hf_api.py`` checks these names against the installed transformers, which must
lie in the range ``pyproject.toml`` declares; a transformers upgrade that moves them fails that
test instead of training silently without a grad norm or a resumable checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import torch
from transformers import PreTrainedModel, Trainer

__all__ = ["PRIVATE_MEMBERS", "AdaptedTrainer", "save_training_state"]

PRIVATE_MEMBERS = ("_get_grad_norm", "_load_from_checkpoint", "_save_optimizer_and_scheduler",
                   "_save_rng_state")
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

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        target = self.model if model is None else model
        saved = _saved_names(Path(resume_from_checkpoint))
        if target is None or saved is None or saved == set(target.state_dict()):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        dtype = next(target.parameters()).dtype
        # the names differ only for a transformers model (an adapter's are the modules')
        model_class = cast("type[PreTrainedModel]", type(target))
        loaded = model_class.from_pretrained(resume_from_checkpoint, dtype=dtype)
        target.load_state_dict(loaded.state_dict())  # strict: every weight is the checkpoint's


def _saved_names(checkpoint: Path) -> set[str] | None:
    """The tensor names of a checkpoint's full model files; None when it holds none (LoRA: an
    adapter, which peft names after the modules)."""
    from safetensors import safe_open

    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    single = checkpoint / "model.safetensors"
    if not single.is_file():
        return None
    with safe_open(str(single), framework="pt") as weights:
        return set(weights.keys())


def save_training_state(trainer: Trainer, output_dir: str) -> None:
    """Write ``trainer``'s optimizer, LR scheduler and RNG files into ``output_dir`` (every
    rank calls it; the optimizer and scheduler are written where transformers decides)."""
    trainer._save_optimizer_and_scheduler(output_dir)
    trainer._save_rng_state(output_dir)
