"""The preference loss both backends' dpo share: the pair losses (with a reference: sigmoid,
ipo, hinge; reference-free: orpo, simpo, or any of the first three with ``use_ref_model:
false``) and TRL's metrics from per-document summed log-probabilities, and the group sum whose backward is the identity.

The Megatron backend (:mod:`hpc_mca.trainer.dpo`) and the standard one
(:mod:`hpc_mca.standard.dpo`) differ in how they get each document's log-probabilities (a
pipeline schedule against a forward of the transformers model); from there on the arithmetic
is this module's, so both compute the same numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from hpc_mca.data.batch import PackedBatch
from hpc_mca.stages import REFERENCE_FREE_LOSSES, reference_runs

if TYPE_CHECKING:
    from hpc_mca.config.sections import FinetuningArguments

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
"""Per-pair means logged by dpo (TensorBoard ``train/<name>``, steps.jsonl ``<name>``)."""
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")
"""orpo's further per-pair means, TRL's ORPOTrainer's names (see :func:`metric_names`)."""


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward passes the gradient through unchanged: every rank of
    the group computes the same function of the sum, and each backpropagates it into its own
    addend only."""

    @staticmethod
    def forward(ctx: FunctionCtx, local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        total = local.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_group(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of ``local`` over ``group``, on every rank; its gradient flows into this rank's
    ``local`` unchanged (see :class:`_SumOverGroup`)."""
    return _SumOverGroup.apply(local, group)


def document_logps(batch: PackedBatch, per_token_loss: torch.Tensor, cp_group: dist.ProcessGroup | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each document's labelled tokens, their count), over the
    whole documents (CP shares summed), float32 [documents]."""
    mask = batch.loss_mask.reshape(-1).to(per_token_loss.device).float()
    index = batch.document_index().to(per_token_loss.device)
    docs = batch.num_documents
    logp = torch.zeros(docs, device=mask.device).index_add(
        0, index, -per_token_loss.float().reshape(-1) * mask)
    count = torch.zeros(docs, device=mask.device).index_add(0, index, mask)
    if batch.cp_size > 1:
        logp = _SumOverGroup.apply(logp, cp_group)
        dist.all_reduce(count, group=cp_group)
    return logp, count


def metric_names(ft: FinetuningArguments) -> tuple[str, ...]:
    """The per-pair metrics a run logs: TRL's six, and for orpo also TRL's ORPOTrainer's
    ``nll_loss`` (the chosen answer's mean token NLL), ``log_odds_ratio`` (log σ of the log
    odds ratio) and ``log_odds_chosen`` (the log odds ratio)."""
    return METRICS + ORPO_METRICS if ft.pref_loss == "orpo" else METRICS


def uses_reference(ft: FinetuningArguments) -> bool:
    """Whether this run's preference loss reads a reference model (see
    :func:`hpc_mca.stages.reference_runs`)."""
    return reference_runs(ft.stage, ft.pref_loss, ft.use_ref_model)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − eˣ) for x < 0, accurate at both ends (expm1 near 0, log1p far below)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)),
                       torch.log1p(-torch.exp(x)))


def _reference_free(means: torch.Tensor, ft: FinetuningArguments) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(loss of each pair, orpo's extra metric sums) from per-token mean log-probabilities
    [pairs, 2]. orpo: NLL of the chosen answer − β·log σ(log odds ratio); simpo:
    −log σ(β·(c − r) − γ). LLaMA-Factory's definitions; TRL's ORPOTrainer and CPOTrainer
    (loss_type simpo) compute the same per pair."""
    chosen, rejected = means[:, 0], means[:, 1]
    if ft.pref_loss == "simpo":
        return -F.logsigmoid(ft.pref_beta * (chosen - rejected) - ft.simpo_gamma), []
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    losses = -chosen - ft.pref_beta * ratio
    return losses, [-chosen.detach().sum(), ratio.detach().sum(), log_odds.detach().sum()]


def preference_loss(policy: torch.Tensor, reference: torch.Tensor | None, lengths: torch.Tensor,
                    ft: FinetuningArguments) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss of each pair, metric sums [len(metric_names(ft))]) from per-document values laid
    out chosen, rejected, chosen, ... ; ``ft`` is the run's FinetuningArguments. ``reference``
    is None for a reference-free run: orpo and simpo (on per-token mean log-probabilities, as
    LLaMA-Factory computes them; their rewards and ``logps/*`` are those means), or
    ``use_ref_model: false`` (TRL's ``reference_free``: the reference log-probabilities are
    0)."""
    pairs = policy.view(-1, 2)
    chosen_mean = pairs[:, 0] / lengths.view(-1, 2)[:, 0].clamp(min=1.0)
    beta = ft.pref_beta
    extra: list[torch.Tensor] = []
    if ft.pref_loss in REFERENCE_FREE_LOSSES:
        logps = pairs / lengths.view(-1, 2).clamp(min=1.0)
        losses, extra = _reference_free(logps, ft)
        ratios = logps
    else:
        logps = pairs
        ratios = pairs if reference is None else pairs - reference.view(-1, 2)
        losses = _with_reference(ratios, lengths, ft)
    if ft.pref_ftx:
        losses = losses - ft.pref_ftx * chosen_mean
    rewards = beta * ratios.detach()
    metrics = torch.stack([rewards[:, 0].sum(), rewards[:, 1].sum(),
                           (rewards[:, 0] > rewards[:, 1]).float().sum(),
                           (rewards[:, 0] - rewards[:, 1]).sum(),
                           logps[:, 0].detach().sum(), logps[:, 1].detach().sum(), *extra])
    return losses, metrics


def _with_reference(ratios: torch.Tensor, lengths: torch.Tensor, ft: FinetuningArguments) -> torch.Tensor:
    """sigmoid, ipo and hinge on the summed log-ratios [pairs, 2] (see hpc_mca.trainer.dpo)."""
    beta = ft.pref_beta
    if ft.pref_loss == "ipo":
        mean = ratios / lengths.view(-1, 2).clamp(min=1.0)
        return (mean[:, 0] - mean[:, 1] - 1.0 / (2.0 * beta)) ** 2
    delta = beta * (ratios[:, 0] - ratios[:, 1])
    if ft.pref_loss == "hinge":
        return torch.relu(1.0 - delta)
    smoothing = ft.dpo_label_smoothing
    return -(1.0 - smoothing) * F.logsigmoid(delta) - smoothing * F.logsigmoid(-delta)
