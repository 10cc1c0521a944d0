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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hpc_mca.models.hf_config import HFModelSpec
from hpc_mca.models.hf_rope import RopeSpec
from hpc_mca.models.norm import TorchNorm
from hpc_mca.topology import Layout, megatron_pipeline_layout

if TYPE_CHECKING:  # megatron is imported lazily, inside the functions that use it
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["LayerSpecs", "block_spec", "layer_spec", "layer_specs", "rope_inv_freq",
           "transformer_config", "transformer_config_kwargs"]

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
    if spec.mrope_section:
        kwargs["mrope_section"] = list(spec.mrope_section)  # Megatron's multimodal rope
    if spec.mla is not None:
        _use_mla(kwargs, spec)
    elif spec.rope.attention_factor != 1.0:
        # transformers multiplies cos and sin by the yarn attention factor, so q.k by its
        # square; the same product through the softmax scale (full rotary only: hf_config).
        kwargs["softmax_scale"] = spec.rope.attention_factor**2 / math.sqrt(spec.head_dim)
    kwargs.update(overrides or {})
    return kwargs


def _use_mla(kwargs: dict[str, Any], spec: HFModelSpec) -> None:
    """Megatron's multi-latent attention for ``spec.mla``: it builds its own rope (interleaved
    rows, as DeepSeek stores them; yarn with DeepSeek's mscale pair) and its softmax scale."""
    mla, rope = spec.mla, spec.rope
    assert mla is not None
    for key in ("num_query_groups", "kv_channels"):
        kwargs.pop(key)  # one latent for every head; head widths below
    kwargs.update(
        multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        qk_layernorm=True,  # MLA's meaning: the norms of the q and kv latents
        rope_type="yarn" if rope.type == "yarn" else "rope", rotary_base=rope.theta,
        rotary_percent=1.0, rotary_interleaved=False,
        rotary_scaling_factor=rope.factor, original_max_position_embeddings=(
            rope.original_max_position_embeddings),
        beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, mscale=rope.mscale,
        mscale_all_dim=rope.mscale_all_dim,
        # The q-norm resolver would otherwise look for Transformer Engine's fused layers.
        transformer_impl="local",
    )


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
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    init = {"use_cpu_initialization": not loading, "perform_initialization": not loading}
    kwargs = transformer_config_kwargs(spec, layout, dtype=dtype, gloo=gloo,
                                       overrides={**init, **(overrides or {})})
    return (MLATransformerConfig if spec.mla is not None else TransformerConfig)(**kwargs)


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
    """Dropless top-k routing as the family's transformers code routes.

    softmax: renormalised top-k (Mixtral, norm_topk_prob) equals a softmax over the top-k
    logits (``moe_router_pre_softmax=False``); otherwise the softmax over all experts comes
    first and the top-k probabilities are used as they are. sigmoid (glm4_moe): the expert
    bias steers the choice only, weights are renormalised and scaled; the bias stays as loaded
    (transformers never updates it), and the router runs in float32 as transformers' does.
    """
    if not spec.is_moe:
        return {}
    kwargs: dict[str, Any] = {
        "num_moe_experts": spec.num_experts,
        "moe_router_topk": spec.moe_router_topk,
        "moe_ffn_hidden_size": spec.moe_ffn_hidden_size,
        "moe_router_score_function": spec.moe_score_function,
        "moe_router_pre_softmax": not spec.moe_renormalize_topk,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": spec.router_aux_loss_coef,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_layer_freq": [int(spec.is_moe_layer(i)) for i in range(spec.num_layers)],
    }
    if spec.shared_expert_ffn_hidden_size:
        kwargs["moe_shared_expert_intermediate_size"] = spec.shared_expert_ffn_hidden_size
        kwargs["moe_shared_expert_gate"] = spec.shared_expert_gate
    if spec.moe_score_function == "sigmoid":
        kwargs.update(moe_router_pre_softmax=False, moe_router_enable_expert_bias=True,
                      moe_router_bias_update_rate=0.0, moe_router_dtype="fp32")
        if not spec.router_aux_loss_coef:
            kwargs["moe_router_load_balancing_type"] = "none"
    if spec.moe_topk_scaling_factor != 1.0:
        kwargs["moe_router_topk_scaling_factor"] = spec.moe_topk_scaling_factor
    if spec.moe_num_groups:
        kwargs["moe_router_num_groups"] = spec.moe_num_groups
        kwargs["moe_router_group_topk"] = spec.moe_group_topk
    return kwargs


@dataclass(frozen=True)
class LayerSpecs:
    """The decoder layer specs of one model: ``moe`` for layers with routed experts, ``dense``
    for the rest (both the same spec in a model without dense layers)."""

    dense: ModuleSpec
    moe: ModuleSpec
    dense_layers: tuple[int, ...] = ()

    def of(self, layer: int) -> ModuleSpec:
        """The spec of 0-based model-wide ``layer``."""
        return self.dense if layer in self.dense_layers else self.moe


def layer_specs(spec: HFModelSpec, core_attention: type[MegatronModule] | ModuleSpec) -> LayerSpecs:
    """The decoder layer specs of ``spec`` (:func:`layer_spec` with and without experts)."""
    moe = layer_spec(spec, core_attention)
    if not spec.dense_layers:
        return LayerSpecs(dense=moe, moe=moe)
    dense = layer_spec(spec, core_attention, experts=False)
    return LayerSpecs(dense=dense, moe=moe, dense_layers=spec.dense_layers)


def layer_spec(spec: HFModelSpec, core_attention: type[MegatronModule] | ModuleSpec, *,
               experts: bool = True) -> ModuleSpec:
    """Megatron's local GPT layer spec for ``spec`` with ``core_attention`` and the norms
    (:class:`TorchNorm`, which runs under sequence parallelism) swapped in; ``experts``:
    the MoE block for an MoE model (False: its dense MLP)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer = get_gpt_layer_local_spec(
        num_experts=(spec.num_experts or None) if experts else None,
        moe_grouped_gemm=False,
        qk_layernorm=spec.qk_norm or spec.mla is not None,
        multi_latent_attention=spec.mla is not None,
        normalization="RMSNorm",
    )
    layer.submodules.input_layernorm = TorchNorm
    layer.submodules.pre_mlp_layernorm = TorchNorm
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = core_attention
    if spec.mla is not None:
        _mla_norms(layer, spec.mla.q_lora_rank is not None)
        return layer
    if spec.qk_norm:
        # Head-split, not sequence-split, under TP: finalize_model_grads sums their gradients
        # over TP by name (q_layernorm/k_layernorm) whatever the mark; one sum either way.
        attention.q_layernorm = attention.k_layernorm = TorchNorm
    return layer


def _mla_norms(layer: ModuleSpec, q_latent: bool) -> None:
    """The latents' RMSNorms as :class:`TorchNorm` (without a query latent there is no query
    norm) and the attention class of :mod:`hpc_mca.models.mla`."""
    from megatron.core.transformer.identity_op import IdentityOp

    from hpc_mca.models.mla import McaMLASelfAttention, PlainQueryMLASelfAttention

    attention = layer.submodules.self_attention
    attention.submodules.kv_layernorm = TorchNorm
    attention.submodules.q_layernorm = TorchNorm if q_latent else IdentityOp
    attention.module = McaMLASelfAttention if q_latent else PlainQueryMLASelfAttention


def block_spec(layers: LayerSpecs, config: TransformerConfig, vp_stage: int | None
               ) -> TransformerBlockSubmodules:
    """The decoder block of one model chunk: the spec of each model-wide layer this chunk
    builds (found as Megatron's own block spec finds them), and the layers' RMSNorm as the
    final norm (Megatron would otherwise pick TE/Apex norms when those are installed, changing
    parameter types between machines)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    stages = config.pipeline_model_parallel_layout
    if stages is not None:
        ids = list(stages.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage))
    else:
        first = get_transformer_layer_offset(config, vp_stage=vp_stage)
        ids = list(range(first, first + get_num_layers_to_build(config, vp_stage=vp_stage)))
    return TransformerBlockSubmodules(
        layer_specs=[layers.of(i) for i in ids], layer_norm=layers.moe.submodules.input_layernorm
    )


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse RoPE frequencies [rotary_dim / 2] (float32) as transformers computes them.

    default: ``1 / theta^(2i/d)`` over the rotated dimensions d; linear: divided by
    ``factor``; llama3: low frequencies (wavelength above ``original_max / low_freq_factor``)
    divided by ``factor``, high ones kept, and a linear blend in between; yarn: a ramp between
    interpolated and original frequencies over the dimensions whose rotation counts lie
    between ``beta_slow`` and ``beta_fast`` in the original context.
    """
    dim = rope.rotary_dim(head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "yarn":
        return _yarn_inv_freq(rope, dim, inv_freq)
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


def _yarn_inv_freq(rope: RopeSpec, dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        # the dimension whose frequency turns ``rotations`` times over the original context
        context = rope.original_max_position_embeddings
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return inv_freq / rope.factor * (1 - keep) + inv_freq * keep
