"""The kto loss both backends share: TRL's ``KTOTrainer`` arithmetic on per-document summed
log-probabilities, with LLaMA-Factory's names (``pref_beta`` as β, ``kto_chosen_weight``,
``kto_rejected_weight``).

A kto micro-batch holds, per example, its answer row then its KL row (the example's prompt
with another answer of the micro-step, :mod:`hpc_mca.data.feedback`), and ``tags`` (1 =
desirable). With ``r`` an answer's log-ratio (policy minus reference, summed over its tokens):

* ``KL`` = the mean over the micro-step's KL rows of policy minus reference log-probability,
  clamped at 0, with no gradient. The micro-step is the micro-batches every data-parallel rank
  trains at once, TRL's set (it takes the micro-batch mean, gathers it over ranks, averages
  and clamps): each backend adds :func:`micro_step_sums` over the DP (×CP/SP) group inside the
  micro-batch's loss, before the loss needs ``KL``. The policy's KL-row log-probabilities come
  from the same forward as the answers'; they get no gradient.
* desirable: ``w_c · (1 − σ(β(r − KL)))``; undesirable: ``w_r · (1 − σ(β(KL − r)))``; the
  step's loss is their mean over the global batch's examples (TRL: mean per micro-batch, then
  over micro-batches and ranks: the same, every micro-batch having as many examples).

Metrics (TRL 1.16's log names): ``rewards/chosen`` and ``rewards/rejected`` (β·r, means over
a micro-step's desirable / undesirable examples), ``rewards/margins`` (their difference, when
both are present), ``logps/chosen`` and ``logps/rejected`` (policy log-probabilities), and
``kl``. As TRL, a step's value is the mean over its micro-steps that have one, and a step
without desirable (or undesirable) examples logs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hpc_mca.config.sections import FinetuningArguments

SUMS = ("kl/gaps", "kl/rows", "count/chosen", "count/rejected", "rewards/chosen",
        "rewards/rejected", "logps/chosen", "logps/rejected")
"""A micro-batch's sums (float64, no gradient), added over the micro-step's ranks."""
METRICS = ("rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected",
           "rewards/margins", "kl")
"""The logged values, in the order of :func:`micro_step_metrics`' pairs."""


def micro_step_sums(policy: torch.Tensor, reference: torch.Tensor, tags: torch.Tensor,
                    beta: float) -> torch.Tensor:
    """[len(SUMS)] of one micro-batch from per-document log-probabilities laid out answer, KL,
    answer, KL, ... and the examples' ``tags``."""
    gaps = (policy.detach() - reference.detach()).double().view(-1, 2)
    logps = policy.detach().double().view(-1, 2)[:, 0]
    good = tags.to(gaps.device).double()
    rewards = beta * gaps[:, 0]
    return torch.stack([gaps[:, 1].sum(), torch.tensor(float(len(gaps)), dtype=torch.float64,
                                                       device=gaps.device),
                        good.sum(), (1.0 - good).sum(), (rewards * good).sum(),
                        (rewards * (1.0 - good)).sum(), (logps * good).sum(),
                        (logps * (1.0 - good)).sum()])


def kl_estimate(sums: torch.Tensor) -> float:
    """KTO's KL term from a micro-step's :func:`micro_step_sums`: the mean, at least 0."""
    return max(float(sums[0] / sums[1]), 0.0) if float(sums[1]) else 0.0


def kto_loss(policy: torch.Tensor, reference: torch.Tensor, tags: torch.Tensor, kl: float,
             ft: FinetuningArguments) -> torch.Tensor:
    """The weighted loss of each example (answer rows only); ``ft`` is FinetuningArguments."""
    answers = policy.view(-1, 2)[:, 0]
    ratios = answers - reference.view(-1, 2)[:, 0].to(answers)
    beta = ft.pref_beta
    chosen = ft.kto_chosen_weight * (1.0 - torch.sigmoid(beta * (ratios - kl)))
    rejected = ft.kto_rejected_weight * (1.0 - torch.sigmoid(beta * (kl - ratios)))
    return torch.where(tags.to(answers.device).bool(), chosen, rejected)


def micro_step_metrics(sums: torch.Tensor) -> torch.Tensor:
    """[value, present] pairs of :data:`METRICS` for one micro-step's summed ``sums``
    (float64 [2·len(METRICS)]; adding them over micro-steps, :func:`step_metrics` averages)."""
    values = dict(zip(SUMS, sums.tolist()))
    chosen, rejected = values["count/chosen"], values["count/rejected"]
    pairs = [(values["rewards/chosen"] / chosen, 1.0) if chosen else (0.0, 0.0),
             (values["logps/chosen"] / chosen, 1.0) if chosen else (0.0, 0.0),
             (values["rewards/rejected"] / rejected, 1.0) if rejected else (0.0, 0.0),
             (values["logps/rejected"] / rejected, 1.0) if rejected else (0.0, 0.0)]
    margin = (pairs[0][0] - pairs[2][0], 1.0) if chosen and rejected else (0.0, 0.0)
    pairs += [margin, (kl_estimate(sums), 1.0)]
    return torch.tensor([x for pair in pairs for x in pair], dtype=torch.float64,
                        device=sums.device)


def step_metrics(totals: list[float]) -> dict[str, float]:
    """The logged means from :func:`micro_step_metrics` added over a step's micro-steps."""
    return {name: totals[2 * k] / totals[2 * k + 1] for k, name in enumerate(METRICS)
            if totals[2 * k + 1]}
