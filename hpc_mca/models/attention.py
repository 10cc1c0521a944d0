"""Core attention modules for Megatron layer specs: Transformer Engine, flash-attn, or PyTorch.

:mod:`.attention_backend` chooses the backend (``auto``: TE, else flash-attn, else torch);
``core_attention_class`` turns the choice into what a Megatron layer spec takes as
``SelfAttentionSubmodules.core_attention``.

The torch backend, :class:`TorchCoreAttention`, takes the constructor and ``forward`` arguments
of Megatron's local ``DotProductAttention`` (megatron-core 0.19.2) and adds what that class
lacks: THD packed sequences (``packed_seq_params.qkv_format == "thd"``, tensors ``[t, heads,
dim]``) with attention confined to each document, padded ``cu_seqlens_*_padded`` layouts, and a
bool mask path that never produces empty softmax rows. GQA and ``softmax_scale`` behave as in
Megatron. Under context parallelism (``config.context_parallel_size > 1``) causal attention
runs through :mod:`.context_parallel` with ``cp_comm_type`` "all_gather" or "a2a". Sliding
windows, softmax offsets, attention bias, non-causal masks under CP and CP on the flash backend
are refused with a ValueError rather than silently ignored.

The packed-sequence kernel (layout, mask, segments) lives in :mod:`.packed_attention`,
which also explains how context parallelism fits in.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Optional, TypeGuard

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

from hpc_mca.models.attention_backend import check_context_parallel, select_attention_backend
from hpc_mca.models.context_parallel import (
    context_parallel_attention,
    cp_comm_violations,
)
from hpc_mca.models.packed_attention import (
    DEFAULT_SEGMENT_TOKENS,
    Segment,
    TokenLayout,
    attention_allowed,
    packed_attention,
    packed_layout,
    plan_segments,
    sdpa,
)
from hpc_mca.models.packed_kernels import (
    PACKED_KERNELS,
    flex_packed_attention,
    packed_plan,
    varlen_packed_attention,
)

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from torch.distributed import ProcessGroup

__all__ = [
    "DEFAULT_SEGMENT_TOKENS",
    "FlashCoreAttention",
    "Segment",
    "TokenLayout",
    "TorchCoreAttention",
    "attention_allowed",
    "core_attention_class",
    "packed_attention",
    "packed_layout",
    "plan_segments",
    "sdpa",
]

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


class _CoreAttentionBase(MegatronModule):
    """Constructor shared by the non-TE backends; mirrors megatron's DotProductAttention."""

    backend_name = ""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        super().__init__(config=config)
        self._refuse_unsupported(config, layer_number)
        # Multi-latent attention passes its query/key and value head widths (they differ:
        # the kernels here take any widths, flash-attn 2 does not and refuses below).
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type
        self.pg_collection = pg_collection
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # scores back inside the softmax in Megatron: the net scale is unchanged.
        self.softmax_scale = (
            1.0 / math.sqrt(self.k_channels) if softmax_scale is None else softmax_scale
        )
        self.dropout_p = float(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def _refuse_unsupported(self, config: TransformerConfig, layer_number: int) -> None:
        name = f"{self.backend_name} attention backend"
        if config.context_parallel_size != 1 and self.backend_name != "torch":
            raise ValueError(
                f"config.context_parallel_size={config.context_parallel_size}: the {name} "
                "does not implement context parallelism; use the 'torch' or 'te' backend"
            )
        window, skip = config.window_size, config.window_attn_skip_freq
        if is_layer_window_attention(window, skip, layer_number):
            raise ValueError(f"config.window_size={window} is not supported by the {name}")
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"config.softmax_type={config.softmax_type!r} is not supported by the {name} "
                "(only 'vanilla')"
            )

    def _mask_type(self, attn_mask_type: Optional[AttnMaskType]) -> AttnMaskType:
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type == AttnMaskType.arbitrary:
            return AttnMaskType.padding  # "arbitrary" = apply the given mask as it is
        return mask_type

    def _dropout(self) -> tuple[float, contextlib.AbstractContextManager[Any]]:
        """Dropout probability for this call and the RNG context to draw it in.

        Like Megatron, draws from the model-parallel RNG tracker unless sequence parallelism is
        on; if that tracker was never seeded (no model_parallel_cuda_manual_seed), the default
        generator is used instead of failing.
        """
        p = self.dropout_p if self.training else 0.0
        if p == 0.0 or self.config.sequence_parallel:
            return p, contextlib.nullcontext()
        tracker = tensor_parallel.get_cuda_rng_tracker()
        seeded = "model-parallel-rng" in (getattr(tracker, "get_states", dict)() or {})
        if seeded or getattr(tracker, "is_inference_rng_tracker", False):
            return p, tracker.fork()
        return p, contextlib.nullcontext()

    @staticmethod
    def _is_thd(packed_seq_params: Optional[PackedSeqParams]) -> TypeGuard[PackedSeqParams]:
        return packed_seq_params is not None and packed_seq_params.qkv_format == "thd"


class TorchCoreAttention(_CoreAttentionBase):
    """Pure-PyTorch core attention; a drop-in for Megatron's local ``DotProductAttention``.

    Inputs follow megatron/core/transformer/attention.py: ``[s, b, heads, dim]`` (sbhd) with
    ``attention_mask`` bool, True = masked, broadcastable to ``[b, heads, sq, sk]``; or, for
    ``packed_seq_params.qkv_format == "thd"``, ``[t, heads, dim]`` (a size-1 batch dimension at
    position 1 is accepted too) with documents described by ``cu_seqlens_q/kv`` and optionally
    ``cu_seqlens_q/kv_padded``; ``attention_mask`` is ignored there, as in TE. Keys/values may
    have fewer heads (GQA). Returns ``[s, b, heads * dim]`` or ``[t, heads * dim]``; padding
    slots of a packed stream come back as zeros.

    Causal mask types add causality to any given mask (a causal mask OR-ed with itself is
    unchanged, so Megatron's ltor masks work as before); padding/arbitrary/no_mask apply the
    given mask alone.
    """

    backend_name = "torch"

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        *,
        segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
        packed_kernel: str = "sdpa",
    ):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection, k_channels, v_channels)
        if packed_kernel not in PACKED_KERNELS:
            raise ValueError(f"packed_kernel={packed_kernel!r} is not one of {PACKED_KERNELS}")
        self.segment_tokens = segment_tokens
        self.packed_kernel = packed_kernel
        """THD kernel (see packed_kernels); the caller resolved it with resolve_packed_kernel."""
        self.cp_group = self._context_parallel_group()

    def _context_parallel_group(self) -> Optional[ProcessGroup]:
        """The CP group when ``context_parallel_size > 1`` (checking ``cp_comm_type`` against
        this layer's local key/value heads), else None."""
        config = self.config
        cp = config.context_parallel_size
        if cp == 1:
            return None
        # Megatron's multi-latent attention builds a first core attention without the layer's
        # cp_comm_type (and replaces it): the config's then, and Megatron's default "p2p" last.
        comm = self.cp_comm_type or config.cp_comm_type or "p2p"
        if isinstance(comm, list):  # one per layer
            comm = comm[self.layer_number - 1]
        self.cp_comm_type = comm
        check_context_parallel(self.backend_name, cp, comm)
        problems = cp_comm_violations(comm, cp,
                                      config.num_query_groups // config.tensor_model_parallel_size)
        if problems:
            raise ValueError(problems[0])
        if self.attn_mask_type not in _CAUSAL_TYPES or self.attn_mask_type == (
            AttnMaskType.causal_bottom_right
        ):
            raise ValueError(
                f"attn_mask_type={self.attn_mask_type.name} under context parallelism: the torch "
                "backend runs causal (top-left) attention only there"
            )
        if self.pg_collection is not None and getattr(self.pg_collection, "cp", None) is not None:
            return self.pg_collection.cp
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the torch attention backend")
        mask_type = self._mask_type(attn_mask_type)
        dropout_p, rng = self._dropout()
        with rng:
            if self.cp_group is not None:
                return self._forward_cp(query, key, value, attention_mask, packed_seq_params,
                                        dropout_p)
            if self._is_thd(packed_seq_params):
                return self._forward_thd(query, key, value, mask_type, packed_seq_params, dropout_p)
            return self._forward_sbhd(query, key, value, attention_mask, mask_type, dropout_p)

    def _forward_cp(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        params: Optional[PackedSeqParams],
        dropout_p: float,
    ) -> Tensor:
        """Causal attention of this CP rank's chunks over whole sequences.

        THD: the tensors hold this rank's chunks of the stream ``params`` describes (global
        ``cu_seqlens``, as TE takes them). sbhd: every row holds this rank's two chunks of that
        row; the rows are read as one stream of equal-length documents (padding sits after the
        real tokens of a row, so causality alone keeps it out of them).
        """
        group, comm = self.cp_group, self.cp_comm_type
        # Both set when forward gets here: _context_parallel_group refused a missing comm type.
        assert group is not None and comm is not None

        def attend(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, cu_pad: Tensor) -> Tensor:
            return context_parallel_attention(q, k, v, cu, cu_pad, group, comm_type=comm,
                                              scale=self.softmax_scale, dropout_p=dropout_p,
                                              segment_tokens=self.segment_tokens)

        cp = self.config.context_parallel_size
        if self._is_thd(params):
            if query.dim() == 4:
                query, key, value = (x.squeeze(1) for x in (query, key, value))
            cu = _first(params.cu_seqlens_q)
            cu_pad = _first(params.cu_seqlens_q_padded, cu)
            ctx = attend(query, key, value, cu, cu_pad)
            return ctx.reshape(ctx.size(0), -1)
        if attention_mask is not None:
            raise ValueError("an explicit attention_mask under context parallelism is not "
                             "supported by the torch backend (causal masks only)")
        s, b = query.size(0), query.size(1)
        cu = torch.arange(b + 1, dtype=torch.int64) * (s * cp)
        q, k, v = (x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (query, key, value))
        ctx = attend(q, k, v, cu, cu)
        return ctx.reshape(b, s, -1).transpose(0, 1)

    def _forward_sbhd(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        mask_type: AttnMaskType,
        dropout_p: float,
    ) -> Tensor:
        sq, sk = query.size(0), key.size(0)
        causal = mask_type in _CAUSAL_TYPES and sq > 1
        bottom_right = mask_type == AttnMaskType.causal_bottom_right and sq != sk
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if attention_mask is None and not bottom_right:
            ctx = sdpa(q, k, v, is_causal=causal, scale=self.softmax_scale, dropout_p=dropout_p)
        else:
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=query.device)
            if causal:
                allowed = allowed.tril(diagonal=sk - sq if bottom_right else 0)
            if attention_mask is not None:
                allowed = allowed & ~attention_mask.to(device=query.device, dtype=torch.bool)
            allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
            ctx = sdpa(q, k, v, allowed=allowed, scale=self.softmax_scale, dropout_p=dropout_p)
        # [b, h, s, d] -> [s, b, h * d]
        return ctx.permute(2, 0, 1, 3).reshape(sq, query.size(1), -1)

    def _forward_thd(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask_type: AttnMaskType,
        params: PackedSeqParams,
        dropout_p: float,
    ) -> Tensor:
        if query.dim() == 4:  # [t, 1, h, d] from a caller that did not squeeze the batch dim
            query, key, value = (x.squeeze(1) for x in (query, key, value))
        plan = packed_plan(params, query.size(0), key.size(0))
        fused = (self.packed_kernel != "sdpa" and plan.self_attention and dropout_p == 0.0
                 and mask_type in _CAUSAL_TYPES and mask_type != AttnMaskType.causal_bottom_right)
        if fused and self.packed_kernel == "varlen":
            ctx = varlen_packed_attention(query, key, value, plan, scale=self.softmax_scale)
        elif fused:
            ctx = flex_packed_attention(query, key, value, plan, scale=self.softmax_scale)
        else:
            segments = plan.on(f"segments/{self.segment_tokens}", torch.device("cpu"),
                               lambda: plan_segments(plan.q_layout, plan.kv_layout,
                                                     self.segment_tokens))
            ctx = packed_attention(
                query, key, value, plan.q_layout, plan.kv_layout,
                causal=mask_type in _CAUSAL_TYPES,
                bottom_right=mask_type == AttnMaskType.causal_bottom_right,
                scale=self.softmax_scale, dropout_p=dropout_p, segments=segments,
            )
        return ctx.reshape(ctx.size(0), -1)


def _first(*tensors: Optional[Tensor]) -> Tensor:
    found = next((t for t in tensors if t is not None), None)
    if found is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is required for qkv_format 'thd'")
    return found


class FlashCoreAttention(_CoreAttentionBase):
    """Core attention through flash-attn 2 (``flash_attn_func`` / ``flash_attn_varlen_func``).

    Needs CUDA and the flash_attn package; untested on the CPU machines this project is
    developed on. Supports causal or unmasked sbhd attention (a given ``attention_mask`` is
    ignored for causal types, as TE does; padding masks are refused) and THD packed sequences.
    With ``cu_seqlens_*_padded`` the padded ranges are handed to the kernel as the documents:
    causality keeps a document's trailing padding out of its real tokens, so this is refused
    for non-causal attention. Slots after the last document are returned as zeros.
    """

    backend_name = "flash"

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection, k_channels, v_channels)
        if self.k_channels != self.v_channels:
            raise ValueError(f"attention backend 'flash': query/key heads {self.k_channels} wide "
                             f"and value heads {self.v_channels} wide (multi-latent attention) "
                             "are not supported; use the 'torch' or 'te' backend")
        try:
            from flash_attn import flash_attn_func, flash_attn_varlen_func
        except ImportError as err:
            raise ValueError(f"attention backend 'flash' needs flash_attn: {err}") from err
        self._flash_attn_func = flash_attn_func
        self._flash_attn_varlen_func = flash_attn_varlen_func

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the flash attention backend")
        mask_type = self._mask_type(attn_mask_type)
        causal = mask_type in _CAUSAL_TYPES
        dropout_p, rng = self._dropout()
        with rng:
            if self._is_thd(packed_seq_params):
                return self._forward_thd(query, key, value, causal, packed_seq_params, dropout_p)
            if attention_mask is not None and not causal:
                raise ValueError(
                    f"attn_mask_type={mask_type.name} with an attention_mask is not supported by "
                    "the flash attention backend; pack sequences (thd) or use 'torch'/'te'"
                )
            q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s, h, d]
            ctx = self._flash_attn_func(
                q, k, v, dropout_p=dropout_p, softmax_scale=self.softmax_scale, causal=causal
            )
            return ctx.transpose(0, 1).reshape(query.size(0), query.size(1), -1)

    def _forward_thd(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        causal: bool,
        params: PackedSeqParams,
        dropout_p: float,
    ) -> Tensor:
        if query.dim() == 4:
            query, key, value = (x.squeeze(1) for x in (query, key, value))
        cu_q = _first(params.cu_seqlens_q_padded, params.cu_seqlens_q)
        cu_kv = _first(params.cu_seqlens_kv_padded, params.cu_seqlens_kv, cu_q)
        padded = params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None
        if padded and not causal:
            raise ValueError(
                "cu_seqlens_*_padded needs causal attention on the flash backend "
                "(padding would leak into real tokens); use the 'torch' or 'te' backend"
            )
        max_q = params.max_seqlen_q or int((cu_q[1:] - cu_q[:-1]).max())
        max_kv = params.max_seqlen_kv or int((cu_kv[1:] - cu_kv[:-1]).max())
        ctx = self._flash_attn_varlen_func(
            query,
            key,
            value,
            cu_q.to(torch.int32),
            cu_kv.to(torch.int32),
            max_q,
            max_kv,
            dropout_p=dropout_p,
            softmax_scale=self.softmax_scale,
            causal=causal,
        )
        # Out of place: the kernel keeps its output for the backward pass.
        after_last = torch.arange(ctx.size(0), device=ctx.device) >= int(cu_q[-1])
        return ctx.masked_fill(after_last[:, None, None], 0.0).reshape(ctx.size(0), -1)


def core_attention_class(preference: str = "auto", packed_kernel: str = "sdpa"
                         ) -> type[MegatronModule] | ModuleSpec:
    """The Megatron layer-spec ``core_attention`` for the selected backend: a class, or for the
    torch backend with a fused packed kernel (see :mod:`.packed_kernels`) a ModuleSpec that
    hands the kernel to every layer."""
    backend = select_attention_backend(preference)
    if backend == "te":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    if backend == "flash":
        return FlashCoreAttention
    if packed_kernel == "sdpa":
        return TorchCoreAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=TorchCoreAttention, params={"packed_kernel": packed_kernel})
