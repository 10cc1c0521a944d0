"""Selective recompute of named layer parts in the planner (``selective:A,B``, Megatron-Core's
recompute_modules): what each part frees and costs, counted by hand, and the plan's way to the
trainer's config and back."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_topology_planner import LLAMA3_8B, QWEN3_30B_A3B

from hpc_mca.config.loading import load_config
from hpc_mca.slurm.jobplan import PlanOptions, make_job_plan
from hpc_mca.topology import Layout, Workload, get_gpu
from hpc_mca.topology import network as net_model
from hpc_mca.topology.cost import _mlp_gemm_seconds, estimate_step_time
from hpc_mca.topology.memory import discarded_bytes_per_token, estimate_memory, microbatch_tokens
from hpc_mca.topology.network import Network

H100 = get_gpu("H100-80GB")
H, FFN = LLAMA3_8B.hidden_size, LLAMA3_8B.ffn_hidden_size


def _work(recompute: str, **kw) -> Workload:
    return Workload(seq_length=4096, num_microbatches=8, recompute=recompute, **kw)


def test_what_each_part_frees_by_hand():
    """Per token and layer, before the TP split, 2 B an element: layernorm both norms' outputs
    (h each; under Transformer Engine a dense layer has no norm of its own), mlp the fc1
    (gate and up) and activation outputs (3·ffn); moe everything the layer keeps but its input;
    and the activation memory falls by exactly that."""
    layout = Layout().resolved(8)
    assert discarded_bytes_per_token(LLAMA3_8B, _work("selective:layernorm"), layout) == 4 * H
    assert discarded_bytes_per_token(LLAMA3_8B, _work("selective:layernorm,mlp"), layout) == \
        4 * H + 2 * 3 * FFN
    assert discarded_bytes_per_token(LLAMA3_8B, _work("selective:layernorm,mlp", te_layers=True),
                                     layout) == 2 * 3 * FFN
    assert discarded_bytes_per_token(LLAMA3_8B, _work("selective"), layout) == 0  # core_attn
    moe = QWEN3_30B_A3B
    k, fe, e = moe.moe_router_topk, moe.expert_ffn_hidden_size, moe.num_experts
    assert discarded_bytes_per_token(moe, _work("selective:moe"), Layout(ep=8).resolved(8)) == \
        2 * k * (moe.hidden_size + 3 * fe) + 4 * e
    none, parts = (estimate_memory(LLAMA3_8B, layout, _work(r)).activations
                   for r in ("none", "selective:layernorm,mlp"))
    tokens = microbatch_tokens(_work("none"), layout)
    # PP1: one micro-batch in flight, every layer's activations.
    assert none - parts == pytest.approx(tokens * (4 * H + 6 * FFN) * LLAMA3_8B.num_layers,
                                         rel=1e-9)


def test_what_each_part_costs_by_hand():
    """The MLP's forward GEMMs and the two norms' traffic run again once a layer, nothing else
    of the compute; under TP2 the recomputed MLP gathers and scatters again (half a pass of the
    layer's four TP collectives: 2.5 passes a micro-batch instead of 2)."""
    layout, layers = Layout(tp=2).resolved(8), LLAMA3_8B.num_layers
    base = estimate_step_time(LLAMA3_8B, layout, _work("none"), H100, 8)
    parts = estimate_step_time(LLAMA3_8B, layout, _work("selective:layernorm,mlp"), H100, 8)
    tokens = microbatch_tokens(_work("none"), layout)
    norms = 2 * 2 * 2 * tokens * H / 2 / (H100.memory_gbps * 1e9)
    mlp = _mlp_gemm_seconds(LLAMA3_8B, layout, _work("none"), H100, tokens)
    assert parts.recomputation == pytest.approx(8 * layers * (mlp + norms), rel=1e-9)
    assert parts.compute == base.compute
    assert parts.tensor_parallel == pytest.approx(base.tensor_parallel * 2.5 / 2, rel=1e-9)


def test_a_recomputed_moe_layer_dispatches_again():
    """moe recomputes the router, the experts and their all-to-alls: three passes of dispatch
    and combine a micro-batch instead of two."""
    layout, net = Layout(ep=8).resolved(16), Network(H100, 8)
    passes = {r: net_model.expert_parallel(QWEN3_30B_A3B, layout, _work(r), net, 1, 0.0)
              for r in ("none", "selective:layernorm,moe")}
    assert passes["selective:layernorm,moe"] == pytest.approx(1.5 * passes["none"], rel=1e-9)


def test_a_plans_parts_reach_the_trainer_and_a_configs_parts_are_planned(tmp_path):
    """``--recompute selective:layernorm,mlp`` becomes the trainer's recompute_granularity and
    recompute_modules, which the config rules accept; a config's own recompute_modules is
    planned as those parts (Megatron's default, core_attn, as plain selective)."""
    model = tmp_path / "llama3-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256}))
    (tmp_path / "d.jsonl").write_text('{"instruction": "1+1=", "output": "2"}\n')
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  model_name_or_path: {model}\ndata:\n  dataset: d.jsonl\n"
                      "  cutoff_len: 4096\ntraining:\n  bf16: true\n  global_batch_size: 64\n")
    job = make_job_plan(PlanOptions(nodes=2, recompute="selective:layernorm,mlp"), config)
    chosen = dict(item.split("=", 1) for item in job.plan_overrides)
    assert (chosen["recompute_granularity"], chosen["recompute_modules"]) == \
        ("selective", "[layernorm,mlp]")
    par = load_config(config, [*job.plan_overrides, f"output_dir={tmp_path / 'run'}"]
                      ).resolve(16).parallel
    assert (par.recompute_granularity, par.recompute_modules) == ("selective", ["layernorm", "mlp"])
    plain = make_job_plan(PlanOptions(nodes=2, recompute="none"), config)
    assert "recompute_modules" not in dict(i.split("=", 1) for i in plain.plan_overrides)
    for parts, planned in (("[mlp, layernorm]", "selective:mlp,layernorm"),
                           ("[core_attn]", "selective")):
        own = config.read_text() + ("parallel:\n  recompute_granularity: selective\n"
                                    f"  recompute_modules: {parts}\n")
        (tmp_path / "own.yaml").write_text(own)
        assert make_job_plan(PlanOptions(nodes=2), tmp_path / "own.yaml").plan.recompute == planned


def test_transformer_engine_layers_offer_their_own_parts():
    """Estimates of other trainers' runs (``te_layers``) may name moe_act (grouped-GEMM experts),
    which frees the experts' activation output; hpc-mca's own plans may not."""
    from hpc_mca.topology import LayoutError, plan

    job = dict(model=QWEN3_30B_A3B, nodes=2, seq_length=4096, global_batch_size=64,
               layout=Layout(ep=8), micro_batch_size=1, gpu_memory_gib=1000)
    te = plan(**job, te_layers=True, recompute="selective:layernorm,moe_act")
    k, fe = QWEN3_30B_A3B.moe_router_topk, QWEN3_30B_A3B.expert_ffn_hidden_size
    work = replace(_work("selective:moe_act"), te_layers=True)
    assert discarded_bytes_per_token(QWEN3_30B_A3B, work, te.layout) == 2 * k * fe
    assert te.step_time.recomputation > 0
    with pytest.raises(LayoutError, match="recompute='selective:layernorm,moe_act' names"):
        plan(**job, recompute="selective:layernorm,moe_act")
