"""``McaGPTModel``: the GPT chunk this package builds, Megatron-Core's ``GPTModel`` with the
model methods a transformers or ROLL script calls on a chunk (``model[0]``).

Imported by :mod:`.build` when it builds (megatron is imported here, at module level)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["McaGPTModel"]


class McaGPTModel(GPTModel):
    """Megatron's GPTModel; its parameters, state dict and forward are GPTModel's."""

    _require_grads_hook: RemovableHandle | None = None

    def enable_input_require_grads(self) -> None:
        """Make the embedding's output require grad (transformers' method of the same name):
        with the embedding frozen (LoRA), activation recomputation still gets a graph to
        backpropagate into the layers' adapters. Only the first pipeline stage embeds."""
        if self.pre_process and self._require_grads_hook is None:
            def require_grads(module: torch.nn.Module, args: tuple[object, ...], output: torch.Tensor) -> None:
                output.requires_grad_(True)

            self._require_grads_hook = self.embedding.register_forward_hook(require_grads)

    def disable_input_require_grads(self) -> None:
        """Undo :meth:`enable_input_require_grads`."""
        if self._require_grads_hook is not None:
            self._require_grads_hook.remove()
            self._require_grads_hook = None

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token loss ``[b, s]`` of ``logits`` ``[s, b, vocab / TP]``: with the
        cross-entropy fusion on, :mod:`.cross_entropy`'s (Megatron's fused one keeps an fp32
        softmax of the logits' size); otherwise Megatron's own."""
        if not self.config.cross_entropy_loss_fusion:
            return super().compute_language_model_loss(labels, logits)
        from .cross_entropy import vocab_parallel_cross_entropy

        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()

    def get_input_embeddings(self) -> torch.nn.Module | None:
        """The word embedding (first pipeline stage only; None elsewhere)."""
        return self.embedding.word_embeddings if self.pre_process else None
