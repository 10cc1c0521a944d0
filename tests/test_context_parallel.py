"""Context-parallel packed attention (all-gather and Ulysses all-to-all) on real gloo ranks
equals the single-process packed attention over the whole stream: outputs and Q/K/V
gradients, for documents of odd lengths including ones shorter than 2·CP before padding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cp_attention_worker import cp_case
from trainer_fixtures import run_ranks

from hpc_mca.models.context_parallel import cp_comm_violations
from hpc_mca.models.packed_attention import packed_attention, packed_layout

WORKER = Path(__file__).with_name("cp_attention_worker.py")


def _reference(cp: int) -> dict[str, torch.Tensor]:
    case = cp_case(cp)
    q, k, v = (case[name].clone().requires_grad_() for name in ("query", "key", "value"))
    layout = packed_layout(case["cu_seqlens"], case["cu_seqlens_padded"])
    out = packed_attention(q, k, v, layout, layout, segment_tokens=64)
    (out * case["weight"]).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("comm_type", ["all_gather", "a2a"])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_matches_one_process(tmp_path, comm_type, cp):
    proc = run_ranks(cp, [WORKER, comm_type, tmp_path], timeout=300, launcher=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = _reference(cp)
    seen = torch.zeros(want["out"].size(0), dtype=torch.bool)
    for rank in range(cp):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        slots = got["slots"]
        seen[slots] = True
        for name in ("out", "dq", "dk", "dv"):
            diff = (got[name] - want[name][slots]).abs().max().item()
            assert diff < 1e-10, (comm_type, cp, rank, name, diff)
    assert seen.all()  # the ranks' slots cover the stream exactly


def test_a2a_needs_cp_to_divide_the_key_value_heads():
    assert cp_comm_violations("a2a", 2, 8) == []
    assert cp_comm_violations("all_gather", 3, 8) == []
    [line] = cp_comm_violations("a2a", 3, 8)
    assert line == ("cp_comm_type='a2a' needs context_parallel_size=3 to divide the 8 "
                    "key/value heads; valid: context_parallel_size in 1, 2, 4, 8, or "
                    "cp_comm_type='all_gather'")
    [line] = cp_comm_violations("p2p", 2, 8)
    assert line == "cp_comm_type='p2p' is not valid; valid: all_gather, a2a"
