"""``model.fusions: [layer]``: each decoder layer under torch.compile.

Without Transformer Engine a decoder layer runs its elementwise work as separate kernels
around the GEMMs: two RMSNorms, two residual adds, the SwiGLU halves, RoPE's steps, the
reshapes between them. Each reads and writes whole activations, so on a GPU they cost memory
bandwidth out of proportion to their arithmetic. Compiled, inductor fuses the work between
the GEMMs into fewer kernels (the ``swiglu`` and ``rope`` fusions each cover one piece).

Two things stay out of the compiled graphs (dynamo breaks the graph there and runs them
eagerly between the compiled pieces):

* the core-attention module: its kernels are fused already, and on packed rows it plans each
  micro-batch on the host (document boundaries read with ``.tolist()``, the plan cached on
  the ``PackedSeqParams`` object), which dynamo would specialise on or trip over;
* RoPE's per-micro-batch position cache (``hpc_mca.models.rope``), marked there.

``nn.Module.compile`` compiles in place: module types and parameter names stay, so
checkpoints, LoRA, DDP and the optimizer see the same model. The first micro-batch pays for
the compilation (tens of seconds); the layers share the compiled code (dynamo treats a
module's parameters as graph inputs), and a new micro-batch shape compiles once more with
dynamic shapes (torch.compile's default).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # megatron is imported by the module that builds the chunks
    from megatron.core.models.gpt.gpt_model import GPTModel

__all__ = ["compile_layers"]


def compile_layers(chunks: list[GPTModel]) -> None:
    """Compile every decoder layer of ``chunks`` (Megatron GPTModels, before DDP wraps them)
    with its core attention left eager."""
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            attention = getattr(getattr(layer, "self_attention", None), "core_attention", None)
            if attention is not None:
                # This model's attention only, whichever backend built it; bound as a method so
                # that a deep copy of the model calls its own attention.
                eager = torch.compiler.disable(type(attention).forward)
                attention.forward = types.MethodType(eager, attention)
            layer.compile()
