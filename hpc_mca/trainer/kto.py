"""Stage kto: Kahneman-Tversky optimisation of unpaired feedback against a frozen reference
(the arithmetic is :mod:`hpc_mca.loop.kto`'s, TRL's ``KTOTrainer``).

A micro-batch holds whole examples, rows answer, KL row, answer, KL row, ...
(:mod:`hpc_mca.data.feedback`). What kto shares with dpo is a part both hold, neither
inheriting the other: the :class:`~hpc_mca.trainer.reference.ReferenceScoring` (the reference,
a frozen copy or with LoRA the policy with its adapters off, and its forward-only pass before
the step; the loss contract: a micro-batch returns its summed example losses times the global
batch's answer tokens per example, Megatron divides by the tokens, so the gradient is that of
the mean over the global batch's examples), and the per-document log-probabilities (CP shares
summed, :func:`hpc_mca.loop.preference.document_logps`).

What kto adds is in the loss function, on the last pipeline stage: the micro-batch's KL-row
gaps and metric sums are added over the DP×CP group (the micro-step: every DP replica's
last stage runs its m-th micro-batch's loss in the same order), which gives the KL estimate
before the loss is formed. The metrics of a micro-step are reported once (DP×CP rank 0), the
loss sums by every DP rank (CP rank 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpc_mca.config.sections import TrainConfig
from hpc_mca.data.batch import PackedBatch
from hpc_mca.loop.kto import METRICS, kl_estimate, kto_loss, micro_step_metrics, micro_step_sums, step_metrics
from hpc_mca.loop.preference import document_logps
from hpc_mca.runtime.distributed import RankContext

from .objective import ChunkBuilder, ForwardStep, LossOutput, Objective, Schedule
from .reference import ReferenceScoring

_WIDTH = 2 * len(METRICS)
"""Metric sums in a micro-batch's report: each micro-step metric as a (sum, count) pair."""


class KtoObjective(Objective):
    """Unpaired feedback against a frozen reference (see the module docstring)."""

    name = "kto"
    unit = "examples"

    def __init__(self, config: TrainConfig, ctx: RankContext, vocab_size: int) -> None:
        super().__init__(config, ctx, vocab_size)
        self.scoring = ReferenceScoring(config, ctx)

    def attach(self, chunks: list[torch.nn.Module], build: ChunkBuilder) -> None:
        self.scoring.attach(chunks, build)

    def auxiliary_models(self) -> list[torch.nn.Module]:
        return self.scoring.chunks

    def before_forward(self, micro_batches: list[PackedBatch], schedule: Schedule) -> None:
        self.scoring.before_forward(micro_batches, schedule)

    def forward_step(self) -> ForwardStep:
        return self.scoring.forward_step(self._example_loss)

    def _example_loss(self, batch: PackedBatch, per_token: torch.Tensor) -> LossOutput:
        from megatron.core import parallel_state as mpu

        ft = self.config.finetuning
        logps, _ = document_logps(batch, per_token, mpu.get_context_parallel_group())
        reference = self.scoring.reference_logps(batch, logps.device)
        tags = batch.tags
        if reference is None or tags is None:  # kto always runs a reference (no pref_loss)
            raise RuntimeError("kto needs the reference's log-probabilities and the rows' kto tags")
        counted = float(mpu.get_context_parallel_rank() == 0)  # CP peers hold the same examples
        sums = micro_step_sums(logps, reference, tags, ft.pref_beta) * counted
        group = mpu.get_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(sums, group=group)  # the micro-step's KL rows and examples
        losses = kto_loss(logps, reference, tags, kl_estimate(sums), ft)
        once = float(dist.get_rank(group) == 0)
        report = torch.cat([torch.stack([losses.detach().sum().double(), torch.tensor(
            float(losses.numel()), dtype=torch.float64, device=losses.device)]) * counted,
            micro_step_metrics(sums) * once])
        return self.scoring.loss_output(losses, batch, self.name, report)

    def reduce_loss(self, outputs: list[dict[str, torch.Tensor]], input_tokens: int = 0
                    ) -> tuple[float, int, int]:
        """(mean loss per example, examples, input tokens) of a global batch, on every rank."""
        return self.scoring.mean_loss(outputs, self.name, _WIDTH, input_tokens)

    def step_metrics(self, outputs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """TRL's reward, log-probability and KL means over the micro-steps of ``outputs``."""
        return step_metrics(self.scoring.sums(outputs, self.name, _WIDTH, 0)[2:-1].tolist())
