"""Stage dpo: direct preference optimisation against a frozen reference model.

Every micro-batch holds whole pairs, documents alternating chosen, rejected
(:mod:`hpc_mca.data.preference`). For each document the objective needs the summed
log-probability of its answer tokens, under the policy and under the reference. Those sums,
the reference itself (a frozen copy, the policy with its LoRA adapters off, ``ref_model``'s, or
none for a reference-free run), its forward-only pass before each step and the loss contract
(the gradient of the mean over the global batch's pairs) belong to the
:class:`~hpc_mca.trainer.reference.ReferenceScoring` this objective holds, as kto's does. What
is dpo's is the pair loss and its metrics, on the last pipeline stage. Pairs are counted on CP
rank 0 only (its CP peers hold the same pairs).

Losses (``finetuning.pref_loss``), with ``d = (π_c − ref_c) − (π_r − ref_r)`` in summed
log-probabilities: sigmoid ``−(1−ε)·logσ(βd) − ε·logσ(−βd)`` (ε = ``dpo_label_smoothing``),
hinge ``relu(1 − βd)``, ipo ``(d' − 1/(2β))²`` where d' divides each side's log-ratio by its
answer length; reference-free (see :mod:`hpc_mca.loop.preference`): orpo and simpo on per-token
mean log-probabilities, and the three above with reference log-probabilities 0 under
``use_ref_model: false``. ``pref_ftx`` adds the chosen answer's mean token NLL. The metrics are
TRL's: ``rewards/chosen`` and ``rewards/rejected`` = β·(π − ref) (orpo, simpo: β times the mean
log-probability), ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected``, each a mean over the pairs; orpo adds ``nll_loss``, ``log_odds_ratio`` and
``log_odds_chosen``.
"""

from __future__ import annotations

import torch

from hpc_mca.config.sections import TrainConfig
from hpc_mca.data.batch import PackedBatch
from hpc_mca.loop.preference import document_logps, metric_names, preference_loss
from hpc_mca.runtime.distributed import RankContext

from .objective import ChunkBuilder, ForwardStep, LossOutput, Objective, Schedule
from .reference import ReferenceScoring


class DpoObjective(Objective):
    """Preference pairs against a frozen reference (see the module docstring)."""

    name = "dpo"
    unit = "pairs"

    def __init__(self, config: TrainConfig, ctx: RankContext, vocab_size: int) -> None:
        super().__init__(config, ctx, vocab_size)
        self.scoring = ReferenceScoring(config, ctx)
        self._metrics = metric_names(config.finetuning)

    def attach(self, chunks: list[torch.nn.Module], build: ChunkBuilder) -> None:
        self.scoring.attach(chunks, build)

    def auxiliary_models(self) -> list[torch.nn.Module]:
        return self.scoring.chunks

    def before_forward(self, micro_batches: list[PackedBatch], schedule: Schedule) -> None:
        self.scoring.before_forward(micro_batches, schedule)

    def forward_step(self) -> ForwardStep:
        return self.scoring.forward_step(self._pair_loss)

    def _pair_loss(self, batch: PackedBatch, per_token: torch.Tensor) -> LossOutput:
        from megatron.core import parallel_state as mpu

        logps, lengths = document_logps(batch, per_token, mpu.get_context_parallel_group())
        reference = self.scoring.reference_logps(batch, logps.device)
        losses, metrics = preference_loss(logps, reference, lengths, self.config.finetuning)
        counted = float(mpu.get_context_parallel_rank() == 0)  # CP peers hold the same pairs
        report = torch.cat([torch.stack([losses.detach().sum(), torch.tensor(
            float(losses.numel()), device=losses.device)]), metrics]).double() * counted
        return self.scoring.loss_output(losses, batch, self.name, report)

    def reduce_loss(self, outputs: list[dict[str, torch.Tensor]], input_tokens: int = 0
                    ) -> tuple[float, int, int]:
        """(mean loss per pair, pairs, input tokens) of a global batch, on every rank."""
        return self.scoring.mean_loss(outputs, self.name, len(self._metrics), input_tokens)

    def step_metrics(self, outputs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """TRL's reward and log-probability means over the pairs of ``outputs``, on every rank."""
        sums = self.scoring.sums(outputs, self.name, len(self._metrics), 0)
        pairs = float(sums[1]) or float("nan")
        return {name: float(value) / pairs for name, value in zip(self._metrics, sums[2:-1])}
