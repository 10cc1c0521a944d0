"""Teacher-forced exact match of the response tokens: the task metric both backends evaluate.

A sample counts as correct when the argmax prediction is right at every response position.
Because greedy decoding emits exactly the argmax at each position given a correct prefix, this
equals exact match of greedily generated answers, end-of-turn token included, without a
generation loop. A general metric, so it sits with the loops, not with the demo task that
first needed it (:mod:`hpc_mca.data.addition`).
"""

from __future__ import annotations

import torch

from hpc_mca.data.tokenize import IGNORE_INDEX

__all__ = ["response_exact_match"]


def response_exact_match(predictions: torch.Tensor, labels: torch.Tensor,
                         attention_mask: torch.Tensor) -> torch.Tensor:
    """``[correct, total]`` (int64) over the samples of a batch.

    ``predictions`` are argmax token ids aligned with ``labels`` (both ``[B, S]``, labels
    already shifted, ``IGNORE_INDEX`` where untrained); ``attention_mask`` numbers the samples
    of each row (packed) or is 1 on real tokens (padded). A sample counts when it has at least
    one trained position; it is correct when every trained position is predicted. The result
    can be all-reduced (summed) across data-parallel ranks.
    """
    trained = labels != IGNORE_INDEX
    docs = int(attention_mask.max()) + 1 if attention_mask.numel() else 1
    rows = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1)
    key = (rows * docs + attention_mask.long()).reshape(-1)
    size = labels.shape[0] * docs
    wrong = torch.zeros(size, dtype=torch.long, device=labels.device)
    wrong.scatter_add_(0, key, ((predictions != labels) & trained).reshape(-1).long())
    has = torch.zeros(size, dtype=torch.long, device=labels.device)
    has.scatter_add_(0, key, trained.reshape(-1).long())
    counted = has > 0
    return torch.stack([(counted & (wrong == 0)).sum(), counted.sum()])
