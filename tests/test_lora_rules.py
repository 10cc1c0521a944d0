"""LoRA's pure parts: lora_target in HF names, the planner's adapter count (against peft on the
transformers model), the base model's fingerprint and the resume rule that uses it."""

from __future__ import annotations

import json
import shutil

import pytest

from hpc_mca.checkpoint.compat import incompatibilities
from hpc_mca.checkpoint.store import CheckpointInfo
from hpc_mca.models.checkpoint import weights_fingerprint
from hpc_mca.topology import Layout, ModelShape
from hpc_mca.topology.lora import LoraModel, LoraTargetError, resolve_lora_targets
from hpc_mca.topology.memory import stage_counts

DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MOE = LoraModel(is_moe=True)
MLA = LoraModel(is_moe=True, mla_query_latent=True)


def test_all_means_every_linear_of_the_model():
    dense = resolve_lora_targets(["all"], LoraModel())
    assert dense.hf_modules() == list(DENSE) and dense.hf_parameters("mlp") == []
    moe = resolve_lora_targets("all", MOE)
    assert moe.hf_modules() == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert moe.hf_parameters("mlp") == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    mla = resolve_lora_targets("all", MLA)
    assert mla.hf_modules() == ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    plain_query = resolve_lora_targets("all", LoraModel(is_moe=True, mla_query_latent=False))
    assert plain_query.hf_modules() == ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def test_targets_map_onto_megatron_linears():
    targets = resolve_lora_targets(["v_proj,q_proj", "down_proj"], LoraModel())
    assert targets.parts("decoder.layers.0.self_attention.linear_qkv") == ("q_proj", "v_proj")
    assert targets.parts("decoder.layers.0.self_attention.linear_proj") == ()
    assert targets.parts("decoder.layers.0.mlp.linear_fc1") == ()
    assert targets.parts("decoder.layers.0.mlp.linear_fc2") == ("down_proj",)
    moe = resolve_lora_targets(["gate_up_proj"], MOE)
    assert moe.parts("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1") == ("gate_up_proj",)
    assert moe.parts("decoder.layers.1.mlp.experts.local_experts.2.linear_fc2") == ()
    # an MoE model's dense MLPs and shared experts take none
    moe = resolve_lora_targets(["gate_up_proj", "down_proj"], MOE)
    assert moe.parts("decoder.layers.0.mlp.linear_fc1") == moe.parts("decoder.layers.0.mlp.linear_fc2") == ()
    assert moe.parts("decoder.layers.1.mlp.shared_experts.linear_fc2") == ()
    mla = resolve_lora_targets(["kv_a_proj_with_mqa", "q_b_proj"], MLA)
    assert mla.parts("decoder.layers.0.self_attention.linear_kv_down_proj") == ("kv_a_proj_with_mqa",)
    assert mla.parts("decoder.layers.0.self_attention.linear_q_up_proj") == ("q_b_proj",)
    assert mla.parts("decoder.layers.0.self_attention.linear_q_down_proj") == ()


@pytest.mark.parametrize("names, model, message", [
    (["q_proj", "attn"], LoraModel(), "finetuning.lora_target=['q_proj', 'attn'] names no module "
                                      "of this llama: attn; valid: all, q_proj, k_proj, v_proj, "
                                      "o_proj, gate_proj, up_proj, down_proj"),
    (["gate_proj"], MOE, "names no module of this llama (its experts keep gate and up in one "
                         "gate_up_proj weight; dense layers' and shared experts' MLPs take no "
                         "adapters): gate_proj; valid: all, q_proj, k_proj, v_proj, o_proj, "
                         "gate_up_proj, down_proj"),
    (["k_proj"], MLA, "k_proj; valid: all, q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, "
                      "o_proj, gate_up_proj, down_proj"),
    ([], LoraModel(), "finetuning.lora_target=[] names no module of this llama: nothing"),
])
def test_a_target_the_model_lacks_is_one_line(names, model, message):
    with pytest.raises(LoraTargetError) as err:
        resolve_lora_targets(names, model, model_type="llama")
    assert message in str(err.value) and len(str(err.value).splitlines()) == 1


def _peft_count(config, **targets) -> int:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    return get_peft_model(model, LoraConfig(r=8, **targets)).get_nb_trainable_parameters()[0]


def test_planner_sizes_the_adapters_peft_would_train():
    """One GPU holds every layer: the planner's adapter count is peft's on the HF model."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    llama = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2)
    moe = Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=4, moe_intermediate_size=32,
                         num_experts_per_tok=2)
    from transformers import DeepseekV3Config

    # MLA with a query latent, a dense first layer and a shared expert (neither adapted)
    deepseek = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=96,
                                moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                first_k_dense_replace=1, n_group=1, topk_group=1)
    experts = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    for config, targets in ((llama, {"target_modules": list(DENSE)}),
                            (moe, {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                                   **experts}),
                            (deepseek, {"target_modules": ["q_a_proj", "q_b_proj", "o_proj",
                                                           "kv_a_proj_with_mqa", "kv_b_proj"],
                                        **experts})):
        shape = ModelShape.from_hf_config(config.to_dict())
        planned = stage_counts(shape, Layout(), 0, lora_rank=8).adapters
        assert planned == _peft_count(config, **targets), config.model_type


def test_planner_splits_adapters_as_the_layers_do():
    """TP2: A of column-parallel linears and B of row-parallel ones stay whole on each GPU."""
    shape = ModelShape(hidden_size=64, num_layers=1, num_attention_heads=4, num_query_groups=4,
                       ffn_hidden_size=128, vocab_size=128)
    one = stage_counts(shape, Layout(), 0, lora_rank=8).adapters
    two = stage_counts(shape, Layout(tp=2), 0, lora_rank=8).adapters
    whole = 8 * 64 * (3 + 1 + 2 + 1)  # A of q, k, v, gate, up; B of o, down: r·h each
    assert two == whole + (one - whole) // 2


def test_fingerprint_tells_other_weights_apart(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"a": torch.randn(300, 300), "b": torch.randn(10)}, base / "model.safetensors")
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    assert weights_fingerprint(base) == weights_fingerprint(copy)  # where it lives is no matter
    tuned = load_file(copy / "model.safetensors")
    save_file({k: v + 1e-4 for k, v in tuned.items()}, copy / "model.safetensors")
    assert weights_fingerprint(base) != weights_fingerprint(copy)
    random_init = tmp_path / "config_only"
    random_init.mkdir()
    shutil.copy(base / "config.json", random_init / "config.json")
    assert weights_fingerprint(random_init) != weights_fingerprint(base)


def _info(base: dict) -> CheckpointInfo:
    return CheckpointInfo(step=5, consumed_samples=40,
                          training={"finetuning_type": "lora", "base_model": base})


def test_adapters_resume_only_on_their_base_model():
    saved = {"path": "/models/base", "fingerprint": "ab" * 32}
    moved = {"path": "/elsewhere/base", "fingerprint": "ab" * 32}
    assert incompatibilities(_info(saved), {}, {}, {"finetuning_type": "lora", "base_model": moved}) == []
    other = {"path": "/models/tuned", "fingerprint": "cd" * 32}
    reasons = incompatibilities(_info(saved), {}, {}, {"finetuning_type": "lora", "base_model": other})
    assert reasons == ["model.model_name_or_path='/models/tuned' has other weights than the base "
                       "model the LoRA adapters of the checkpoint at step 5 were trained on "
                       "(/models/base, fingerprint abababababab, now cdcdcdcdcdcd); valid: that "
                       "base model"]
