"""The preference losses on hand-computed values (TRL's parity test covers sigmoid, ipo and
hinge on a model; label smoothing and pref_ftx are checked here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hpc_mca.loop.preference import METRICS, preference_loss

# One pair: policy log-probs chosen -10, rejected -12; reference -11 for both; answers of 2 and
# 4 tokens; beta 0.5. Log-ratios +1 and -1, so beta·d = 1.
POLICY, REFERENCE, LENGTHS = torch.tensor([-10.0, -12.0]), torch.tensor([-11.0, -11.0]), \
    torch.tensor([2.0, 4.0])


def _ft(**fields):
    return SimpleNamespace(**{"pref_beta": 0.5, "pref_loss": "sigmoid", "dpo_label_smoothing": 0.0,
                              "pref_ftx": 0.0, **fields})


@pytest.mark.parametrize("fields, want", [
    ({}, 0.3132617),                                   # -log σ(1)
    ({"dpo_label_smoothing": 0.2}, 0.5132617),         # 0.8·0.3132617 + 0.2·1.3132617
    ({"pref_loss": "hinge"}, 0.0),                     # relu(1 - 1)
    ({"pref_loss": "ipo"}, 0.0625),                    # (1/2 + 1/4 - 1/(2·0.5))²
    ({"pref_ftx": 0.3}, 0.3132617 + 1.5),              # + 0.3 · (10 / 2 tokens)
])
def test_preference_losses_by_hand(fields, want):
    losses, _ = preference_loss(POLICY, REFERENCE, LENGTHS, _ft(**fields))
    assert losses.tolist() == pytest.approx([want], abs=1e-6)


def test_metrics_are_trl_s():
    _, sums = preference_loss(POLICY.repeat(2), REFERENCE.repeat(2), LENGTHS.repeat(2), _ft())
    got = dict(zip(METRICS, (sums / 2).tolist()))  # two identical pairs: sums over 2
    assert got == pytest.approx({"rewards/chosen": 0.5, "rewards/rejected": -0.5,
                                 "rewards/accuracies": 1.0, "rewards/margins": 1.0,
                                 "logps/chosen": -10.0, "logps/rejected": -12.0})
