"""Dropless MoE routing in the step-time estimate (topology/routing.py): the busiest
expert-parallel rank's excess, fitted to NVIDIA's matched pairs and counted by hand."""

from __future__ import annotations

import pytest
from test_planner_calibration import table
from test_topology_planner import QWEN3_30B_A3B

from hpc_mca.topology import Layout, LayoutError, plan
from hpc_mca.topology.memory import Workload
from hpc_mca.topology.routing import EXPERT_LOAD_CV, moe_load_imbalance

QWEN3_235B = table.QWEN3_235B_A22B  # benchmarks/planner_layouts.py's shapes
QWEN3_30B = QWEN3_30B_A3B

# The Megatron MoE model zoo's long-context Qwen3-235B runs (32 H100 nodes, TP4 EP8 PP8 VP4,
# DeepEP, BF16, global batch 256): sequence, CP, TFLOP/s a GPU with forced balance, dropless.
ZOO_PAIRS = [(16384, 1, 295, 237), (32768, 2, 335, 277), (65536, 4, 368, 320),
             (131072, 8, 389, 357)]


def _zoo_step(seq: int, cp: int, routing: str) -> float:
    return plan(model=QWEN3_235B, nodes=32, seq_length=seq, global_batch_size=256,
                layout=Layout(tp=4, pp=8, vp=4, ep=8, cp=cp), micro_batch_size=1,
                recompute="none", gpu_memory_gib=1000, cp_comm_type="p2p",
                overlap_param_gather=True, grad_reduce_in_fp32=False, overlap_p2p_comm=True,
                moe_dispatcher="flex", moe_routing=routing).step_time.total


@pytest.mark.parametrize("seq,cp,balanced,dropless", ZOO_PAIRS)
def test_dropless_over_balanced_matches_the_zoos_measured_pairs(seq, cp, balanced, dropless):
    """One constant reproduces all four measured slow-downs (1.09-1.25x, falling as attention
    takes more of a longer sequence's step) within 2%."""
    estimated = _zoo_step(seq, cp, "dropless") / _zoo_step(seq, cp, "balanced")
    assert estimated == pytest.approx(balanced / dropless, rel=0.02)


def test_the_busiest_ranks_excess_by_hand():
    """EP8 over 128 experts: 16 a rank, spread 2.4/4 around the mean, the busiest of 8 at the
    expected largest of 8 normal draws (1.4236 standard deviations, tabulated; Blom's
    approximation within 1%); EP32 (4 a rank) at 2.0697 of a spread twice as wide."""
    work = Workload(seq_length=4096, moe_routing="dropless")
    assert moe_load_imbalance(QWEN3_235B, Layout(ep=8), work) == pytest.approx(
        1 + EXPERT_LOAD_CV / 4 * 1.4236, rel=0.01)
    assert moe_load_imbalance(QWEN3_235B, Layout(ep=32), work) == pytest.approx(
        1 + EXPERT_LOAD_CV / 2 * 2.0697, rel=0.01)
    assert moe_load_imbalance(QWEN3_235B, Layout(ep=8), Workload(seq_length=4096)) == 1.0
    assert moe_load_imbalance(QWEN3_235B, Layout(ep=1), work) == 1.0  # every expert on a rank


def test_dropless_slows_the_routed_experts_and_their_dispatch_only():
    """The excess multiplies the busiest rank's routed-expert GEMM FLOPs and its all-to-all
    copies; attention, dense GEMMs and the per-expert kernel costs stay as they are."""
    kw = dict(model=QWEN3_30B, nodes=2, seq_length=4096, global_batch_size=64,
              layout=Layout(ep=16), micro_batch_size=1, recompute="none")
    balanced = plan(**kw, moe_routing="balanced").step_time
    dropless = plan(**kw, moe_routing="dropless").step_time
    factor = moe_load_imbalance(QWEN3_30B, Layout(ep=16),
                                Workload(seq_length=4096, moe_routing="dropless"))
    from hpc_mca.topology.network import MOE_SYNC_STALL_S
    stalls = 4 * 2 * QWEN3_30B.num_layers * MOE_SYNC_STALL_S  # 4 micro-batches, 2 passes each
    assert dropless.expert_parallel - stalls == pytest.approx(
        factor * (balanced.expert_parallel - stalls), rel=1e-9)
    assert balanced.compute < dropless.compute < factor * balanced.compute
    assert dropless.tensor_parallel == balanced.tensor_parallel


def test_hpc_mcas_own_plans_take_routing_as_balanced():
    """The planner's default: dropless is counted only when asked (see PlanRequest)."""
    kw = dict(model=QWEN3_30B, nodes=2, seq_length=4096, global_batch_size=64)
    assert plan(**kw).step_time == plan(**kw, moe_routing="balanced").step_time


def test_an_unknown_routing_is_one_line():
    with pytest.raises(LayoutError) as err:
        plan(model=QWEN3_30B, nodes=2, seq_length=4096, global_batch_size=64,
             moe_routing="capacity")
    assert str(err.value) == "moe_routing='capacity' is not valid; valid: dropless, balanced"


def test_an_moe_plan_says_what_dropless_routing_would_add():
    """The plan table keeps balanced routing but prints the dropless estimate of the same
    layout beside it (the number plan() gives when asked for dropless); dense plans and EP1
    plans have no such line."""
    from hpc_mca.topology.report import format_plan_table
    kw = dict(model=QWEN3_30B, nodes=2, seq_length=4096, global_batch_size=64,
              layout=Layout(ep=16), micro_batch_size=1, recompute="none")
    balanced, dropless = plan(**kw), plan(**kw, moe_routing="dropless")
    line = next(row for row in format_plan_table(balanced).splitlines()
                if row.strip().startswith("routing"))
    change = dropless.step_time.total / balanced.step_time.total - 1
    assert f"~{dropless.step_time.total:.3g} s ({change:+.0%})" in line
    assert change > 0.05
    ep1 = plan(**{**kw, "layout": Layout(pp=2), "gpu_memory_gib": 1000})
    assert "routing" not in format_plan_table(ep1)
