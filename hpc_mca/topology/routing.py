"""How evenly a dropless MoE layer's tokens spread over its expert-parallel ranks: each layer
waits on its busiest rank, in the expert GEMMs (cost.py) and the all-to-alls (network.py).
Memory counts the mean load (memory.Workload.moe_routing)."""

from __future__ import annotations

from functools import lru_cache
from math import sqrt
from statistics import NormalDist

from .layout import Layout
from .memory import Workload
from .model import ModelShape

# Coefficient of variation of the experts' token shares under dropless routing: the spread
# that sets how far the busiest expert-parallel rank's load exceeds the mean. Fitted to the one
# published set of matched pairs, NVIDIA's Megatron-Core MoE team's Qwen3-235B-A22B runs on 256
# H100s at TP4 EP8 PP8 VP4 (yanring/Megatron-MoE-ModelZoo, best_practice/qwen3/readme.md at
# 020b8136, "Long Context"): forced balance against dropless, 295/237, 335/277, 368/320 and
# 389/357 TFLOP/s at 16k to 128k tokens (see tests/test_moe_routing.py for the fit).
EXPERT_LOAD_CV = 2.4


def moe_load_imbalance(model: ModelShape, layout: Layout, work: Workload) -> float:
    """The busiest expert-parallel rank's tokens over the mean rank's (1.0: balanced).

    Dropless routing gives each expert its router's share of the tokens; a rank holds E/EP
    experts, so its load spreads EXPERT_LOAD_CV/sqrt(E/EP) around the mean, and the busiest of
    EP ranks sits at the expected maximum of EP normal draws (Blom's approximation) above it.
    Every rank of the layer waits for that one at the combine. At EP1 a rank holds every
    expert: no imbalance between ranks."""
    ep = layout.ep
    if not model.is_moe or ep == 1 or work.moe_routing == "balanced":
        return 1.0
    return 1.0 + EXPERT_LOAD_CV / sqrt(model.num_experts / ep) * _expected_max(ep)


@lru_cache(maxsize=None)
def _expected_max(n: int) -> float:
    """The expected largest of n standard normal draws, by Blom's approximation (1.434 for 8,
    2.067 for 32; tabulated 1.424 and 2.070)."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))
