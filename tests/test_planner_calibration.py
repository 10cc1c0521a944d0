"""The step-time estimate against published H100 runs (benchmarks/planner_layouts.py): issue
#43's acceptance, row by row.

For every run of the calibration table: our estimate of the published layout, under the run's
own settings, within ±25% of its measured throughput; and the published layout within 5% of
the planner's best estimate for the same job, or picked. The rows where the planner still
disagrees are strict xfails with the reason in numbers: if a change of the model closes one,
its xfail fails and the table's note must change with it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "planner_layouts.py"
_SPEC = importlib.util.spec_from_file_location("planner_layouts", _PATH)
table = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("planner_layouts", table)  # dataclasses look their module up there
_SPEC.loader.exec_module(table)

# Row index -> why the planner's pick is more than 5% faster than the published layout.
RANKING_GAPS = {
    3: "Qwen3-235B FP8: the pick keeps EP8 inside a node; the published EP32's all-to-all "
       "dispatcher pays ~13 s of a 22 s step across nodes (Megatron-Bridge's own parallelism "
       "guide recommends EP8; the measured TP4 EP8 run of row 41 is slower than EP32)",
    8: "Qwen3-30B FP8: the pick (EP8 on NVLink, PP2, mbs2) is estimated 14% faster than EP16, "
       "whose FP8 estimate is itself 25% fast (below); the one published EP8 figure (26.02.01, "
       "9058 tok/s/GPU) ran EP16 by its preset at Megatron-Bridge v0.3.1",
    17: "GPT3-20B: the pick's TP1 PP2 VP11 estimated 5.3% faster than TP2 DP32 (its TP "
        "overlap counted)",
    27: "Llama3-70B FP8 on 2048 GPUs: TP4 PP4 VP4 DP128 estimated 5.0% faster than PP8 VP5",
    31: "Llama2-70B LoRA: PP4 without VP (as scripted) idles 3 of 32 micro-batch times, which "
        "the pick's VP4 cuts; NVIDIA's later Bridge recipe for the same job interleaves (VP20)",
    36: "Qwen3-235B FP8 at GBS 8192 (held back, round 4): as row 3",
    39: "Qwen3-235B BF16 DeepEP: the pick's EP16 spans 2 nodes, each token crossing to one other "
        "node instead of ~3 (HybridEP measured 1485 µs at EP16 against 3064 at EP32, arXiv "
        "2603.07685 table 7); no EP16 run is published to say whether it is faster",
    40: "Qwen3-235B BF16 DeepEP with A2A overlap: as row 39",
    41: "Qwen3-235B BF16 TP4 EP8: estimated 39% faster than measured (below), so ranked too well",
}
# Row index -> why the estimate of the published layout is more than 25% off its measurement.
ESTIMATE_GAPS = {
    8: "Qwen3-30B FP8 estimated 1.25× its measurement: NVIDIA measured this FP8 run 16% slower "
       "than the BF16 one of row 37 (8960 against 10608 tok/s/GPU), which no cost here "
       "reproduces: FP8 is estimated 10% faster than BF16 on this layout",
    41: "Qwen3-235B BF16 TP4 EP8 VP4 estimated 1.39× its measurement (21.5 s against 29.0 s): "
        "some cost of 16 local experts at TP4 is missing",
    **{i: "Grok-1 FP8 under NeMo 24.12 (held back, round 5) estimated ~1.38× its measurement: "
          "that software ran FP8 only 1.24× its BF16 (25% of the FP8 peak), the estimate 1.41×; "
          "the same layout under NeMo 2 (rows 48, 49) is within (0.91 BF16, 1.08 FP8)"
       for i in (43, 45, 47)},
}


def _ids() -> list[str]:
    return [f"{i:02d}-{run.name.replace(' ', '_')}" for i, run in enumerate(table.RUNS)]


@pytest.fixture(scope="module")
def rows():
    return [table.measure(run) for run in table.RUNS]


def test_the_table_holds_runs_back_and_names_their_sources():
    held = [run for run in table.RUNS if run.held_back]
    assert len(held) >= 3
    assert all(run.source.startswith(("[dgxc]", "[bridge]", "[nemo]", "[mz]"))
               for run in table.RUNS)
    assert set(RANKING_GAPS) | set(ESTIMATE_GAPS) <= set(range(len(table.RUNS)))


@pytest.mark.parametrize("index", range(len(table.RUNS)), ids=_ids())
def test_estimate_is_within_25_percent_of_the_published_throughput(rows, request, index):
    if index in ESTIMATE_GAPS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=ESTIMATE_GAPS[index]))
    row = rows[index]
    assert 0.75 <= row.estimate_ratio <= 1.25, (row.run.name, row.estimate_ratio)
    assert row.fits, f"{row.run.name}: ran without recompute, but our memory model says it cannot"


@pytest.mark.parametrize("index", range(len(table.RUNS)), ids=_ids())
def test_published_layout_is_within_5_percent_of_the_pick(rows, request, index):
    if index in RANKING_GAPS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=RANKING_GAPS[index]))
    row = rows[index]
    assert row.pick.layout == row.published.layout or abs(row.pick_ratio - 1) <= 0.05, \
        (row.run.name, row.pick.describe(), row.pick_ratio)
