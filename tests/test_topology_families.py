"""The planner's model of DeepSeek-V3 (MLA, dense first layers, shared expert, router bias,
MTP), GLM-4.5 and Qwen2-MoE: shapes read from their HF configs, parameters, activations and
FLOPs, and what plan reports name."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_planner_calibration import DEEPSEEK_V3_CONFIG

from hpc_mca.topology import Layout, LayoutError, ModelShape, plan
from hpc_mca.topology.cost import _attention_seconds, _layer_gemm_seconds
from hpc_mca.topology.hardware import get_gpu
from hpc_mca.topology.memory import (
    Workload,
    busiest_ranks,
    checkpoint_parameters,
    discarded_bytes_per_token,
    layer_bytes_per_token,
    layer_kinds_on_rank,
    stage_counts,
)
from hpc_mca.topology.model import layer_view
from hpc_mca.topology.report import format_explain, format_plan_table

DEEPSEEK_V3 = ModelShape.from_hf_config(DEEPSEEK_V3_CONFIG)
# GLM-4.5 (zai-org/GLM-4.5 config.json).
GLM45_CONFIG = dict(model_type="glm4_moe", hidden_size=5120, num_hidden_layers=92,
                    num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                    intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160,
                    num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3,
                    vocab_size=151552, num_nextn_predict_layers=1)
# Qwen1.5-MoE-A2.7B (Qwen/Qwen1.5-MoE-A2.7B config.json).
QWEN15_MOE_CONFIG = dict(model_type="qwen2_moe", hidden_size=2048, num_hidden_layers=24,
                         num_attention_heads=16, num_key_value_heads=16, intermediate_size=5632,
                         moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                         num_experts=60, num_experts_per_tok=4, vocab_size=151936,
                         decoder_sparse_step=1, mlp_only_layers=[])
TINY_MLA = dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=4,
                num_attention_heads=4, intermediate_size=96, vocab_size=256,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=8)


def test_deepseek_v3_shape_is_read_from_its_config():
    m = DEEPSEEK_V3
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
            m.v_head_dim) == (1536, 512, 128, 64, 128)
    assert m.is_mla and m.qk_head_dim == 192 and m.value_head_dim == 128
    assert m.num_query_groups == 128 and m.head_dim is None
    assert (m.num_experts, m.moe_router_topk, m.expert_ffn_hidden_size) == (256, 8, 2048)
    assert m.moe_shared_expert_ffn_hidden_size == 2048 and not m.moe_shared_expert_gate
    assert m.moe_router_expert_bias and m.checkpoint_mtp_layers == 1
    assert m.dense_layer_ids == (0, 1, 2) and m.num_moe_layers == 58


def test_deepseek_v3_counts_671b_and_14b_of_mtp():
    """DeepSeek-V3's report: 671B parameters, 685B with the MTP module (its own embedding and
    output head copies included, as the HF checkpoint stores them)."""
    main, mtp = checkpoint_parameters(DEEPSEEK_V3)
    assert main == pytest.approx(671e9, rel=0.01)
    assert main + mtp == pytest.approx(685e9, rel=0.01)
    # One MLA block by hand: q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o.
    mla = (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256
           + 128 * 128 * 7168)
    dense_layer = mla + 3 * 7168 * 18432 + 2 * 7168
    moe_layer = (mla + 3 * 7168 * 2048 * 257 + 7168 * 256 + 256 + 2 * 7168)
    assert main == 3 * dense_layer + 58 * moe_layer + 2 * 129280 * 7168 + 7168


@pytest.mark.parametrize("config, published", [(GLM45_CONFIG, 355e9),
                                               (QWEN15_MOE_CONFIG, 14.3e9)],
                         ids=["glm4.5", "qwen1.5-moe"])
def test_other_families_count_their_published_size(config, published):
    assert checkpoint_parameters(ModelShape.from_hf_config(config))[0] == \
        pytest.approx(published, rel=0.01)


def test_family_defaults_apply_where_a_key_is_absent():
    """transformers' config classes' defaults, without transformers."""
    bare = {k: v for k, v in DEEPSEEK_V3_CONFIG.items()
            if k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "vocab_size")}
    assert replace(ModelShape.from_hf_config(bare), name="DeepSeek-V3") == DEEPSEEK_V3
    glm = ModelShape.from_hf_config({k: v for k, v in GLM45_CONFIG.items()
                                     if k not in ("first_k_dense_replace", "n_shared_experts")})
    assert glm.dense_layer_ids == (0,) and glm.moe_shared_expert_ffn_hidden_size == 1536
    qwen = ModelShape.from_hf_config({k: v for k, v in QWEN15_MOE_CONFIG.items()
                                      if k != "shared_expert_intermediate_size"})
    assert qwen.moe_shared_expert_ffn_hidden_size == 5632 and qwen.moe_shared_expert_gate


def test_a_null_q_lora_rank_is_a_plain_q_proj():
    full = ModelShape.from_hf_config(TINY_MLA)
    plain = ModelShape.from_hf_config({**TINY_MLA, "q_lora_rank": None})
    assert plain.q_lora_rank is None and full.q_lora_rank == 24
    # q_a (64x24) + its norm (24) + q_b (24 x 4*12) becomes q_proj (64 x 4*12), every layer.
    per_layer = 64 * 24 + 24 + 24 * 48 - 64 * 48
    assert checkpoint_parameters(full)[0] - checkpoint_parameters(plain)[0] == 4 * per_layer


def test_qwen_moe_sparse_step_and_mlp_only_layers_pick_the_dense_layers():
    shape = ModelShape.from_hf_config({**QWEN15_MOE_CONFIG, "num_hidden_layers": 8,
                                       "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    # MoE iff not in mlp_only_layers and (i+1) % 2 == 0: layers 1, 5, 7.
    assert shape.dense_layer_ids == (0, 2, 3, 4, 6)
    assert [shape.is_moe_layer(i) for i in range(8)] == [False, True, False, False, False,
                                                        True, False, True]


@pytest.mark.parametrize("change, line", [
    (dict(kv_lora_rank=0), "kv_lora_rank=0 must be a positive integer under multi-latent"),
    (dict(q_lora_rank=-1), "q_lora_rank=-1 must be a positive integer or None"),
    (dict(kv_lora_rank=None), "qk_nope_head_dim=128 needs kv_lora_rank"),
    (dict(dense_layer_ids=(2, 1)), "dense_layer_ids=(2, 1) must be increasing"),
    (dict(dense_layer_ids=(0, 61)), "within 0..60"),
    (dict(moe_shared_expert_ffn_hidden_size=0, moe_shared_expert_gate=True),
     "moe_shared_expert_gate=True needs a shared expert"),
    (dict(checkpoint_mtp_layers=-1), "checkpoint_mtp_layers=-1 must be 0 or a positive"),
])
def test_invalid_family_fields_are_one_line_errors(change, line):
    with pytest.raises(LayoutError) as err:
        replace(DEEPSEEK_V3, **change)
    # One line a violation (removing kv_lora_rank leaves four MLA widths without it).
    lines = str(err.value).splitlines()
    assert line in lines[0] and len(lines) == (4 if change == dict(kv_lora_rank=None) else 1)


def test_mla_projections_split_over_tp_and_its_norms_do_not():
    """The trainer's local layer spec splits every MLA projection over TP (the down
    projections by rows, as hpc_mca.models.mapping loads them); the latents' norms stay whole."""
    one = stage_counts(DEEPSEEK_V3, Layout().resolved(8), 0, 16)
    two = stage_counts(DEEPSEEK_V3, Layout(tp=2).resolved(8), 0, 16)
    split_attention = (7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * 256
                       + 128 * 128 * 7168)
    # Halved by TP2 on every layer: q_a, q_b, kv_a, kv_b, o, the MLPs (dense or shared
    # expert); the embedding and output tables (padded to 256 rows at TP2, 128 at TP1).
    mlps = 3 * 3 * 7168 * 18432 + 58 * 3 * 7168 * 2048
    tables = 2 * 129280 * 7168
    assert one.dense - two.dense == (61 * split_attention + mlps + tables) // 2


def test_dense_first_layers_make_a_later_stage_the_busiest():
    layout = Layout(pp=8, ep=8).resolved(64)
    shape = replace(DEEPSEEK_V3, num_layers=64)
    assert [layer_kinds_on_rank(shape, layout, r) for r in range(3)] == [(3, 5), (0, 8), (0, 8)]
    counts = [stage_counts(shape, layout, r, 16) for r in range(2)]
    assert counts[1].expert - counts[0].expert == 3 * 32 * 3 * 7168 * 2048
    assert busiest_ranks(shape, layout) == [0, 1, 7]
    # The dense layers at the end instead: the last stage holds them, no other rank is added.
    assert busiest_ranks(replace(shape, dense_layer_ids=(61, 62, 63)), layout) == [0, 7]


def test_mla_attention_flops_and_projections():
    """QKᵀ over nope + rope = 192 per head, AV over v = 128; the projections' GEMMs are 2 FLOPs
    per weight per token, split over TP (replicated down-projections by sequence)."""
    gpu, tokens = get_gpu("H100"), 4096
    layout = Layout(tp=2).resolved(2)
    work = Workload(seq_length=4096)
    seconds = _attention_seconds(DEEPSEEK_V3, layout, work, gpu, tokens)
    mha = replace(DEEPSEEK_V3, kv_lora_rank=None, q_lora_rank=None, qk_nope_head_dim=0,
                  qk_rope_head_dim=0, v_head_dim=0, head_dim=160)
    # The same (192 + 128) / 2 = 160 wide heads in plain attention: the same FLOPs.
    assert seconds == pytest.approx(_attention_seconds(mha, layout, work, gpu, tokens))
    dense = layer_view(DEEPSEEK_V3, False)
    split, _ = _layer_gemm_seconds(dense, layout, work, gpu, tokens)
    weights = (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
               + 3 * 7168 * 18432)
    rate = gpu.peak_tflops * 1e12 * 0.70 * 3584 / (3584 + 256)
    assert split == pytest.approx(2 * tokens * weights / 2 / rate)


def test_mla_activations_and_up_projection_recompute():
    layout = Layout().resolved(1)
    work = Workload(seq_length=4096)
    moe = layer_view(DEEPSEEK_V3, True)
    qkv = 2 * 128 * 192 + 128 * 128
    saved = layer_bytes_per_token(moe, work, layout)
    mla = 2 * 1536 + 512 + 64 + 512 + qkv + 128 * 128
    assert layer_bytes_per_token(layer_view(DEEPSEEK_V3, False), work, layout) == \
        2 * (2 * 7168 + mla) + 4 * 128 + 2 * (2 * 7168 + 3 * 18432)
    # An MoE layer: the same attention, the router's inputs, 8 dispatched copies, one shared
    # expert instead of the dense MLP.
    assert saved == 2 * (2 * 7168 + mla) + 4 * 128 + 2 * (2 * 7168 + 8 * (7168 + 3 * 2048)
                                                          + 3 * 2048) + 4 * 256
    freed = discarded_bytes_per_token(moe, replace(work, recompute="selective:mla_up_proj"),
                                      layout)
    assert freed == 2 * qkv


def test_plan_and_explain_name_the_structure():
    p = plan(model=DEEPSEEK_V3_CONFIG, nodes=128, seq_length=4096, global_batch_size=8192,
             precision="fp8", layout=Layout(tp=2, pp=8, vp=4, ep=64,
                                            pipeline_layout=(1,) + (2,) * 30 + (0,)),
             micro_batch_size=1, recompute="selective:mla_up_proj,mlp")
    table = format_plan_table(p)
    assert "MLA (q_lora 1536, kv_lora 512" in table
    assert "shared expert 2048 wide (TP-split like a dense MLP, not EP)" in table
    assert "3 dense-MLP layer(s) (layers 0-2, 18432 wide) beside 58 MoE layers" in table
    assert "MLA (q_lora 1536" in format_explain(p)


def test_recompute_parts_follow_the_model():
    job = dict(model=QWEN15_MOE_CONFIG, nodes=1, seq_length=4096, global_batch_size=64)
    with pytest.raises(LayoutError, match="mla_up_proj"):
        plan(**job, recompute="selective:mla_up_proj")
    with pytest.raises(LayoutError, match="selective:mlp"):
        plan(**job, recompute="selective:mlp")  # every Qwen1.5-MoE layer is MoE
