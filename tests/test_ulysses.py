"""The Ulysses all-to-all both backends share (hpc_mca/runtime/ulysses.py) on real gloo ranks:
pieces and their order forward, the round trip, where the backward pass puts each gradient
element, and the refusal of heads the group does not divide (tests/ulysses_worker.py checks
each with exact equality on every rank)."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_fixtures import run_ranks

WORKER = Path(__file__).with_name("ulysses_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_all_to_all_moves_every_element_to_its_place(tmp_path, size):
    proc = run_ranks(size, [WORKER, tmp_path], timeout=300, launcher=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.glob("rank*.ok")) == [f"rank{r}.ok"
                                                                 for r in range(size)]
