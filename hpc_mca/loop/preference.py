"""The preference loss both backends' dpo share: the pair losses and TRL's metrics from
per-document summed log-probabilities, and the group sum whose backward is the identity.

The Megatron backend (:mod:`hpc_mca.trainer.dpo`) and the standard one
(:mod:`hpc_mca.standard.dpo`) differ in how they get each document's log-probabilities (a
pipeline schedule against a forward of the transformers model); from there on the arithmetic
is this module's, so both compute the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpc_mca.data.batch import PackedBatch

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
"""Per-pair means logged by dpo (TensorBoard ``train/<name>``, steps.jsonl ``<name>``)."""


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward passes the gradient through unchanged: every rank of
    the group computes the same function of the sum, and each backpropagates it into its own
    addend only."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        total = local.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_group(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``local`` over ``group``, on every rank; its gradient flows into this rank's
    ``local`` unchanged (see :class:`_SumOverGroup`)."""
    return _SumOverGroup.apply(local, group)


def document_logps(batch: PackedBatch, per_token_loss: torch.Tensor, cp_group: Any
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


def preference_loss(policy: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor,
                    ft: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss of each pair, metric sums [len(METRICS)]) from per-document values laid out
    chosen, rejected, chosen, ... ; ``ft`` is the run's FinetuningArguments."""
    ratios = (policy - reference).view(-1, 2)
    beta = ft.pref_beta
    if ft.pref_loss == "ipo":
        mean = ratios / lengths.view(-1, 2).clamp(min=1.0)
        losses = (mean[:, 0] - mean[:, 1] - 1.0 / (2.0 * beta)) ** 2
    else:
        delta = beta * (ratios[:, 0] - ratios[:, 1])
        if ft.pref_loss == "hinge":
            losses = torch.relu(1.0 - delta)
        else:
            smoothing = ft.dpo_label_smoothing
            losses = -(1.0 - smoothing) * F.logsigmoid(delta) - smoothing * F.logsigmoid(-delta)
    chosen_logps = policy.view(-1, 2)[:, 0]
    if ft.pref_ftx:
        losses = losses - ft.pref_ftx * chosen_logps / lengths.view(-1, 2)[:, 0].clamp(min=1.0)
    rewards = beta * ratios.detach()
    metrics = torch.stack([rewards[:, 0].sum(), rewards[:, 1].sum(),
                           (rewards[:, 0] > rewards[:, 1]).float().sum(),
                           (rewards[:, 0] - rewards[:, 1]).sum(),
                           chosen_logps.detach().sum(), policy.detach().view(-1, 2)[:, 1].sum()])
    return losses, metrics
