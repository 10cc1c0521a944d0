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

    def get_input_embeddings(self) -> torch.nn.Module | None:
        """The word embedding (first pipeline stage only; None elsewhere)."""
        return self.embedding.word_embeddings if self.pre_process else None
