"""The MTP roll of packed streams (hpc_mca/models/roll.py) on 1, 2 and 4 gloo ranks equals the
per-document loop over the whole stream, with padding, one-token and no-label documents, and
equals Megatron-Core's own per-document roll where that one is correct (no padding)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from roll_worker import roll_cases
from trainer_fixtures import run_ranks

from hpc_mca.models.roll import roll_left, roll_plan

WORKER = Path(__file__).with_name("roll_worker.py")


def reference_roll(values: torch.Tensor, cu_seqlens: torch.Tensor,
                   cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """The obvious loop: within each document, slot p takes slot p+1; the last real token and
    the padding take 0."""
    out = torch.zeros_like(values)
    for d in range(cu_seqlens.numel() - 1):
        start, length = int(cu_seqlens_padded[d]), int(cu_seqlens[d + 1] - cu_seqlens[d])
        out[..., start:start + length - 1] = values[..., start + 1:start + length]
    return out


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_roll_on_cp_ranks_equals_the_per_document_loop(tmp_path, cp):
    proc = run_ranks(cp, [WORKER, tmp_path], timeout=300, launcher=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(cp)]
    for number, case in enumerate(roll_cases(cp)):
        want = reference_roll(case["values"], case["cu_seqlens"], case["cu_seqlens_padded"])
        covered = torch.zeros(want.size(-1), dtype=torch.bool)
        for rank in ranks:
            got = rank[number]
            covered[got["slots"]] = True
            assert torch.equal(got["ours"], want[:, got["slots"]]), (cp, number)
            assert int(got["sum"]) == int(want[:, got["slots"]].sum())
            if not case["padded"]:
                assert torch.equal(got["upstream"], got["ours"]), (cp, number)
        assert covered.all()


def test_upstream_roll_is_wrong_with_padded_documents():
    """Why upstream's roll is not used: it splits the stream by real lengths, so with padding
    the second document onwards is shifted across the wrong boundaries."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.multi_token_prediction import _roll_tensor_packed_seq

    cu, cu_pad = torch.tensor([0, 3, 6]), torch.tensor([0, 4, 8])
    values = torch.tensor([[1, 2, 3, 0, 4, 5, 6, 0]])
    ours, total = roll_left(values, roll_plan(cu, cu_pad))
    assert ours.tolist() == [[2, 3, 0, 0, 5, 6, 0, 0]] and int(total) == 16
    upstream = _roll_tensor_packed_seq(values, -1, -1, PackedSeqParams(cu_seqlens_q=cu))[0]
    assert upstream.tolist() != ours.tolist()


def test_plan_must_cover_the_stream():
    plan = roll_plan(torch.tensor([0, 3]), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="holds 5 slots but the roll plan describes 4"):
        roll_left(torch.zeros(1, 5), plan)
