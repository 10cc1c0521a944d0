"""``model.fusions: [cross_entropy]``'s vocabulary-parallel cross-entropy
(hpc_mca.models.cross_entropy) against torch's ``F.cross_entropy`` on the whole vocabulary:
per-token losses and logit gradients, in one process and split over two gloo ranks; the
gradient comes back in the logits' dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cross_entropy_worker import VOCAB, case
from trainer_fixtures import run_ranks

from hpc_mca.models.cross_entropy import vocab_parallel_cross_entropy

WORKER = Path(__file__).with_name("cross_entropy_worker.py")


def reference(logits: torch.Tensor, target: torch.Tensor,
              weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and logit gradient of the weighted sum, in fp64 on the full vocabulary
    (a target outside it contributes log-sum-exp alone, as Megatron's masked target does)."""
    full = logits.double().detach().requires_grad_(True)
    inside = (target >= 0) & (target < VOCAB)
    picked = full.gather(-1, torch.where(inside, target, 0).unsqueeze(-1)).squeeze(-1)
    loss = torch.logsumexp(full, -1) - torch.where(inside, picked, 0.0)
    (loss * weights.double()).sum().backward()
    return loss.detach(), full.grad


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_one_rank_equals_the_softmax_loss_and_gradient(device):
    logits, target, weights = case()
    mine = logits.to(device).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(mine, target.to(device), None)
    (loss * weights.to(device)).sum().backward()
    loss, grad = loss.cpu(), mine.grad.cpu()
    want_loss, want_grad = reference(logits, target, weights)
    assert torch.allclose(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
    assert torch.allclose(grad.double(), want_grad, rtol=1e-5, atol=1e-7)
    defined = target >= 0  # torch's own loss where it is defined
    torch_loss = F.cross_entropy(logits.flatten(0, 1), target.flatten().clamp(min=0),
                                 reduction="none").view_as(loss)
    assert torch.allclose(loss[defined], torch_loss[defined], rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_logits_get_a_bf16_gradient_within_its_rounding(device):
    logits, target, weights = case(torch.bfloat16)
    mine = logits.to(device).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(mine, target.to(device), None)
    (loss * weights.to(device)).sum().backward()
    loss, grad = loss.cpu(), mine.grad.cpu()
    want_loss, want_grad = reference(logits, target, weights)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert torch.allclose(loss.double(), want_loss, rtol=1e-6, atol=1e-5)
    assert torch.allclose(grad.double(), want_grad, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("ranks", [2, 4])
def test_vocabulary_split_over_ranks_equals_the_whole(tmp_path, ranks):
    proc = run_ranks(ranks, [str(WORKER), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    logits, target, weights = case()
    want_loss, want_grad = reference(logits, target, weights)
    saved = [torch.load(tmp_path / f"rank{r}.pt") for r in range(ranks)]
    for part in saved:  # every rank holds the whole loss
        assert torch.allclose(part["loss"].double(), want_loss, rtol=1e-6, atol=1e-6)
    grad = torch.cat([part["grad"] for part in saved], dim=-1)
    assert torch.allclose(grad.double(), want_grad, rtol=1e-5, atol=1e-7)


def test_micro_batches_of_other_token_counts_reuse_the_pieces():
    """Token counts change between micro-batches (padded rows): the pieces recompile once
    with a dynamic token dimension and stay exact."""
    logits, target, weights = case()
    for seq, batch in ((7, 3), (5, 2), (9, 1), (3, 3)):
        shape = (seq, batch)
        part = logits[:seq, :batch].contiguous() if seq <= 7 else torch.randn(seq, batch, VOCAB)
        tgt = target[:seq, :batch] if seq <= 7 else torch.randint(0, VOCAB, shape)
        w = torch.ones(shape)
        mine = part.clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(mine, tgt, None)
        (loss * w).sum().backward()
        want_loss, want_grad = reference(part, tgt, w)
        assert loss.shape == shape and mine.grad.shape == part.shape
        assert torch.allclose(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
        assert torch.allclose(mine.grad.double(), want_grad, rtol=1e-5, atol=1e-7)
