"""The vocabulary-parallel cross-entropy of ``model.fusions: [cross_entropy]``: two compiled
reductions forward, one compiled elementwise pass backward, and nothing of vocabulary size kept
between them but the logits themselves.

Megatron-Core's fused version (``fusions/fused_cross_entropy.py``) turns the logits into an
fp32 copy, exponentiates and normalises it in place in separate compiled functions, keeps that
fp32 softmax for backward and builds an fp32 gradient before casting it to bf16: several passes
over a ``tokens x vocabulary/TP`` fp32 tensor (4.2 GB for Llama-3's 128,256-token vocabulary at
8,192 tokens a micro-batch), held from forward to backward. On one H200 (2026-11-28,
``benchmarks/kernel_options.py``: that micro-batch's output layer and loss, forward and
backward, bf16) Megatron's unfused loss took 34.1 ms and 6,545 MiB, its fused one 29.2 ms and
10,553 MiB, this one 22.8 ms and 4,541 MiB, with the same error against fp32 (8.4e-4); in
``hpc-mca train`` on the 1B shape it raised 53,350 tokens/s to 55,317.

Here each pass reads the logits in their own dtype and keeps its fp32 arithmetic in registers:

* forward: each rank's maximum (all-reduced, MAX), then each rank's sum of ``exp(logit - max)``
  and the target's logit where the target falls in the rank's vocabulary slice (all-reduced
  together, SUM: the same two collectives as Megatron's); ``loss = max + log(sum) - target
  logit``; the logits and the per-token ``log(sum exp)`` are kept for backward;
* backward: ``(exp(logit - logsumexp) - onehot(target)) * grad``, in the logits' dtype.

The loss and gradient are the softmax's, so the numbers equal Megatron's to rounding
(``tests/test_cross_entropy.py`` checks values and gradients against an fp64 softmax on one,
two and four ranks). The pieces are compiled, with dynamic shapes only where they change
(:func:`_compiled`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["vocab_parallel_cross_entropy"]


def _local_max(logits: Tensor) -> Tensor:
    return logits.amax(dim=-1).float()


def _sum_exp_and_target(logits: Tensor, target: Tensor, logits_max: Tensor,
                        start: int) -> Tensor:
    """``[sum exp(logit - max), the target's logit or 0]`` per token, stacked on dim 0."""
    shifted = logits.float() - logits_max.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    local = target - start
    hit = (local >= 0) & (local < logits.size(-1))
    picked = logits.gather(-1, torch.where(hit, local, 0).unsqueeze(-1)).squeeze(-1).float()
    return torch.stack((sum_exp, torch.where(hit, picked, 0.0)))


def _gradient(logits: Tensor, target: Tensor, logsumexp: Tensor, grad: Tensor,
              start: int) -> Tensor:
    """``(softmax - onehot(target)) * grad`` in the logits' dtype."""
    softmax = (logits.float() - logsumexp.unsqueeze(-1)).exp()
    columns = torch.arange(logits.size(-1), device=logits.device)
    onehot = (columns == (target - start).unsqueeze(-1)).float()
    return ((softmax - onehot) * grad.float().unsqueeze(-1)).to(logits.dtype)


_COMPILED: dict[str, Callable[..., Tensor]] = {}


def _compiled(name: str) -> Callable[..., Tensor]:
    """The piece ``name`` under torch.compile, built once per process. Shapes start static and
    only a dimension seen to change turns dynamic (torch's automatic dynamic shapes): the token
    count may vary between micro-batches, the vocabulary slice never does, and a kernel that
    knows its width at compile time indexes with constants. Compiled with ``dynamic=True``
    instead, the backward pass took 6.4 ms a micro-batch of 8,192 x 128,256 logits on an H200,
    four times its bytes' worth."""
    if name not in _COMPILED:
        pieces: dict[str, Callable[..., Tensor]] = {
            "max": _local_max, "sums": _sum_exp_and_target, "grad": _gradient}
        _COMPILED[name] = torch.compile(pieces[name])
    return _COMPILED[name]


class _Ctx(Protocol):
    """The autograd context of :class:`_CrossEntropy`: torch's, carrying the vocabulary
    slice's first id."""

    start: int
    shape: tuple[int, ...]
    saved_tensors: tuple[Tensor, ...]

    def save_for_backward(self, *tensors: Tensor) -> None: ...


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _Ctx, logits: Tensor, target: Tensor,
                group: ProcessGroup | None) -> Tensor:
        shape = target.shape  # the pieces see [tokens, vocabulary slice] rows
        logits, target = logits.reshape(-1, logits.size(-1)), target.reshape(-1)
        logits_max = _compiled("max")(logits)
        size = dist.get_world_size(group) if group is not None else 1
        if size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        # Megatron's vocabulary split: equal slices in rank order.
        start = (dist.get_rank(group) if size > 1 else 0) * logits.size(-1)
        sums = _compiled("sums")(logits, target, logits_max, start)
        if size > 1:
            dist.all_reduce(sums, group=group)
        logsumexp = logits_max + sums[0].log()
        ctx.save_for_backward(logits, target, logsumexp)
        ctx.start = start
        ctx.shape = tuple(shape)
        return (logsumexp - sums[1]).view(shape)

    @staticmethod
    def backward(ctx: _Ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        logits, target, logsumexp = ctx.saved_tensors
        grad_logits = _compiled("grad")(logits, target, logsumexp, grad.reshape(-1), ctx.start)
        return grad_logits.view(*ctx.shape, -1), None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor,
                                 group: ProcessGroup | None) -> Tensor:
    """Per-token cross-entropy of ``logits`` (``[..., vocab / TP]``, this rank's slice of the
    vocabulary over ``group``) against ``target`` (``[...]``, global token ids); the gradient
    comes back in the logits' dtype."""
    return _CrossEntropy.apply(logits, target, group)
