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
from dataclasses import replace
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
    8: "Qwen3-30B FP8: the pick (EP8 on NVLink, PP2, mbs2) is estimated 12% faster than EP16, "
       "whose FP8 estimate is itself 24% fast; the one published EP8 figure (26.02.01, 9058 "
       "tok/s/GPU) ran EP16 by its preset at Megatron-Bridge v0.3.1",
    10: "Llama2-13B FP8: the pick's PP2 VP4 DP8 estimated 6.0% faster than PP4 VP10 DP4, whose "
        "last stage runs the bf16 output layer (a plain ColumnParallelLinear outside TE's fp8) "
        "in twice as many micro-batches a step",
    27: "Llama3-70B FP8 on 2048 GPUs: TP4 PP4 VP4 DP128 estimated 7.1% faster than PP8 VP5 "
        "(half the micro-batches through the bf16 output layer on the last stage)",
    31: "Llama2-70B LoRA: PP4 without VP (as scripted) idles 3 of 32 micro-batch times, which "
        "the pick's VP4 cuts; NVIDIA's later Bridge recipe for the same job interleaves (VP20)",
    36: "Qwen3-235B FP8 at GBS 8192 (held back, round 4): as row 3",
    39: "Qwen3-235B BF16 DeepEP: the pick's EP16 spans 2 nodes, each token crossing to one other "
        "node instead of ~3 (HybridEP measured 1485 µs at EP16 against 3064 at EP32, arXiv "
        "2603.07685 table 7), with the run's own norm and MoE-activation recompute; no EP16 "
        "run is published to say whether it is faster",
    40: "Qwen3-235B BF16 DeepEP with A2A overlap: as row 39",
    41: "Qwen3-235B BF16 TP4 EP8, dropless: the team's own EP32 runs of the same job (rows 39, "
        "40, forced balance) measured 1.47× and 1.65× its throughput, so its layout is not "
        "their best; under dropless routing the pick (TP1 PP8 EP4, full recompute: 32 local "
        "experts a rank spread the load) is estimated 1.30× faster, and no dropless run of "
        "another layout is published to check it",
    **{i: f"Grok-1 {what} under NeMo 24.12 (round 5): published with ETP4 (that release's "
          f"default ETP = TP), whose dispatch all-gathers every received copy over the ETP "
          f"group; the pick, the same TP4 PP8 CP2 EP8 at ETP1 (VP 2-8), is estimated {gain} "
          f"faster. The team's next recipe (v25.05.02, rows 48 and 49) made the same move to "
          f"ETP1 and measured it {measured} faster at 512 GPUs; the planner picks that layout or "
          f"one estimated within 1% of it"
       for what, gain, measured, rows in (("BF16", "8.5%", "1.32×", (42, 44, 46)),
                                          ("FP8", "13-14%", "1.26×", (43, 45, 47)))
       for i in rows},
}
# Pairs of published runs of one job that the estimate orders against their measurement.
MISORDERED: dict[tuple[str, str], str] = {
}
# Row index -> why the estimate of the published layout is more than 25% off its measurement.
ESTIMATE_GAPS: dict[int, str] = {
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


def test_layouts_of_one_job_measured_10_percent_apart_are_ordered_as_measured(rows):
    """Where a team published two settings of one job (same model, GPUs, sequence, precision,
    batch) whose throughputs differ by more than 10%, the estimate puts them in the measured
    order: the zoo's EP32 runs above its two in-node EP8 runs (1.23-1.65×) and its A2A EP8
    above its TP4 EP8 (1.20×), NeMo 2's Grok-1 ETP1 above NeMo 24.12's ETP4 (1.32× BF16,
    1.26× FP8), and each EP-overlap A/B's overlapped run: 9 pairs. A pair it gets wrong
    goes in MISORDERED with the reason (none since dropless routing is modelled).
    Two runs that differ only in their software's release (NeMo 24.07's and v25.04's Llama3.1
    8B FP8, 1.14× apart) give the estimate nothing to order and are left out."""
    def settings(run):
        return replace(run, tokens_per_gpu=0, source="", held_back=False)

    pairs = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            same_job = (a.run.name, a.run.global_batch_size) == (b.run.name,
                                                                 b.run.global_batch_size)
            measured = b.run.tokens_per_gpu / a.run.tokens_per_gpu
            if same_job and settings(a.run) != settings(b.run) and abs(measured - 1) > 0.10:
                estimated = (b.published.tokens_per_second_per_gpu
                             / a.published.tokens_per_second_per_gpu)
                pairs.append((a.run.source, b.run.source, measured, estimated))
    assert len(pairs) >= 6
    for first, second, measured, estimated in pairs:
        agrees = (measured > 1) == (estimated > 1)
        # A known misorder must stay one (strict): if it is fixed, its entry must go.
        assert agrees != ((first, second) in MISORDERED), (first, second, measured, estimated)


def test_the_tables_summary_counts_what_the_rows_test(rows):
    """benchmarks/planner_layouts.py's closing counts are the rows' tests above: every row not
    in ESTIMATE_GAPS (RANKING_GAPS) passes its test, every row in it is a strict xfail."""
    estimate, ranking, jobs = table.summary(rows)
    assert estimate.endswith(f": {len(rows) - len(ESTIMATE_GAPS)} of {len(rows)} runs")
    assert ranking.endswith(f": {len(rows) - len(RANKING_GAPS)} of {len(rows)} runs")
    assert jobs.endswith(" jobs")


# --- DeepSeek-V3 (multi-latent attention, dense first layers, shared expert) ------------------
# The published DeepSeek-V3 (671B) training runs on a GPU the planner has a preset for (H100),
# each estimated as it ran. NVIDIA's Megatron-Bridge tables also give B200, GB200 and GB300
# runs (25.09 to 26.08 containers); no preset describes those GPUs, so they are left out.
DEEPSEEK_V3_CONFIG = dict(
    model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
    n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=18432,
    first_k_dense_replace=3, moe_layer_freq=1, vocab_size=129280, num_nextn_predict_layers=1,
    _name_or_path="DeepSeek-V3")

DEEPSEEK_V3_RUNS = [
    # [bridge] NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, 25.09 NeMo container,
    # DGX-H100 table (commit fa0315ae2, "update 25.09 performance summary"; since in
    # docs/performance-summary-archive.md): "DeepSeekV3 (dropless) | 1024 | 8192 | 1 | 4096 | 0 |
    # 2 | 8 | 1 | 4 | 64 | 128 | 1297 | 338 (330)": 1024 GPUs, GBS 8192, MBS 1, seq 4096, TP2 PP8
    # CP1 VP4 EP64, 1297 tokens/s/GPU (FP8 current scaling; the 330 TFLOP/s in parentheses is
    # DeepSeek's blockwise recipe). Settings from that commit's scripts/performance: run_script.py
    # (H100: DeepEP dispatcher with force-balanced routing, the 1F1B EP all-to-all overlap,
    # recompute_modules mla_up_proj and mlp, overlap_grad_reduce off, pipeline layout
    # "Et|(tt|)*30mL": one layer beside the embedding, 30 chunks of two, the MTP layer and loss
    # last) and configs/deepseek/deepseek_v3_llm_pretrain.yaml (ETP1, no CUDA graphs,
    # grad_reduce_in_fp32 false); no TP comm overlap (the recipe's CommOverlapConfig default).
    # Not modelled: the run's one MTP layer (the layout rules refuse MTP with an explicit
    # pipeline_layout), an MoE layer and an output-layer pass on the last chunk, ~2% of the
    # step's FLOPs. First estimated (this commit's model) at 1.05 of the measurement.
    dict(gpus=1024, seq_length=4096, global_batch_size=8192, precision="fp8",
         layout=dict(tp=2, pp=8, vp=4, ep=64, pipeline_layout=(1,) + (2,) * 30 + (0,)),
         recompute="selective:mla_up_proj,mlp", tokens_per_gpu=1297,
         source="[bridge] 25.09 DGX-H100 DeepSeekV3 (dropless, force-balanced) FP8-CS"),
]


def _deepseek_v3_plan(run: dict):
    from hpc_mca.topology import Layout, plan

    return plan(model=DEEPSEEK_V3_CONFIG, nodes=run["gpus"] // 8, seq_length=run["seq_length"],
                global_batch_size=run["global_batch_size"], precision=run["precision"],
                layout=Layout(**run["layout"]), micro_batch_size=1, recompute=run["recompute"],
                overlap_grad_reduce=False, overlap_param_gather=False,
                grad_reduce_in_fp32=False, overlap_p2p_comm=True, te_layers=True,
                moe_comm_overlap=True, moe_dispatcher="flex", moe_routing="balanced")


@pytest.mark.parametrize("run", DEEPSEEK_V3_RUNS, ids=lambda r: r["source"].split("]")[0][1:])
def test_deepseek_v3_estimate_is_within_25_percent_of_the_published_throughput(run):
    published = _deepseek_v3_plan(run)  # fits H100 memory as published (else LayoutError)
    ratio = published.tokens_per_second_per_gpu / run["tokens_per_gpu"]
    assert 0.75 <= ratio <= 1.25, (run["source"], ratio)
