"""Topology planner: model shapes, layout rules and their one-line messages (all CPU, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpc_mca.topology import (
    Layout,
    LayoutError,
    ModelShape,
    balanced_pipeline_layout,
    check_layout,
    megatron_pipeline_layout,
    plan,
)

# Llama-3-8B's public config.json values (the keys the planner reads).
LLAMA3_8B_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
# Mixtral-8x7B and Qwen3-30B-A3B style MoE configs.
MIXTRAL_CONFIG = {
    "model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
}
QWEN3_MOE_CONFIG = {
    "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "vocab_size": 151936,
    "num_experts": 128, "num_experts_per_tok": 8, "tie_word_embeddings": False,
}


@pytest.fixture
def llama8b() -> ModelShape:
    return ModelShape.from_hf_config(LLAMA3_8B_CONFIG)


@pytest.fixture
def mixtral() -> ModelShape:
    return ModelShape.from_hf_config(MIXTRAL_CONFIG)


# --- import hygiene ----------------------------------------------------------------------------

@pytest.mark.parametrize("module", ["hpc_mca.topology", "hpc_mca.config.rules",
                                    "hpc_mca.data.sources"])
def test_import_pulls_in_no_heavy_library(module):
    """What a login node's plan loads: the planner, and the config and data-source checks a
    plan from a run config runs (numpy alone costs ~60 ms, a 0.135 s plan would be 0.2 s)."""
    # A fresh interpreter: in this process other tests may already have imported torch.
    code = (f"import sys, {module}; "
            "heavy = sorted(m for m in ('torch', 'megatron', 'transformers', 'numpy') "
            "if m in sys.modules); print(heavy); assert not heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- ModelShape ------------------------------------------------------------------------------

def test_llama_config_keys(llama8b):
    assert (llama8b.num_layers, llama8b.hidden_size, llama8b.num_attention_heads) == (32, 4096, 32)
    assert (llama8b.num_query_groups, llama8b.ffn_hidden_size, llama8b.vocab_size) == (
        8, 14336, 128256)
    assert not llama8b.is_moe and llama8b.kv_channels == 128 and llama8b.gated_linear_unit


def test_mixtral_and_qwen3_moe_keys(mixtral):
    assert (mixtral.num_experts, mixtral.moe_router_topk) == (8, 2)
    assert mixtral.expert_ffn_hidden_size == 14336  # Mixtral experts use intermediate_size
    qwen = ModelShape.from_hf_config(QWEN3_MOE_CONFIG)
    assert (qwen.num_experts, qwen.moe_router_topk, qwen.moe_ffn_hidden_size) == (128, 8, 768)
    assert qwen.kv_channels == 128  # explicit head_dim, not 2048 / 32


def test_config_from_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    from_dir = ModelShape.from_hf_config(tmp_path)
    from_file = ModelShape.from_hf_config(str(tmp_path / "config.json"))
    assert from_dir == from_file and from_dir.name == tmp_path.name


def test_multimodal_text_config_is_used():
    shape = ModelShape.from_hf_config({"model_type": "x", "text_config": LLAMA3_8B_CONFIG})
    assert shape.num_layers == 32


def test_missing_config_path_is_one_line(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(LayoutError) as err:
        ModelShape.from_hf_config(missing)
    assert "\n" not in str(err.value)
    assert "model config not found" in str(err.value) and "nope" in str(err.value)


def test_config_missing_key_names_it():
    config = dict(LLAMA3_8B_CONFIG)
    del config["num_hidden_layers"]
    with pytest.raises(LayoutError, match="lacks num_hidden_layers"):
        ModelShape.from_hf_config(config)


def test_bad_json_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(LayoutError, match="not readable JSON") as err:
        ModelShape.from_hf_config(path)
    assert "\n" not in str(err.value)


def test_shape_validation():
    with pytest.raises(LayoutError, match="num_query_groups=5 must divide num_attention_heads=32"):
        ModelShape(num_layers=2, hidden_size=64, num_attention_heads=32, num_query_groups=5,
                   ffn_hidden_size=128, vocab_size=100)
    with pytest.raises(LayoutError, match="moe_router_topk=0"):
        ModelShape(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=8,
                   ffn_hidden_size=128, vocab_size=100, num_experts=4)


# --- Layout ----------------------------------------------------------------------------------

def test_resolved_fills_dp():
    assert Layout(tp=4, pp=2, cp=2).resolved(16).dp == 1
    assert Layout(tp=2).resolved(64).dp == 32


def test_resolved_rejects_indivisible_world():
    with pytest.raises(LayoutError, match="=12 does not divide world_size=16; valid products"):
        Layout(tp=4, pp=3).resolved(16)
    with pytest.raises(LayoutError, match="data_parallel_size=3 .* valid: 4"):
        Layout(tp=4, dp=3).resolved(16)


def test_layout_sizes_must_be_positive():
    with pytest.raises(LayoutError) as err:
        Layout(tp=0, pp=-1)
    assert err.value.violations == ["tensor_parallel_size=0 must be a positive integer",
                                    "pipeline_parallel_size=-1 must be a positive integer"]


def test_describe():
    assert Layout(tp=4, pp=2, cp=2).resolved(16).describe() == "TP4 PP2 CP2 DP1"
    assert Layout(ep=8, vp=2, pp=2).describe() == "TP1 PP2 VP2 CP1 EP8 ETP1 DP?"


def test_layout_error_joins_lines():
    err = LayoutError(["a=1 bad", "b=2 bad"])
    assert str(err) == "a=1 bad\nb=2 bad" and err.violations == ["a=1 bad", "b=2 bad"]
    assert isinstance(err, ValueError)


# --- check_layout: one test per rule ---------------------------------------------------------

def test_acceptance_layout_is_valid(llama8b):
    # Megatron-Bridge's public Llama3-8B pretrain recipe at 16k: 16×H100, TP4 PP2 CP2.
    assert check_layout(Layout(tp=4, pp=2, cp=2), 16, llama8b, gpus_per_node=8,
                        global_batch_size=512, micro_batch_size=1, seq_length=16384) == []


def test_tp3_with_32_heads_is_one_line(llama8b):
    lines = check_layout(Layout(tp=3), 48, llama8b, gpus_per_node=8)
    assert len(lines) == 1
    assert lines[0].startswith("tensor_parallel_size=3 does not divide num_attention_heads=32")
    assert lines[0].endswith("; valid: 1, 2, 4, 8")


def test_tp_message_matches_documented_form():
    shape = ModelShape(num_layers=4, hidden_size=4096, num_attention_heads=32,
                       num_query_groups=32, ffn_hidden_size=12288, vocab_size=1000)
    assert check_layout(Layout(tp=3), 48, shape) == [
        "tensor_parallel_size=3 does not divide num_attention_heads=32; valid: 1, 2, 4, 8"]


def test_tp_must_stay_in_node(llama8b):
    [line] = check_layout(Layout(tp=16), 32, llama8b, gpus_per_node=8)
    assert line == ("tensor_parallel_size=16 does not divide num_query_groups=8 (the KV heads: "
                    "each TP rank holds whole ones) and exceeds gpus_per_node=8 (its groups must "
                    "stay inside a node); valid: 1, 2, 4, 8")


def test_tp_must_divide_the_kv_heads():
    """A TP above the KV-head count is refused (HF weights are imported as whole KV heads per
    TP rank), with the divisors that work for this model and world."""
    mqa = ModelShape(num_layers=4, hidden_size=1024, num_attention_heads=16,
                     num_query_groups=1, ffn_hidden_size=4096, vocab_size=1000)
    assert check_layout(Layout(tp=8), 8, mqa) == [
        "tensor_parallel_size=8 does not divide num_query_groups=1 (the KV heads: each TP rank "
        "holds whole ones); valid: 1"]
    gqa = ModelShape(num_layers=4, hidden_size=1536, num_attention_heads=12,
                     num_query_groups=4, ffn_hidden_size=4096, vocab_size=1000)
    [line] = check_layout(Layout(tp=6), 12, gqa)
    assert line.startswith("tensor_parallel_size=6 does not divide num_query_groups=4")
    assert line.endswith("; valid: 1, 2, 4")
    llama70b_like = ModelShape(num_layers=80, hidden_size=8192, num_attention_heads=64,
                               num_query_groups=8, ffn_hidden_size=28672, vocab_size=128256)
    assert check_layout(Layout(tp=8), 64, llama70b_like, gpus_per_node=8) == []
    [line] = check_layout(Layout(tp=16), 64, llama70b_like)
    assert line.endswith("; valid: 1, 2, 4, 8")


def test_world_size_product(llama8b):
    [line] = check_layout(Layout(cp=3), 16, llama8b)
    assert line == ("tensor×pipeline×context parallel size=1×1×3=3 does not divide "
                    "world_size=16; valid products: 1, 2, 4, 8")


def test_pp_divides_layers(llama8b):
    [line] = check_layout(Layout(tp=4, pp=3), 24, llama8b)
    assert line == ("pipeline_parallel_size=3 does not divide num_layers=32; valid: 1, 2, or "
                    "this size with an uneven split: pipeline_layout=10,12,10")
    assert check_layout(Layout(tp=4, pp=3, pipeline_layout=(10, 12, 10)), 24, llama8b) == []


def test_vp_needs_pp_and_divides_stage(llama8b):
    assert check_layout(Layout(vp=2), 8, llama8b) == [
        "virtual_pipeline_parallel_size=2 needs pipeline_parallel_size > 1 "
        "(interleaving splits each pipeline stage); valid: None"]
    [line] = check_layout(Layout(pp=4, vp=3), 8, llama8b)
    assert line.startswith("virtual_pipeline_parallel_size=3 does not divide the 8 layers per "
                           "pipeline stage") and line.endswith("valid: None, 1, 2, 4, 8")
    assert check_layout(Layout(pp=4, vp=4), 8, llama8b) == []


def test_explicit_pipeline_layout_replaces_even_split(llama8b):
    # 32 layers over PP3: uneven, so only valid with an explicit layout that sums to 32.
    assert check_layout(Layout(pp=3, pipeline_layout=(10, 11, 11)), 3, llama8b) == []
    lines = check_layout(Layout(pp=3, pipeline_layout=(10, 11)), 3, llama8b)
    assert lines == [
        "pipeline_layout has 2 stages but pipeline_parallel_size×virtual_pipeline_parallel_size"
        "=3×1=3; valid: 3 stages",
        "pipeline_layout places 21 layers but num_layers=32; valid: a sum of 32"]


def test_mtp_layers_must_fit_the_last_stage(llama8b):
    """MTP layers run on the last stage beside its even share of the decoder layers."""
    assert check_layout(Layout(pp=8), 8, llama8b, mtp_num_layers=4) == []
    [line] = check_layout(Layout(pp=16), 16, llama8b, mtp_num_layers=4)
    assert line == ("pipeline_parallel_size=16 leaves 2 decoder layers on the last stage "
                    "(num_layers=32), fewer than the mtp_num_layers=4 MTP layers that also run "
                    "there; valid: 1, 2, 4, 8, or mtp_num_layers <= 2")
    assert check_layout(Layout(pp=3, pipeline_layout=(10, 11, 11)), 3, llama8b,
                        mtp_num_layers=1) == [
        "mtp_num_layers=1 with pipeline_layout: MTP layers go on the last stage of an even "
        "split; valid: no pipeline_layout"]
    # The planner never proposes a split the rule refuses.
    for depths in (1, 4, 8):
        p = plan(model=llama8b, nodes=4, gpu="H100-80GB", seq_length=4096,
                 global_batch_size=512, mtp_num_layers=depths)
        assert 32 // p.layout.pp >= depths, (depths, p.layout.describe())


def test_cp_sequence_alignment(llama8b):
    [line] = check_layout(Layout(tp=4, cp=2), 8, llama8b, seq_length=1000)
    assert line == ("seq_length=1000 is not a multiple of 2·CP·TP=16 (context_parallel_size=2, "
                    "tensor_parallel_size=4 with sequence parallelism); valid: 992, 1008")
    [packed] = check_layout(Layout(cp=4), 4, llama8b, seq_length=4100, sequence_packing=True)
    assert "2·CP=8" in packed and "packed sequence must be padded" in packed
    assert packed.endswith("valid: 4096, 4104")


def test_cp_alignment_without_sequence_parallel(llama8b):
    assert check_layout(Layout(tp=4, cp=2), 8, llama8b, seq_length=1004,
                        sequence_parallel=False) == []
    [line] = check_layout(Layout(tp=4, cp=2), 8, llama8b, seq_length=1002,
                          sequence_parallel=False)
    assert line == ("seq_length=1002 is not a multiple of 2·CP=4 (context_parallel_size=2); "
                    "valid: 1000, 1004")


def test_experts_divisible_by_ep(mixtral):
    [line] = check_layout(Layout(ep=3), 24, mixtral)
    assert line == "expert_parallel_size=3 does not divide num_experts=8; valid: 1, 2, 4, 8"


def test_ep_must_fit_pipeline_stage(mixtral):
    # 16 GPUs at TP2 PP4: a stage has 4 ranks, so EP8 cannot be laid over them.
    [line] = check_layout(Layout(tp=2, pp=4, ep=8), 16, mixtral)
    assert "does not divide the 4 ranks of a pipeline stage" in line
    assert line.endswith("valid: 1, 2, 4")


def test_ep_on_dense_model(llama8b):
    assert check_layout(Layout(ep=2), 8, llama8b) == [
        "expert_parallel_size=2 needs an MoE model (num_experts=0); valid: 1"]


def test_etp_rules(mixtral):
    [line] = check_layout(Layout(etp=16), 32, mixtral, gpus_per_node=8)
    assert line.startswith("expert_tensor_parallel_size=16 exceeds gpus_per_node=8")


def test_global_batch_divisible_by_micro_times_dp(llama8b):
    [line] = check_layout(Layout(tp=2), 32, llama8b, global_batch_size=100)
    assert line == ("global_batch_size=100 is not divisible by micro_batch_size×"
                    "data_parallel_size=1×16; valid: 96, 112")
    [line] = check_layout(Layout(tp=2), 32, llama8b, global_batch_size=128, micro_batch_size=3)
    assert line == ("micro_batch_size=3 does not divide global_batch_size/data_parallel_size="
                    "128/16=8; valid: 1, 2, 4, 8")


def test_interleaving_needs_microbatches_in_pp_groups(llama8b):
    [line] = check_layout(Layout(pp=4, vp=2), 8, llama8b, global_batch_size=6)
    assert line.startswith("global_batch_size=6 gives 3 micro-batches")
    assert line.endswith("valid: 8")
    assert check_layout(Layout(pp=4, vp=2), 8, llama8b, global_batch_size=8) == []


def test_bad_scalar_inputs():
    assert check_layout(Layout(), 0) == ["world_size=0 must be a positive integer"]
    assert check_layout(Layout(), 8, global_batch_size=0, seq_length=-1) == [
        "global_batch_size=0 must be a positive integer",
        "seq_length=-1 must be a positive integer"]


def test_every_violation_is_one_line(llama8b):
    lines = check_layout(Layout(tp=3, pp=5, cp=3, vp=7), 1000, llama8b, gpus_per_node=8,
                         global_batch_size=77, seq_length=1001)
    assert lines and all("\n" not in line and "valid:" in line for line in lines)


def test_rules_without_model_only_check_arithmetic():
    assert check_layout(Layout(tp=8, pp=4), 64) == []
    assert check_layout(Layout(tp=8, pp=4), 64, gpus_per_node=4) != []


def test_balanced_pipeline_layout():
    # 126 layers (Llama-3.1-405B) on 8 stages: embedding and loss count as a layer each.
    assert balanced_pipeline_layout(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert balanced_pipeline_layout(32, 3) == (10, 12, 10)
    assert balanced_pipeline_layout(32, 32) is None  # first/last stage would be empty
    layout = Layout(pp=2, vp=2, pipeline_layout=(1, 2, 2, 1))
    assert megatron_pipeline_layout(layout) == [
        ["embedding", "decoder"], ["decoder"] * 2, ["decoder"] * 2, ["decoder", "loss"]]
    assert megatron_pipeline_layout(Layout(pp=2)) is None
    assert Layout(pp=8, pipeline_layout=balanced_pipeline_layout(126, 8)).describe() == (
        "TP1 PP8(15,16×6,15) CP1 DP?")


def test_a_forced_pp_that_does_not_divide_the_layers_plans_an_uneven_split():
    """Published layouts put 126 layers on PP8 (Llama-3.1-405B): the planner takes --pp 8 and
    splits 15,16×6,15 (the first and last stages also hold the embedding and the loss)."""
    shape = ModelShape(num_layers=126, hidden_size=16384, num_attention_heads=128,
                       num_query_groups=8, ffn_hidden_size=53248, vocab_size=128256)
    job = dict(model=shape, nodes=64, gpu="H100-80GB", seq_length=4096, global_batch_size=4096)
    p = plan(**job, layout=Layout(tp=8, pp=8))
    assert p.layout.pipeline_layout == (15, 16, 16, 16, 16, 16, 16, 15)
    assert p.layout.describe() == "TP8 PP8(15,16×6,15) CP1 DP8"
    given = plan(**job,
                 layout=Layout(tp=8, pp=8, pipeline_layout=(14, 16, 16, 16, 16, 16, 16, 16)))
    assert given.layout.pipeline_layout == (14, 16, 16, 16, 16, 16, 16, 16)  # the user's split
