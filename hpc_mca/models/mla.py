"""Multi-latent attention (DeepSeek-V2/V3) on Megatron-Core's ``MLASelfAttention``.

Megatron builds the attention itself (down/up projections, the latents' norms, its own rope
with DeepSeek's interleaved rows and yarn mscale, the softmax scale); the layer spec is
:func:`hpc_mca.models.megatron_config.layer_spec`, whose attention class is one of these:

* :class:`McaMLASelfAttention` corrects one gradient of Megatron's local spec under tensor
  parallelism. There the key/value down projection is column-parallel: each rank computes its
  rows, which Megatron gathers over TP and splits into the key/value latent and the rope key.
  The rope key is one head shared by every query head, and each rank's heads add their part
  of its gradient; the gather's backward keeps each rank's own slice of that partial gradient,
  so the rope key's weights miss the other ranks' heads (measured: LoRA gradient norms off by
  5e-5 relative on TP2 against one process; 0 after the fix). Transformer Engine's spec
  duplicates the down projection instead, and Megatron's branch for that case sums the rope
  key's gradient over TP; here the gathered projection takes the same branch (sequence
  parallel), or its rope columns' gradient is summed over TP explicitly.
* :class:`PlainQueryMLASelfAttention`, for a model without a query latent
  (``q_lora_rank: null``, DeepSeek-V2-Lite): Megatron's norm resolver, with ``qk_layernorm``
  on (which MLA uses for the key/value latent's norm), turns ``linear_q_proj`` into a fused
  norm + linear whether or not there is a query norm to fuse, and only Transformer Engine has
  one. transformers applies no norm before ``q_proj``, so this keeps the spec's plain linear.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

if TYPE_CHECKING:
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from torch.distributed import ProcessGroup

__all__ = ["McaMLASelfAttention", "PlainQueryMLASelfAttention"]


class _TrailingCtx(Protocol):
    """The autograd context of :class:`_SumTrailingGrad`: torch's, carrying its arguments."""

    width: int
    group: ProcessGroup | None


class _SumTrailingGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient's last ``width`` columns over ``group``."""

    @staticmethod
    def forward(ctx: _TrailingCtx, x: torch.Tensor, width: int, group: ProcessGroup | None
                ) -> torch.Tensor:
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: _TrailingCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        trailing = grad[..., -ctx.width:].contiguous()
        torch.distributed.all_reduce(trailing, group=ctx.group)
        grad[..., -ctx.width:] = trailing
        return grad, None, None


class McaMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose rope key gets the gradient of every rank's heads."""

    def _qkv_down_projection(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        config, group = self.config, self.tp_group
        rope = config.qk_pos_emb_head_dim
        if kv_combined.size(-1) == config.kv_lora_rank + rope:
            return q_compressed, kv_combined  # not split over TP: Megatron's own path is right
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=group)
        if config.sequence_parallel:
            # This rank's sequence, as a duplicated projection gives it: Megatron then gathers
            # the rope key over the sequence, whose backward sums its gradient over TP.
            return q_compressed, scatter_to_sequence_parallel_region(kv_combined, group=group)
        return q_compressed, _SumTrailingGrad.apply(kv_combined, rope, group)


class PlainQueryMLASelfAttention(McaMLASelfAttention):
    """:class:`McaMLASelfAttention` of a model without a query latent: ``q_proj`` as a plain
    column linear, no query norm, the key/value latent's norm as the spec gives it."""

    def _resolve_qk_norm_config(self, submodules: MLASelfAttentionSubmodules
                                ) -> dict[str, ModuleSpec | type]:
        return {"linear_q_proj": submodules.linear_q_proj, "linear_q_up_proj": IdentityOp,
                "linear_kv_up_proj": submodules.linear_kv_up_proj, "q_layernorm": IdentityOp,
                "kv_layernorm": submodules.kv_layernorm}
