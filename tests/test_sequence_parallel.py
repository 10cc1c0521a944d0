"""Ulysses sequence parallelism for transformers models: the slicing and gathering utilities on
uneven lengths, the packed attention implementation against documents run alone, and SP2/SP4
on gloo ranks against one process (logits, loss, parameter gradients)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sequence_parallel_worker import LENGTHS, loss_sum, sp_case
from trainer_fixtures import run_ranks

from hpc_mca.models.hf_attention import document_bounds
from hpc_mca.runtime.sequence_parallel import IGNORE_INDEX, slice_and_pad

WORKER = Path(__file__).with_name("sequence_parallel_worker.py")


@pytest.mark.parametrize("seq,size", [(11, 4), (12, 4), (7, 2), (5, 8)])
def test_slices_cover_the_padded_row_in_rank_order(seq, size):
    ids = torch.arange(100, 100 + seq)[None]
    pos = torch.arange(seq)[None]
    labels = ids + 1000
    parts = [slice_and_pad(ids, pos, labels, rank=r, size=size, pad_token_id=7)
             for r in range(size)]
    pad = -seq % size
    assert {p.pad for p in parts} == {pad}
    assert all(p.input_ids.shape == (1, (seq + pad) // size) for p in parts)
    ids_back = torch.cat([p.input_ids for p in parts], dim=1)
    pos_back = torch.cat([p.position_ids for p in parts], dim=1)
    lab_back = torch.cat([p.labels for p in parts], dim=1)
    assert torch.equal(ids_back[:, :seq], ids) and (ids_back[0, seq:] == 7).all()
    assert torch.equal(lab_back[:, :seq], labels) and (lab_back[0, seq:] == IGNORE_INDEX).all()
    # The padding is a document of its own: positions restart at 0.
    assert torch.equal(pos_back[0, seq:], torch.arange(pad))


def test_slicing_refuses_what_is_not_one_packed_row():
    with pytest.raises(ValueError, match=r"one packed row \[1, seq\], got \(2, 4\)"):
        slice_and_pad(torch.zeros(2, 4), torch.zeros(2, 4), rank=0, size=2)
    with pytest.raises(ValueError, match="position_ids"):
        slice_and_pad(torch.zeros(1, 4), torch.zeros(1, 5), rank=0, size=2)


def test_documents_are_where_positions_restart():
    positions = torch.tensor([0, 1, 2, 0, 0, 1, 5, 6, 0])
    assert document_bounds(positions).tolist() == [0, 3, 4, 6, 8, 9]


def test_packed_row_equals_each_document_alone():
    """One packed row through hpc_mca_packed = every document through transformers' sdpa."""
    case = sp_case()
    model = case["model"]
    packed = model(input_ids=case["input_ids"], position_ids=case["position_ids"]).logits[0]
    model.config._attn_implementation = "sdpa"
    start = 0
    for n in LENGTHS:
        alone = model(input_ids=case["input_ids"][:, start:start + n]).logits[0]
        torch.testing.assert_close(packed[start:start + n], alone, atol=1e-5, rtol=0)
        start += n


@pytest.fixture(scope="module")
def one_process():
    case = sp_case()
    logits = case["model"](input_ids=case["input_ids"], position_ids=case["position_ids"]).logits
    total, count = loss_sum(logits, case["labels"])
    (total / count).backward()
    return {"logits": logits.detach(), "loss": total.detach() / count,
            "grads": {n: p.grad for n, p in case["model"].named_parameters()}}


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_equals_one_process(tmp_path, one_process, sp):
    proc = run_ranks(sp, [WORKER, sp, tmp_path], timeout=300, launcher=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(sp):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["pad"] == -sum(LENGTHS) % sp
        torch.testing.assert_close(got["logits"], one_process["logits"], atol=1e-5, rtol=0)
        assert abs(float(got["loss"]) - float(one_process["loss"])) < 1e-6
        for name, grad in one_process["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
