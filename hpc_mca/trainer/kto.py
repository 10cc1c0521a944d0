"""Stage kto: Kahneman-Tversky optimisation of unpaired feedback against a frozen reference
(the arithmetic is :mod:`hpc_mca.loop.kto`'s, TRL's ``KTOTrainer``).

A micro-batch holds whole examples, rows answer, KL row, answer, KL row, ...
(:mod:`hpc_mca.data.feedback`). What is dpo's is reused from
:class:`~hpc_mca.trainer.dpo.DpoObjective`: the reference (a frozen copy, or with LoRA the
policy with its adapters off) and its forward-only pass before the step, the per-document
log-probabilities (CP shares summed) and the loss contract (a micro-batch returns its summed
example losses times the global batch's answer tokens per example; Megatron divides by the
tokens, so the gradient is that of the mean over the global batch's examples).

What kto adds is in the loss function, on the last pipeline stage: the micro-batch's KL-row
gaps and metric sums are added over the DP×CP group (the micro-step: every DP replica's
last stage runs its m-th micro-batch's loss in the same order), which gives the KL estimate
before the loss is formed. The metrics of a micro-step are reported once (DP×CP rank 0), the
loss sums by every DP rank (CP rank 0).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hpc_mca.data.batch import PackedBatch
from hpc_mca.loop.kto import METRICS, kl_estimate, kto_loss, micro_step_metrics, micro_step_sums, step_metrics
from hpc_mca.loop.preference import document_logps

from .dpo import DpoObjective


class KtoObjective(DpoObjective):
    """Unpaired feedback against a frozen reference (see the module docstring)."""

    name = "kto"
    unit = "examples"

    def _pair_loss(self, batch: PackedBatch, per_token: torch.Tensor) -> Any:
        from megatron.core import parallel_state as mpu

        ft = self.config.finetuning
        logps, _ = document_logps(batch, per_token, mpu.get_context_parallel_group())
        reference = self._reference_logps.pop(id(batch)).to(logps.device)
        counted = float(mpu.get_context_parallel_rank() == 0)  # CP peers hold the same examples
        sums = micro_step_sums(logps, reference, batch.tags, ft.pref_beta) * counted
        group = mpu.get_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(sums, group=group)  # the micro-step's KL rows and examples
        losses = kto_loss(logps, reference, batch.tags, kl_estimate(sums), ft)
        once = float(dist.get_rank(group) == 0)
        report = torch.cat([torch.stack([losses.detach().sum().double(), torch.tensor(
            float(losses.numel()), dtype=torch.float64, device=losses.device)]) * counted,
            micro_step_metrics(sums) * once])
        tokens = batch.loss_mask.sum().to(torch.int)
        return losses.sum() * self._tokens_per_pair, tokens, {"kto": report}

    def step_metrics(self, outputs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """TRL's reward, log-probability and KL means over the micro-steps of ``outputs``."""
        return step_metrics(self._sums(outputs, 0)[2:-1].tolist())

    def _report_width(self) -> int:
        """Each micro-step metric as a (sum, count) pair (hpc_mca.loop.kto)."""
        return 2 * len(METRICS)
