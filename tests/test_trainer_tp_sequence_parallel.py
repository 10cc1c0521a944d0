"""Megatron TP sequence parallelism (``parallel.sequence_parallel``) without Transformer Engine
or Apex: the local layer spec's norms are :class:`hpc_mca.models.norm.TorchNorm`, whose
weights ``finalize_model_grads`` sums over TP, and LoRA's adapter path gathers and
reduce-scatters the sequence as its base linear does.

The slow test trains TP2 on 2 gloo ranks with and without it and wants the same per-step loss
and gradient norm within 1e-5 over 6 updated steps: packed SFT rows (the demo's case),
unpacked rows short enough that both TP ranks' halves hold trained tokens, and LoRA. A
Qwen3-MoE with an MTP layer, which Megatron refuses to train under TP without sequence
parallelism, equals its one-process run instead. Measured: at most 5e-7 (loss and gradient
norm). Without the TP sum of the norms' (or LoRA's) gradients the curves part by 1e-4 to 1e-2.
"""

from __future__ import annotations

import types

import pytest
import torch
import yaml
from trainer_fixtures import make_model_dir, make_sft_data, run_train, steps, write_config

from hpc_mca.models.norm import TorchNorm


def _config(**fields: object) -> types.SimpleNamespace:
    base = dict(normalization="RMSNorm", sequence_parallel=False,
                layernorm_zero_centered_gamma=False, memory_efficient_layer_norm=False)
    return types.SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_torch_norm_is_torchs_module_with_its_weights_marked(sequence_parallel):
    norm = TorchNorm(_config(sequence_parallel=sequence_parallel), 8, eps=1e-6)
    reference = torch.nn.RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
        reference.weight.copy_(norm.weight)
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    assert type(norm) is torch.nn.RMSNorm
    assert torch.equal(norm(x), reference(x))
    assert norm.weight.sequence_parallel is sequence_parallel


def test_torch_norm_layernorm_and_refusals():
    layer_norm = TorchNorm(_config(normalization="LayerNorm", sequence_parallel=True), 4)
    assert type(layer_norm) is torch.nn.LayerNorm
    assert [p.sequence_parallel for p in layer_norm.parameters()] == [True, True]  # weight, bias
    with pytest.raises(ValueError, match="layernorm_zero_centered_gamma"):
        TorchNorm(_config(layernorm_zero_centered_gamma=True), 4)
    with pytest.raises(ValueError, match="'L2Norm'"):
        TorchNorm(_config(normalization="L2Norm"), 4)


def test_layer_spec_builds_every_norm_with_torch_norm():
    import transformers

    from hpc_mca.models.attention import TorchCoreAttention
    from hpc_mca.models.hf_config import read_hf_config
    from hpc_mca.models.megatron_config import layer_spec

    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8)
    layer = layer_spec(read_hf_config(config.to_dict()), TorchCoreAttention)
    attention = layer.submodules.self_attention.submodules
    norms = [layer.submodules.input_layernorm, layer.submodules.pre_mlp_layernorm,
             attention.q_layernorm, attention.k_layernorm]
    assert norms == [TorchNorm] * 4  # block_spec's final norm is input_layernorm's class


# --- training ---------------------------------------------------------------------------------

CASES = {
    # The demo's shape: packed rows of 64 slots.
    "packed": ["data.sequence_packing=true", "data.seq_length=64"],
    # 16-slot rows of ~11-token samples: TP rank 1's half (slots 8-15) holds answer tokens, so
    # its norm gradients are not zero (with long padded rows they are, and any TP sum passes).
    "unpacked": ["data.sequence_packing=false", "data.seq_length=16", "data.cutoff_len=16"],
    "lora": ["data.sequence_packing=true", "data.seq_length=64", "finetuning.finetuning_type=lora"],
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_sp")
    make_model_dir(root, layers=2)
    make_sft_data(root, 256, seed=1, name="train")
    return write_config(root, root / "model", root / "train.jsonl",
                        training={"max_steps": 6, "logging_steps": 1, "global_batch_size": 8})


def _train(config, run_dir, nproc: int, *overrides: str) -> list[dict]:
    proc = run_train(config, run_dir, nproc, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return steps(run_dir)


def _same_curve(got: list[dict], want: list[dict], what: str) -> None:
    assert [s["step"] for s in got] == list(range(1, 7)), what
    for mine, ref in zip(got, want):
        assert mine["tokens"] == ref["tokens"] and not mine["skipped"], (what, mine, ref)
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-5), (what, mine, ref)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], abs=1e-5), (what, mine, ref)
    assert got[-1]["loss"] < got[0]["loss"] - 0.05, what  # the weights were updated


def _sequence_parallel_was_on(run_dir) -> bool:
    return yaml.safe_load((run_dir / "resolved_config.yaml").read_text())["parallel"][
        "sequence_parallel"]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_sequence_parallel_trains_like_tp2(root, case):
    tp2 = ["parallel.tensor_model_parallel_size=2", *CASES[case]]
    base = _train(root, root.parent / f"{case}_tp2", 2, *tp2)
    sp_dir = root.parent / f"{case}_tp2_sp"
    _same_curve(_train(root, sp_dir, 2, *tp2, "parallel.sequence_parallel=true"), base, case)
    assert _sequence_parallel_was_on(sp_dir)


@pytest.mark.slow
def test_moe_with_mtp_under_tp2_sequence_parallel_trains_like_one_process(tmp_path):
    """Qwen3-MoE (router weights marked by Megatron, experts under expert-TP 2) with one MTP
    layer (its three norms are TorchNorm too)."""
    make_model_dir(tmp_path, layers=2, moe=True)
    make_sft_data(tmp_path, 256, seed=1, name="train")
    config = write_config(tmp_path, tmp_path / "model", tmp_path / "train.jsonl",
                          model={"mtp_num_layers": 1},
                          training={"max_steps": 6, "logging_steps": 1, "global_batch_size": 8})
    one = _train(config, tmp_path / "one", 1)
    sp_dir = tmp_path / "tp2_sp"
    _same_curve(_train(config, sp_dir, 2, "parallel.tensor_model_parallel_size=2",
                       "parallel.sequence_parallel=true"), one, "moe+mtp")
    assert _sequence_parallel_was_on(sp_dir)
