"""The layer norm of hpc-mca's Megatron layer specs: torch's RMSNorm/LayerNorm, sequence
parallelism included.

Megatron-Core's local spec norm (``WrappedTorchNorm``) builds the same torch modules but
refuses ``config.sequence_parallel``: under TP sequence parallelism each tensor-parallel rank
normalises only its slice of the sequence, so the norm weights' gradients are partial sums
that must be added up over the TP group. Megatron's fused norms (Apex ``FusedLayerNorm``,
TE's ``TENorm``) only mark their parameters for that: ``finalize_model_grads`` all-reduces
(sum) over TP the gradients of every parameter whose ``sequence_parallel`` attribute is true
when ``config.sequence_parallel`` is on. :class:`TorchNorm` does the same with torch's
modules, so the local spec runs sequence-parallel without Apex or Transformer Engine.

The module it returns is a plain ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm`` (the type the
local spec has always built): parameter names, checkpoints, HF weight mapping and
``torch.compile`` of the decoder layers see no difference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # megatron is imported lazily, inside the functions that use it
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["TorchNorm"]

_MODULES = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}


class TorchNorm:
    """Megatron's norm builder protocol (``config``, ``hidden_size``, ``eps``): a torch norm
    whose parameters carry ``sequence_parallel = config.sequence_parallel``.

    A class, not a function, because Megatron's ``build_module`` returns functions as they are
    instead of calling them; ``__new__`` returns the torch module itself.
    """

    # The type: ignore: Megatron calls the class, and __new__ hands back the torch module (above).
    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,  # type: ignore[misc]
                **_unused: object) -> torch.nn.Module:
        # The keyword arguments Megatron passes besides these duplicate config fields. The two
        # that change the numbers are refused; persist_layer_norm only picks an Apex kernel.
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("layernorm_zero_centered_gamma and memory_efficient_layer_norm "
                             "need Transformer Engine or Apex norms, not torch's")
        module_class = _MODULES.get(config.normalization)
        if module_class is None:
            raise ValueError(f"normalization={config.normalization!r}: torch norms are "
                             f"{', '.join(_MODULES)}")
        # No dtype: like Megatron's torch norm, float32 until the model is cast as a whole.
        norm = module_class(hidden_size, eps=eps)
        for param in norm.parameters():
            # Read by finalize_model_grads: summed over TP under sequence parallelism.
            param.sequence_parallel = config.sequence_parallel
        return norm
