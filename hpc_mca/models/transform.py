"""Model transforms: what happens to the built model chunks before DDP wraps them.

The seam between :func:`hpc_mca.models.build.build_model` and the trainer's DDP wrap is where
a run changes what trains and how: LoRA adapters (and freezing the base weights), freezing
layers, dtype casts. A transform takes this rank's chunks and returns the chunks to train;
it runs on every rank, after the weights are loaded, so it sees the real model.

``finetuning.finetuning_type`` selects the transform in :data:`TRANSFORMS`, one table: ``full``
(every parameter trains: the identity) and ``lora`` (peft adapters on Megatron's linears, the
rest frozen: :mod:`.lora`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from hpc_mca.config.sections import FinetuningArguments


class ModelTransform(Protocol):
    """(this rank's model chunks, the finetuning section; the HF model directory the chunks
    were built from and the run's seed) -> the chunks to train."""

    def __call__(self, chunks: list[torch.nn.Module], finetuning: FinetuningArguments, *,
                 model_path: str, seed: int) -> list[torch.nn.Module]: ...


def full(chunks: list[torch.nn.Module], finetuning: FinetuningArguments, *,
         model_path: str, seed: int) -> list[torch.nn.Module]:
    """Every parameter trains, as built."""
    return chunks


def lora(chunks: list[torch.nn.Module], finetuning: FinetuningArguments, *,
         model_path: str, seed: int) -> list[torch.nn.Module]:
    """LoRA adapters on the targeted linears; every other parameter frozen."""
    from hpc_mca.models.lora import apply_lora

    return apply_lora(chunks, finetuning, model_path=model_path, seed=seed)


TRANSFORMS: dict[str, ModelTransform] = {"full": full, "lora": lora}


def transform_model(chunks: list[torch.nn.Module], finetuning: FinetuningArguments, *,
                    model_path: str, seed: int) -> list[torch.nn.Module]:
    """Apply the transform ``finetuning.finetuning_type`` selects."""
    return TRANSFORMS[finetuning.finetuning_type](chunks, finetuning, model_path=model_path,
                                                  seed=seed)
