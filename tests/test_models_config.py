"""In-process checks of the HF -> Megatron model layer: config mapping, RoPE, weight plans, and
the pre-checks that must reject bad input in one line (naming file and tensor) before anything
is allocated. No Megatron model is built here; tests/test_models.py runs the real thing."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import torch

import hpc_mca
from hpc_mca.models.checkpoint import inspect_checkpoint
from hpc_mca.models.errors import ModelLoadError
from hpc_mca.models.hf_config import SUPPORTED_MODEL_TYPES, read_hf_config
from hpc_mca.models.mapping import (
    Piece,
    ShardCoords,
    hf_tensor_shapes,
    padded_vocab_size,
    plan_param,
)
from hpc_mca.models.megatron_config import rope_inv_freq, transformer_config_kwargs
from hpc_mca.topology import Layout

TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=200, max_position_embeddings=256)


def _save(directory: Path, config_class: str = "LlamaConfig", shard: str | None = None,
          **overrides) -> Path:
    import transformers

    config = getattr(transformers, config_class)(**{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("llama") / "m")


@pytest.fixture(scope="module")
def llama_sharded(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("sharded") / "m", shard="24KB")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _one_line_error(call, *fragments: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# --- config mapping --------------------------------------------------------------------------


@pytest.mark.parametrize("config_class,model_type,expected", [
    ("LlamaConfig", "llama", dict(add_qkv_bias=False, qk_layernorm=False)),
    ("Qwen2Config", "qwen2", dict(add_qkv_bias=True, qk_layernorm=False)),
    ("Qwen3Config", "qwen3", dict(add_qkv_bias=False, qk_layernorm=True, kv_channels=32)),
    ("Qwen3MoeConfig", "qwen3_moe", dict(qk_layernorm=True, num_moe_experts=4,
                                         moe_ffn_hidden_size=32, moe_router_pre_softmax=True)),
    ("MixtralConfig", "mixtral", dict(num_moe_experts=4, moe_ffn_hidden_size=96,
                                      moe_router_pre_softmax=False, layernorm_epsilon=1e-5)),
])
def test_transformer_config_follows_the_family(config_class, model_type, expected):
    import transformers

    extra = {"head_dim": 32} if model_type == "qwen3" else {}
    if model_type in ("qwen3_moe", "mixtral"):
        extra = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32}
    config = getattr(transformers, config_class)(**{**TINY, **extra}).to_dict()
    spec = read_hf_config(config)
    kwargs = transformer_config_kwargs(spec, Layout(tp=2))
    assert spec.model_type == model_type
    assert kwargs["num_query_groups"] == 2 and kwargs["tensor_model_parallel_size"] == 2
    assert kwargs["normalization"] == "RMSNorm" and kwargs["gated_linear_unit"]
    assert {key: kwargs[key] for key in expected} == expected


def test_norm_topk_prob_renormalises_like_mixtral():
    import transformers

    config = transformers.Qwen3MoeConfig(**TINY, num_experts=4, norm_topk_prob=True).to_dict()
    kwargs = transformer_config_kwargs(read_hf_config(config), Layout())
    assert kwargs["moe_router_pre_softmax"] is False


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 5e5},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 32,
     "beta_fast": 16, "beta_slow": 2, "truncate": False, "mscale": 0.7, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 64,
     "attention_factor": 1.3},
    {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
])
def test_rope_frequencies_equal_transformers(rope):
    """Frequencies bit-equal to transformers', and its yarn attention factor (cos and sin
    scaled, so q.k by its square) as the softmax scale."""
    import transformers

    if "partial_rotary_factor" in rope:  # a family whose transformers code rotates part
        config = transformers.Glm4MoeConfig(**TINY, n_routed_experts=4, rope_parameters=rope)
    else:
        config = transformers.LlamaConfig(**TINY, rope_parameters=rope)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    spec = read_hf_config(config.to_dict())
    torch.testing.assert_close(rope_inv_freq(spec.rope, spec.head_dim),
                               hf.model.rotary_emb.inv_freq, rtol=0, atol=0)
    scale = transformer_config_kwargs(spec, Layout()).get("softmax_scale")
    factor = hf.model.rotary_emb.attention_scaling
    assert scale == (None if factor == 1.0 else pytest.approx(factor**2 / spec.head_dim**0.5))


def test_transformers4_style_rope_keys_are_read():
    config = {"model_type": "llama", **TINY, "rope_theta": 5e5,
              "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    rope = read_hf_config(config).rope
    assert (rope.type, rope.theta, rope.factor) == ("linear", 5e5, 2.0)


# --- weight plans ----------------------------------------------------------------------------


def test_padded_vocab_follows_megatron():
    assert padded_vocab_size(200, 1) == 256
    assert padded_vocab_size(256, 2) == 256
    assert padded_vocab_size(257, 2) == 512
    assert padded_vocab_size(130, 4, divisible_by=8) == 160


def test_qkv_rows_are_grouped_per_query_group():
    spec = read_hf_config({"model_type": "llama", **TINY, "num_attention_heads": 8,
                           "num_key_value_heads": 4, "hidden_size": 128})
    coords = ShardCoords(padded_vocab_size=256, tp_rank=1, tp_size=2)
    plan = plan_param(spec, coords, "decoder.layers.0.self_attention.linear_qkv.weight", 1)
    p = "model.layers.1.self_attn."
    # 2 heads per group, head_dim 16; rank 1 holds groups 2 and 3, each [q q k v] = 64 rows
    assert plan.pieces == (
        Piece(p + "q_proj.weight", 0, 64, 96, 0), Piece(p + "k_proj.weight", 0, 32, 48, 32),
        Piece(p + "v_proj.weight", 0, 32, 48, 48), Piece(p + "q_proj.weight", 0, 96, 128, 64),
        Piece(p + "k_proj.weight", 0, 48, 64, 96), Piece(p + "v_proj.weight", 0, 48, 64, 112),
    )
    assert plan.exported


def test_vocab_rows_of_the_padding_rank_and_tied_output():
    spec = read_hf_config({"model_type": "qwen3", **TINY, "vocab_size": 130,
                           "tie_word_embeddings": True})
    last = ShardCoords(padded_vocab_size=256, tp_rank=1, tp_size=2)
    embedding = plan_param(spec, last, "embedding.word_embeddings.weight", None)
    assert embedding.pieces == (Piece("model.embed_tokens.weight", 0, 128, 130, 0),)
    assert embedding.padded and embedding.exported
    output = plan_param(spec, last, "output_layer.weight", None)
    assert output.pieces == embedding.pieces and not output.exported
    assert "lm_head.weight" not in hf_tensor_shapes(spec)


def test_experts_of_an_expert_parallel_rank():
    spec = read_hf_config({"model_type": "mixtral", **TINY, "num_local_experts": 4})
    coords = ShardCoords(padded_vocab_size=256, ep_rank=1, ep_size=2, edp_rank=1)
    name = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    plan = plan_param(spec, coords, name, 0)
    base = "model.layers.0.block_sparse_moe.experts.3."
    assert plan.pieces == (Piece(base + "w1.weight", 0, 0, 96, 0),
                           Piece(base + "w3.weight", 0, 0, 96, 96))
    assert not plan.exported  # the expert-data-parallel replica 0 exports it


def test_unknown_megatron_parameter_is_an_error():
    spec = read_hf_config({"model_type": "llama", **TINY})
    with pytest.raises(ModelLoadError, match="decoder.layers.0.mlp.linear_fc1.bias"):
        plan_param(spec, ShardCoords(256), "decoder.layers.0.mlp.linear_fc1.bias", 0)


# --- bad input: one line naming file and tensor, before allocation ---------------------------


def test_shape_mismatch_names_file_and_tensor(llama, tmp_path):
    model = _copy(llama, tmp_path / "m")
    _edit_config(model, intermediate_size=128)
    _one_line_error(lambda: inspect_checkpoint(read_hf_config(model)),
                    str(model / "model.safetensors"), "model.layers.0.mlp.gate_proj.weight",
                    "[96, 64]", "[128, 64]")


def test_missing_shard_names_file_and_tensor(llama_sharded, tmp_path):
    model = _copy(llama_sharded, tmp_path / "m")
    weight_map = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    shard = weight_map["model.layers.1.self_attn.o_proj.weight"]
    (model / shard).unlink()
    message = _one_line_error(lambda: inspect_checkpoint(read_hf_config(model)),
                              str(model / shard), "model.safetensors.index.json")
    assert any(name in message for name, file in weight_map.items() if file == shard)


def test_missing_tensor_names_file_and_tensor(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    model = _copy(llama, tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    _one_line_error(lambda: inspect_checkpoint(read_hf_config(model)),
                    str(model / "model.safetensors"), "model.layers.1.self_attn.k_proj.weight")


def test_tensor_missing_from_its_listed_shard(llama_sharded, tmp_path):
    model = _copy(llama_sharded, tmp_path / "m")
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.0.mlp.up_proj.weight"
    other = next(f for f in index["weight_map"].values() if f != index["weight_map"][name])
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    _one_line_error(lambda: inspect_checkpoint(read_hf_config(model)), str(model / other), name)


def test_no_weights_at_all(llama, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    shutil.copy(llama / "config.json", model)
    _one_line_error(lambda: inspect_checkpoint(read_hf_config(model)), str(model), "safetensors")


def test_unsupported_model_type_lists_the_supported(llama, tmp_path):
    model = _copy(llama, tmp_path / "m")
    _edit_config(model, model_type="gpt2")
    _one_line_error(lambda: read_hf_config(model), str(model / "config.json"), "'gpt2'",
                    ", ".join(SUPPORTED_MODEL_TYPES))


@pytest.mark.parametrize("changes,fragments", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0,
                          "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                          "original_max_position_embeddings": 64}},
     ["'longrope'", "default, linear, llama3, yarn"]),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5}},
     ["yarn with partial_rotary_factor=0.5"]),
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'"]),
    ({"attention_bias": True}, ["attention_bias=true"]),
])
def test_unsupported_options_are_refused(llama, tmp_path, changes, fragments):
    model = _copy(llama, tmp_path / "m")
    _edit_config(model, **changes)
    _one_line_error(lambda: read_hf_config(model), str(model / "config.json"), *fragments)


@pytest.mark.parametrize("changes,fragment", [
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),  # Megatron renormalises sigmoid top-k
    (dict(num_experts_per_tok=1), "num_experts_per_tok=1"),
    (dict(n_group=2, topk_group=2), "n_group=2, topk_group=2"),  # top-k 2 != 2 * 2 groups
    (dict(n_group=3, topk_group=1), "n_group=3"),  # 4 experts in 3 groups
])
def test_glm4_moe_routing_megatron_computes_otherwise_is_refused(changes, fragment):
    import transformers

    config = transformers.Glm4MoeConfig(**{**TINY, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                           **changes}).to_dict()
    _one_line_error(lambda: read_hf_config(config), "config: ", fragment)


def test_moe_dense_layers_follow_transformers_rule():
    """Which layers keep a dense MLP: transformers' own modules say, per family."""
    import transformers

    cases = [transformers.Qwen2MoeConfig(**{**TINY, "num_hidden_layers": 6}, num_experts=4,
                                         decoder_sparse_step=2, mlp_only_layers=[3]),
             transformers.Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 4}, num_experts=4,
                                         mlp_only_layers=[0, 2]),
             transformers.Glm4MoeConfig(**{**TINY, "num_hidden_layers": 4}, n_routed_experts=4,
                                        first_k_dense_replace=2)]
    for config in cases:
        model = transformers.AutoModelForCausalLM.from_config(config)
        dense = tuple(i for i, layer in enumerate(model.model.layers)
                      if hasattr(layer.mlp, "gate_proj"))
        spec = read_hf_config(config.to_dict())
        assert spec.dense_layers == dense and dense, config.model_type
        freq = transformer_config_kwargs(spec, Layout())["moe_layer_freq"]
        assert freq == [int(i not in dense) for i in range(config.num_hidden_layers)]


@pytest.mark.parametrize("attention_bias", [True, False])
def test_seed_oss_qkv_bias_follows_attention_bias(attention_bias):
    import transformers

    config = transformers.SeedOssConfig(**TINY, head_dim=32, residual_dropout=0.0,
                                        attention_bias=attention_bias).to_dict()
    kwargs = transformer_config_kwargs(read_hf_config(config), Layout())
    assert (kwargs["add_qkv_bias"], kwargs["add_bias_linear"], kwargs["kv_channels"]) == (
        attention_bias, False, 32)


@pytest.mark.parametrize("changes,fragment", [
    ({}, "residual_dropout=0.1"),  # transformers' default, and Seed-OSS's own
    ({"residual_dropout": 0.0, "attention_out_bias": True}, "attention_out_bias=true"),
])
def test_seed_oss_options_megatron_computes_otherwise_are_refused(changes, fragment):
    import transformers

    config = transformers.SeedOssConfig(**TINY, **changes).to_dict()
    _one_line_error(lambda: read_hf_config(config), "config: ", fragment)


def test_a_tied_config_over_another_lm_head_is_refused(llama, tmp_path):
    """config.json ties the output layer to the embedding, but the checkpoint's lm_head.weight is
    another matrix (transformers loads it untied): refused in one line; an equal copy loads."""
    from safetensors.torch import load_file, save_file

    model = _copy(llama, tmp_path / "m")
    _edit_config(model, tie_word_embeddings=True)
    _one_line_error(lambda: inspect_checkpoint(read_hf_config(model)), "lm_head.weight differs",
                    "tie_word_embeddings false")
    tensors = load_file(model / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    inspect_checkpoint(read_hf_config(model))  # what a tied model's own save may hold


def test_mixtral_router_jitter_is_refused():
    """transformers jitters the MoE block's input in training only; Megatron's router would
    jitter its own input, in evaluation too (logits that change from one forward to the next):
    refused in one line; transformers' default 0.0 loads."""
    import transformers

    noisy = transformers.MixtralConfig(**TINY, num_local_experts=4, router_jitter_noise=0.1).to_dict()
    _one_line_error(lambda: read_hf_config(noisy), "config: ", "router_jitter_noise=0.1")
    plain = transformers.MixtralConfig(**TINY, num_local_experts=4).to_dict()
    assert "moe_input_jitter_eps" not in transformer_config_kwargs(read_hf_config(plain), Layout())


def test_sliding_window_refused_only_when_it_matters(tmp_path):
    from hpc_mca.models.hf_config import check_sequence_length

    config = {"model_type": "mistral", **TINY, "sliding_window": 128}
    spec = read_hf_config(config)
    check_sequence_length(spec, 128)
    _one_line_error(lambda: check_sequence_length(spec, 256), "sliding_window=128",
                    "seq_length=256")
    qwen = read_hf_config({"model_type": "qwen2", **TINY, "sliding_window": 16,
                           "use_sliding_window": False})
    check_sequence_length(qwen, 256)


def test_build_model_fails_before_allocating(llama, tmp_path, monkeypatch):
    from hpc_mca.models import build

    def must_not_run(*args, **kwargs):
        raise AssertionError("the model was being built")

    monkeypatch.setattr(build, "transformer_config", must_not_run)
    monkeypatch.setattr(build, "_build_chunk", must_not_run)
    ctx = types.SimpleNamespace(layout=Layout(dp=1), env=types.SimpleNamespace(world_size=1),
                                backend="gloo", device=torch.device("cpu"))
    model = _copy(llama, tmp_path / "m")
    _edit_config(model, num_key_value_heads=4)
    _one_line_error(lambda: build.build_model(model, ctx), "model.layers.0.self_attn.k_proj.weight",
                    str(model / "model.safetensors"))
    _edit_config(model, model_type="phi3")
    _one_line_error(lambda: build.build_model(model, ctx), "'phi3'")


# --- the planner's reader and the model builder's reader agree ------------------------------


def _family_configs() -> dict[str, dict]:
    """Every config the suite builds models from: the bundled demo's and each family's."""
    import transformers
    from test_models import COMMON, EXTRA, FAMILIES

    configs = {"demo": json.loads((Path(hpc_mca.__file__).parent / "assets" / "demo" /
                                   "config.json").read_text())}
    for name, (config_class, overrides, *_) in {**FAMILIES, **EXTRA}.items():
        configs[name] = getattr(transformers, config_class)(**{**COMMON, **overrides}).to_dict()
    # tests/trainer_fixtures.make_model_dir's two models.
    fixture = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   tie_word_embeddings=False)
    configs["fixture_llama"] = transformers.LlamaConfig(**fixture).to_dict()
    configs["fixture_moe"] = transformers.Qwen3MoeConfig(
        **fixture, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32).to_dict()
    return configs


@pytest.mark.parametrize("name, config", list(_family_configs().items()))
def test_planner_shape_and_builder_spec_read_the_same_model(name, config):
    """The topology planner sizes memory from ModelShape (hpc_mca.topology.model, no
    transformers); the builder builds from HFModelSpec (hpc_mca.models.hf_config). Two
    readers, one model: every dimension the planner uses must be the builder's."""
    from hpc_mca.topology import ModelShape

    shape, spec = ModelShape.from_hf_config(config), read_hf_config(config)
    builder = {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
               "num_attention_heads": spec.num_attention_heads,
               "num_query_groups": spec.num_query_groups, "vocab_size": spec.vocab_size,
               "num_experts": spec.num_experts, "moe_router_topk": spec.moe_router_topk,
               "tie_word_embeddings": spec.tie_word_embeddings,
               "head_dim": spec.head_dim}
    planner = {key: getattr(shape, key) for key in builder}
    planner["head_dim"] = shape.head_dim or shape.hidden_size // shape.num_attention_heads
    if spec.mla is not None:  # no head_dim: the latents' and heads' widths instead
        del planner["head_dim"], builder["head_dim"]
        mla = spec.mla
        assert (shape.q_lora_rank, shape.kv_lora_rank, shape.qk_nope_head_dim,
                shape.qk_rope_head_dim, shape.v_head_dim) == (
            mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
            mla.v_head_dim)
    assert shape.is_mla == (spec.mla is not None)
    assert planner == builder
    if spec.is_moe:
        assert shape.expert_ffn_hidden_size == spec.moe_ffn_hidden_size
        assert shape.dense_layer_ids == spec.dense_layers
        assert (shape.moe_shared_expert_ffn_hidden_size, shape.moe_shared_expert_gate,
                shape.moe_router_expert_bias) == (spec.shared_expert_ffn_hidden_size,
                                                  spec.shared_expert_gate, spec.moe_expert_bias)
    else:
        assert shape.ffn_hidden_size == spec.ffn_hidden_size
