"""Stage kto on the standard backend: the Megatron backend's kto objective on the transformers
model (the arithmetic is :mod:`hpc_mca.loop.kto`'s, TRL's ``KTOTrainer``).

What kto shares with dpo is a part both hold, neither inheriting the other: the
:class:`~hpc_mca.standard.reference.ReferenceScoring` (the reference, the per-document
log-probabilities with SP slices summed, and the loss contract: summed example losses times
``W/E``, world size over the global batch's examples, DDP's average divides ``W`` back out).
Every rank computes a micro-batch's loss in step with the others (the same gradient
accumulation), so the micro-step's KL rows and metric sums are added over all ranks inside
``compute_loss`` (SP peers count once), before the loss needs the KL estimate; a micro-step's
metrics are kept by rank 0 only, and the step's values are their means (TRL's log).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hpc_mca.data.batch import PackedBatch
from hpc_mca.loop.kto import METRICS, kl_estimate, kto_loss, micro_step_metrics, micro_step_sums, step_metrics

from .reference import ReferenceScoring
from .trainer import StandardTrainer

if TYPE_CHECKING:
    from transformers import TrainerCallback, TrainingArguments

    from hpc_mca.loop.boundary import StepBoundary
    from hpc_mca.loop.metrics import MetricsWriter

    from .model import LRSchedule
    from .run import StandardRun

__all__ = ["StandardKtoTrainer"]


class StandardKtoTrainer(StandardTrainer):
    """:class:`StandardTrainer` with kto's loss (see the module docstring). ``reference``:
    from :func:`~hpc_mca.standard.reference.frozen_reference`."""

    unit = "examples"

    def __init__(self, *, run: StandardRun, model: torch.nn.Module, args: TrainingArguments,
                 optimizers: tuple[torch.optim.Optimizer, LRSchedule], boundary: StepBoundary,
                 metrics: MetricsWriter, callbacks: list[TrainerCallback],
                 reference: torch.nn.Module | None) -> None:
        super().__init__(run=run, model=model, args=args, optimizers=optimizers, boundary=boundary,
                         metrics=metrics, callbacks=callbacks)
        self.scoring = ReferenceScoring(self.run, model, reference)
        self.kto_sums = torch.zeros(2 * len(METRICS), dtype=torch.float64)

    def count_items(self, batch_samples: list[dict[str, torch.Tensor]]) -> float:
        """Examples of this rank's micro-batches, counted once per SP group."""
        return self.scoring.count_items(batch_samples)

    def micro_step(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], *, grad: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(example losses, the micro-step's metric pairs, rank 0 only) of one micro-batch."""
        ft = self.run.config.finetuning
        reference = self.scoring.reference_logps(model, inputs)
        if reference is None:  # kto always runs a reference (no pref_loss)
            raise RuntimeError("kto needs the reference's log-probabilities")
        policy, _ = self.scoring.document_logps(model, inputs, grad=grad)
        sums = micro_step_sums(policy, reference, inputs["tags"], ft.pref_beta)
        sums = sums * float(self.run.sp_rank == 0)  # SP peers hold the same rows
        first = True
        if dist.is_initialized():
            dist.all_reduce(sums)
            first = dist.get_rank() == 0
        losses = kto_loss(policy, reference, inputs["tags"], kl_estimate(sums), ft)
        return losses, micro_step_metrics(sums).cpu() * float(first)

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                     return_outputs: bool = False, num_items_in_batch: torch.Tensor | int | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, None]:
        losses, metrics = self.micro_step(model, inputs, grad=True)
        if self.run.sp_rank == 0:  # SP peers hold the same examples
            self.tally.loss_sum += float(losses.detach().sum())
        self.kto_sums += metrics
        loss = self.scoring.loss(losses, num_items_in_batch)
        return (loss, None) if return_outputs else loss

    def step_metrics(self, count: int) -> dict[str, float]:
        """TRL's reward, log-probability and KL means over the step's micro-steps."""
        sums = self.kto_sums.clone().to(self.run.device)
        self.kto_sums.zero_()
        if dist.is_initialized():
            dist.all_reduce(sums)
        return step_metrics(sums.tolist())

    def eval_sums(self, model: torch.nn.Module, batch: PackedBatch, stream: dict[str, torch.Tensor]
                  ) -> torch.Tensor:
        """[example losses, examples, *metric pairs] of one eval micro-batch (SP rank 0 counts
        the losses, rank 0 the micro-step's metrics)."""
        losses, metrics = self.micro_step(model, stream, grad=False)
        counted = float(self.run.sp_rank == 0)
        head = torch.tensor([float(losses.sum()) * counted, losses.numel() * counted],
                            dtype=torch.float64)
        return torch.cat([head, metrics]).to(self.run.device)

    def metrics_from_sums(self, sums: torch.Tensor) -> dict[str, float]:
        loss, examples, *values = sums.tolist()
        metrics = {f"eval/{name}": value for name, value in step_metrics(values).items()}
        return {"eval/loss": loss / (examples or float("nan")), **metrics}
