"""parallel.recompute_modules (Megatron-Core's selective recompute of named layer parts): each
named part runs forward again in backward, nothing else does, and the loss and gradient-norm
curve is the run without recompute's, on one rank and under expert parallelism over gloo.

A 2-layer Llama, a 2-layer Qwen3-MoE and a DeepSeek-V3 (MLA, a dense and an MoE layer), 3
steps of 8 samples; forward calls are counted by tests/probe_worker.py's pre-hooks (a
recompute calls a part again).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_fixtures import (
    make_family_dir,
    make_model_dir,
    make_sft_data,
    probe_run,
    run_ranks,
    same_curve,
    steps,
    write_config,
)

from hpc_mca.config.loading import load_config
from hpc_mca.config.sections import ConfigError
from hpc_mca.topology import Layout, ModelShape, Workload
from hpc_mca.topology.memory import discarded_bytes_per_token

SELECTIVE = "recompute_granularity=selective"


def _job(root, moe: bool):
    model = make_model_dir(root, layers=2, moe=moe)
    return write_config(root, model, make_sft_data(root, 64, 1, "train"),
                        training={"max_steps": 3, "logging_steps": 1})


def _twice(reference: dict, probe: dict, parts: set[str]) -> None:
    """The counted parts named in ``parts`` ran twice as often as in the reference; every
    other counted part (and each decoder layer) as often."""
    for key, count in reference["calls"].items():
        times = 2 if key.rsplit(".", 1)[-1] in parts else 1
        assert probe["calls"][key] == times * count, (key, probe["calls"], reference["calls"])


@pytest.mark.slow
def test_norms_and_mlp_recomputed_on_a_dense_model_train_the_same_curve(tmp_path):
    """[layernorm, mlp]: both norms (Megatron's output-discarding checkpoint, which needs the
    checkpoint_te compat patch without Transformer Engine) and the MLP run twice per
    micro-batch, attention once; the curve of the run without recompute within 1e-6, on one
    rank and under TP2 with sequence parallelism (each rank discards its share of the norms'
    outputs; the recomputed MLP gathers its input again)."""
    config = _job(tmp_path, moe=False)
    reference = probe_run(config, tmp_path / "none", 1)[0]
    parts = (SELECTIVE, "recompute_modules=[layernorm,mlp]")
    for name, nproc, layout in (("parts", 1, ()),
                                ("parts_tp2", 2, ("tensor_model_parallel_size=2",
                                                  "sequence_parallel=true"))):
        for probe in probe_run(config, tmp_path / name, nproc, *parts, *layout):
            _twice(reference, probe, {"input_layernorm", "pre_mlp_layernorm", "mlp"})
        same_curve(steps(tmp_path / name), steps(tmp_path / "none"), 1e-6, name)


@pytest.mark.slow
def test_the_moe_layer_recomputed_under_expert_parallelism_trains_the_same_curve(tmp_path):
    """[moe, layernorm] on 2 ranks (EP2, DP2): the MoE layer's router (and with it the token
    all-to-all and the experts) and both norms run twice per micro-batch; the curve of one
    process without recompute within 1e-5."""
    config = _job(tmp_path, moe=True)
    reference = probe_run(config, tmp_path / "one", 1)[0]
    ranks = probe_run(config, tmp_path / "ep2", 2, "expert_model_parallel_size=2", SELECTIVE,
                      "recompute_modules=[moe,layernorm]")
    same_curve(steps(tmp_path / "ep2"), steps(tmp_path / "one"), 1e-5, "ep2 moe+layernorm")
    half = {"calls": {k: v // 2 for k, v in reference["calls"].items()}}  # DP2: half the batches
    for rank in ranks:
        _twice(half, rank, {"input_layernorm", "pre_mlp_layernorm", "router"})


@pytest.mark.slow
def test_mla_up_projections_and_dense_layer_mlp_recomputed_train_the_same_curve(tmp_path):
    """DeepSeek-V3 (multi-latent attention, layer 0 dense, layer 1 MoE) with [mla_up_proj,
    mlp]: the key/value up-projection and the dense layer's MLP run twice per micro-batch,
    the MoE layer's router once; the curve of the run without recompute within 1e-6."""
    model = make_family_dir(tmp_path / "model", "deepseek_v3")
    config = write_config(tmp_path, model, make_sft_data(tmp_path, 64, 1, "train"),
                          training={"max_steps": 3, "logging_steps": 1})
    reference = probe_run(config, tmp_path / "none", 1)[0]
    probe = probe_run(config, tmp_path / "parts", 1, SELECTIVE,
                      "recompute_modules=[mla_up_proj,mlp]")[0]
    twice = {"0.decoder.layers.0.mlp"} | {key for key in reference["calls"]
                                           if key.endswith("linear_kv_up_proj")}
    assert len(twice) == 3 and "0.decoder.layers.1.mlp" in reference["calls"]  # the MoE layer
    for key, count in reference["calls"].items():
        assert probe["calls"][key] == (2 if key in twice else 1) * count, key
    same_curve(steps(tmp_path / "parts"), steps(tmp_path / "none"), 1e-6, "mla_up_proj,mlp")


def test_a_mixture_of_experts_has_no_mlp_to_recompute(tmp_path):
    from transformers import Qwen3MoeConfig

    moe = tmp_path / "moe"  # a config-only model directory
    Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32).save_pretrained(moe)
    config = write_config(tmp_path, moe, make_sft_data(tmp_path, 8, 1, "train"))
    load_config(config, [SELECTIVE, "recompute_modules=[moe,layernorm]"]).resolve(1)
    with pytest.raises(ConfigError) as err:
        load_config(config, [SELECTIVE, "recompute_modules=[mlp]"]).resolve(1)
    assert str(err.value) == ("parallel.recompute_modules has 'mlp': every layer of this mixture "
                              "of experts is an MoE layer (moe); valid: one or more of core_attn, "
                              "layernorm, moe")


@pytest.mark.slow
def test_the_bytes_a_forward_keeps_fall_as_the_planner_counts():
    """What autograd keeps after one forward of a 2-layer Llama (hidden 64, ffn 96, 32 tokens,
    float32, fused SwiGLU): recomputing the MLP frees exactly the planner's count for it (fc1's
    gate and up outputs and the activation's output: 3·ffn a token and layer); recomputing the
    norms frees at least their outputs (CPU's composite RMSNorm also keeps an intermediate of
    its own, which the planner, sizing GPU kernels, leaves out)."""
    hidden, ffn, layers, tokens = 64, 96, 2, 32
    proc = run_ranks(1, [Path(__file__).with_name("recompute_bytes_worker.py"), hidden, ffn,
                         layers, tokens], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kept = json.loads(proc.stdout.strip().splitlines()[-1])
    shape = ModelShape(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                       num_query_groups=2, ffn_hidden_size=ffn, vocab_size=128)

    def planned(parts: str) -> int:  # bf16 bytes a token and layer -> float32 bytes in all
        work = Workload(seq_length=tokens, recompute=f"selective:{parts}")
        return 2 * discarded_bytes_per_token(shape, work, Layout().resolved(1)) * tokens * layers

    assert kept["layernorm"] - kept["layernorm,mlp"] == planned("layernorm,mlp") - planned(
        "layernorm") == 2 * 3 * ffn * 2 * tokens * layers
    assert kept["none"] - kept["layernorm"] >= planned("layernorm") == 2 * hidden * 4 * tokens * layers
