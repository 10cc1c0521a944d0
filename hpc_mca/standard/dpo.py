"""Stage dpo on the standard backend: the Megatron backend's preference objective on the
transformers model.

The pairs, losses and metrics are those of :mod:`hpc_mca.trainer.dpo` (its
:func:`~hpc_mca.loop.preference.preference_loss` is called here): each micro-batch holds whole
pairs, documents alternating chosen, rejected; a document's log-probability is the sum over
its answer tokens. The reference (a frozen copy, the policy with its LoRA adapters off,
``ref_model``'s, or none for a reference-free run), the per-document log-probabilities (SP
slices summed) and the loss contract (summed pair losses times ``W/P``, world size over the
global batch's pairs; DDP's average divides ``W`` back out) belong to the
:class:`~hpc_mca.standard.reference.ReferenceScoring` this trainer holds, as kto's does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hpc_mca.data.batch import PackedBatch
from hpc_mca.loop.preference import metric_names, preference_loss

from .reference import ReferenceScoring
from .trainer import StandardTrainer

if TYPE_CHECKING:
    from transformers import TrainerCallback, TrainingArguments

    from hpc_mca.loop.boundary import StepBoundary
    from hpc_mca.loop.metrics import MetricsWriter

    from .model import LRSchedule
    from .run import StandardRun

__all__ = ["StandardDpoTrainer"]


class StandardDpoTrainer(StandardTrainer):
    """:class:`StandardTrainer` with the preference objective (see the module docstring).
    ``reference``: from :func:`~hpc_mca.standard.reference.frozen_reference`."""

    unit = "pairs"

    def __init__(self, *, run: StandardRun, model: torch.nn.Module, args: TrainingArguments,
                 optimizers: tuple[torch.optim.Optimizer, LRSchedule], boundary: StepBoundary,
                 metrics: MetricsWriter, callbacks: list[TrainerCallback],
                 reference: torch.nn.Module | None) -> None:
        super().__init__(run=run, model=model, args=args, optimizers=optimizers, boundary=boundary,
                         metrics=metrics, callbacks=callbacks)
        self.scoring = ReferenceScoring(self.run, model, reference)
        self.metric_names = metric_names(self.run.config.finetuning)
        # Summed over the step's micro-batches: the per-pair metrics (SP rank 0 only).
        self.pref_sums = torch.zeros(len(self.metric_names), dtype=torch.float64)

    def count_items(self, batch_samples: list[dict[str, torch.Tensor]]) -> float:
        """Pairs of this rank's micro-batches, counted once per SP group."""
        return self.scoring.count_items(batch_samples)

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                     return_outputs: bool = False, num_items_in_batch: torch.Tensor | int | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, None]:
        reference = self.scoring.reference_logps(model, inputs)
        policy, lengths = self.scoring.document_logps(model, inputs, grad=True)
        losses, metrics = preference_loss(policy, reference, lengths,
                                          self.run.config.finetuning)
        if self.run.sp_rank == 0:  # SP peers hold the same pairs
            self.tally.loss_sum += float(losses.detach().sum())
            self.pref_sums += metrics.double().cpu()
        loss = self.scoring.loss(losses, num_items_in_batch)
        return (loss, None) if return_outputs else loss

    def step_metrics(self, count: int) -> dict[str, float]:
        """TRL's reward and log-probability means over the step's ``count`` pairs, on every
        rank."""
        sums = self.pref_sums.clone().to(self.run.device)  # .to is no copy on the CPU
        self.pref_sums.zero_()
        if dist.is_initialized():
            dist.all_reduce(sums)
        return {name: float(value) / (count or float("nan"))
                for name, value in zip(self.metric_names, sums)}

    # ---- evaluation ---------------------------------------------------------------------------

    def eval_sums(self, model: torch.nn.Module, batch: PackedBatch, stream: dict[str, torch.Tensor]
                  ) -> torch.Tensor:
        """[pair losses, pairs, *metrics] of one eval micro-batch (SP rank 0 counts)."""
        reference = self.scoring.reference_logps(model, stream)
        policy, lengths = self.scoring.document_logps(model, stream, grad=False)
        losses, metrics = preference_loss(policy, reference, lengths,
                                          self.run.config.finetuning)
        sums = torch.cat([torch.stack([losses.sum(), torch.tensor(
            float(losses.numel()), device=losses.device)]), metrics]).double()
        return sums * float(self.run.sp_rank == 0)

    def metrics_from_sums(self, sums: torch.Tensor) -> dict[str, float]:
        loss, pairs, *values = sums.tolist()
        pairs = pairs or float("nan")
        return {"eval/loss": loss / pairs,
                **{f"eval/{name}": value / pairs for name, value in zip(self.metric_names, values)}}
