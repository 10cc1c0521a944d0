"""HFModelSpec -> Megatron-Core ``TransformerConfig``, layer spec and RoPE frequencies.

The layer spec is Megatron's local one (``get_gpt_layer_local_spec``: ColumnParallelLinear,
RowParallelLinear, torch RMSNorm, SequentialMLP experts) with ``core_attention`` swapped for the
backend :mod:`hpc_mca.models.attention` selects, so packed (THD) sequences work without
Transformer Engine, and its norms for :class:`hpc_mca.models.norm.TorchNorm` (the same torch
modules, sequence parallelism allowed). qk-norm goes through the spec's
``q_layernorm``/``k_layernorm``.

RoPE: Megatron's RotaryEmbedding hard-codes llama3's low/high frequency factors and original
context (1, 4, 8192), so the inverse frequencies are computed here from the config with the
published formulas of each rope type and installed on the model (:func:`rope_inv_freq`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hpc_mca.models.hf_config import HFModelSpec, RopeSpec
from hpc_mca.models.norm import TorchNorm
from hpc_mca.topology import Layout, megatron_pipeline_layout

if TYPE_CHECKING:  # megatron is imported lazily, inside the functions that use it
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["block_spec", "layer_spec", "rope_inv_freq", "transformer_config",
           "transformer_config_kwargs"]

_DTYPE_FLAGS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def transformer_config_kwargs(
    spec: HFModelSpec,
    layout: Layout,
    *,
    dtype: torch.dtype = torch.float32,
    gloo: bool = False,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``TransformerConfig`` reproducing ``spec`` under ``layout``.

    Dropout follows the HF config (hidden dropout 0, attention dropout as configured); fusions
    that need Apex/TE or CUDA are off. ``overrides`` replaces any key last.
    """
    kwargs: dict[str, Any] = {
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_query_groups": spec.num_query_groups,
        "kv_channels": spec.head_dim,
        "ffn_hidden_size": spec.ffn_hidden_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": spec.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": spec.qkv_bias,
        "qk_layernorm": spec.qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": spec.attention_dropout,
        "init_method_std": spec.initializer_range,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
        # No CUDA graphs; Megatron's own default ("full") is deprecated and warns on every
        # rank, while an empty list means the same thing.
        "cuda_graph_modules": [],
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        **({_DTYPE_FLAGS[dtype]: True} if dtype in _DTYPE_FLAGS else {}),
        **_parallel_kwargs(layout, gloo),
        **_moe_kwargs(spec),
    }
    kwargs.update(overrides or {})
    return kwargs


def transformer_config(
    spec: HFModelSpec,
    layout: Layout,
    *,
    dtype: torch.dtype,
    gloo: bool,
    loading: bool,
    overrides: Mapping[str, Any] | None = None,
) -> TransformerConfig:
    """Megatron's ``TransformerConfig`` for ``spec`` under ``layout``, as the ranks build it
    (its ``__post_init__`` validates the settings: ValueError/AssertionError when it refuses).

    ``loading``: weights are loaded over the parameters, so the random init is skipped and only
    the local shard is allocated. Random init builds each full weight on CPU and slices it,
    which makes initial weights identical for every TP size (tests/test_rank_bootstrap.py)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    init = {"use_cpu_initialization": not loading, "perform_initialization": not loading}
    kwargs = transformer_config_kwargs(spec, layout, dtype=dtype, gloo=gloo,
                                       overrides={**init, **(overrides or {})})
    return TransformerConfig(**kwargs)


def _parallel_kwargs(layout: Layout, gloo: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": layout.vp,
        "context_parallel_size": layout.cp,
        "expert_model_parallel_size": layout.ep,
        "expert_tensor_parallel_size": layout.etp,
        # Off unless the run asks (parallel.sequence_parallel, through ``overrides``).
        "sequence_parallel": False,
        # Over gloo, batched isend/irecv silently trains interleaved pipelines on wrong data
        # (measured with PP2 x VP2); unbatched p2p is correct.
        "batch_p2p_comm": not gloo,
    }
    if layout.cp > 1:
        # Megatron's default is "p2p", which only TE implements; all_gather runs on every
        # backend (config: parallel.cp_comm_type).
        kwargs["cp_comm_type"] = "all_gather"
    stages = megatron_pipeline_layout(layout)
    if stages is not None:
        kwargs["pipeline_model_parallel_layout"] = stages
    return kwargs


def _moe_kwargs(spec: HFModelSpec) -> dict[str, Any]:
    """Softmax top-k routing, dropless. Renormalised top-k (Mixtral, norm_topk_prob) equals a
    softmax over the top-k logits (``moe_router_pre_softmax=False``); otherwise the softmax
    over all experts comes first and the top-k probabilities are used as they are."""
    if not spec.is_moe:
        return {}
    return {
        "num_moe_experts": spec.num_experts,
        "moe_router_topk": spec.moe_router_topk,
        "moe_ffn_hidden_size": spec.moe_ffn_hidden_size,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not spec.moe_renormalize_topk,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": spec.router_aux_loss_coef,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
    }


def layer_spec(spec: HFModelSpec, core_attention: type[MegatronModule] | ModuleSpec) -> ModuleSpec:
    """Megatron's local GPT layer spec for ``spec`` with ``core_attention`` and the norms
    (:class:`TorchNorm`, which runs under sequence parallelism) swapped in."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer = get_gpt_layer_local_spec(
        num_experts=spec.num_experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=spec.qk_norm,
        normalization="RMSNorm",
    )
    layer.submodules.input_layernorm = TorchNorm
    layer.submodules.pre_mlp_layernorm = TorchNorm
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = core_attention
    if spec.qk_norm:
        # Head-split, not sequence-split, under TP: finalize_model_grads sums their gradients
        # over TP by name (q_layernorm/k_layernorm) whatever the mark; one sum either way.
        attention.q_layernorm = attention.k_layernorm = TorchNorm
    return layer


def block_spec(layer: ModuleSpec, config: TransformerConfig, vp_stage: int | None) -> TransformerBlockSubmodules:
    """The decoder block of one model chunk: ``layer`` repeated for the layers this chunk
    builds, and the layer's own RMSNorm as the final norm (Megatron would otherwise pick
    TE/Apex norms when those are installed, changing parameter types between machines)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=layer.submodules.input_layernorm
    )


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim / 2] (float32) as transformers computes them.

    default: ``1 / theta^(2i/d)``; linear: divided by ``factor``; llama3: low frequencies
    (wavelength above ``original_max / low_freq_factor``) divided by ``factor``, high ones kept,
    and a linear blend in between.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type != "llama3":
        return inv_freq
    context = rope.original_max_position_embeddings
    low_wavelen = context / rope.low_freq_factor
    high_wavelen = context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)
