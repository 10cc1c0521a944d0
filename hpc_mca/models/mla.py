"""Multi-latent attention (DeepSeek-V2/V3) on Megatron-Core's ``MLASelfAttention``.

Megatron builds the attention itself (down/up projections, the latents' norms, its own rope
with DeepSeek's interleaved rows and yarn mscale, the softmax scale); the layer spec is
:func:`hpc_mca.models.megatron_config.layer_spec`. One case needs a class of its own:

* a model without a query latent (``q_lora_rank: null``, DeepSeek-V2-Lite): Megatron's norm
  resolver, with ``qk_layernorm`` on (which MLA uses for the key/value latent's norm), turns
  ``linear_q_proj`` into a fused norm + linear whether or not there is a query norm to fuse,
  and only Transformer Engine has one. transformers applies no norm before ``q_proj``, so
  :class:`PlainQueryMLASelfAttention` keeps the spec's plain linear there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

if TYPE_CHECKING:
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = ["PlainQueryMLASelfAttention"]


class PlainQueryMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` of a model without a query latent: ``q_proj`` as a plain column
    linear, no query norm, the key/value latent's norm as the spec gives it."""

    def _resolve_qk_norm_config(self, submodules: MLASelfAttentionSubmodules
                                ) -> dict[str, ModuleSpec | type]:
        return {"linear_q_proj": submodules.linear_q_proj, "linear_q_up_proj": IdentityOp,
                "linear_kv_up_proj": submodules.linear_kv_up_proj, "q_layernorm": IdentityOp,
                "kv_layernorm": submodules.kv_layernorm}
