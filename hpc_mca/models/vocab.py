"""``model.resize_vocab``: grow the embedding rows for the tokens a template added, as
LLaMA-Factory 0.9.5 does (``model_utils/embedding.py::resize_embedding_layer``).

What LLaMA-Factory does, and hence the numbers here: when ``len(tokenizer)`` exceeds the
embedding's rows it calls transformers' ``resize_token_embeddings(len(tokenizer),
pad_to_multiple_of=64)`` (``mean_resizing`` left True) and then overwrites every new row, of the
input embedding and of an untied output layer, with the old rows' mean plus Gaussian noise of
std ``1/sqrt(hidden)`` (its ``noise_init``). The values transformers' resize draws are thus
discarded, but its draws advance the global generator first: a new ``nn.Embedding`` (and
``nn.Linear`` for an untied head) initialises its whole matrix, and mean-resizing samples one
multivariate normal vector per new row when ``1e-9 × covariance`` of the old rows is positive
definite. :func:`grown_rows` makes the same draws, in the same order and dtypes, from a
generator seeded with the run's seed, so its rows equal LLaMA-Factory's after
``torch.manual_seed(seed)`` on the CPU, and every rank (whatever its tensor-parallel shard)
and every resume computes the same rows from the full old matrices.

The grown size of a run is recorded per model directory once the run's checks found it
(:func:`hpc_mca.models.vocab_growth.record_vocab_growth`); both backends and the export read it
from there.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hpc_mca.models.vocab_growth import VocabGrowth

__all__ = ["PAD_TO_MULTIPLE_OF", "grow_hf_model", "grown_rows", "grown_size"]

PAD_TO_MULTIPLE_OF = 64
"""LLaMA-Factory's ``pad_to_multiple_of`` for the grown embedding."""
_COVARIANCE_SCALE = 1e-9
"""transformers' mean-resizing samples from ``N(mean, 1e-9 × covariance)``."""


def grown_size(tokens: int, vocab_size: int) -> int:
    """The embedding rows for a tokenizer of ``tokens`` tokens: ``vocab_size`` when they fit,
    else ``tokens`` rounded up to a multiple of 64."""
    if tokens <= vocab_size:
        return vocab_size
    return -(-tokens // PAD_TO_MULTIPLE_OF) * PAD_TO_MULTIPLE_OF


def _mean_resizing_draws(old: torch.Tensor, added: int, generator: torch.Generator) -> None:
    """The draws of transformers' mean-resizing of ``old`` (values unused: LLaMA-Factory
    overwrites them): one standard normal per element of the new rows, only when its
    distribution exists (the scaled covariance passes torch's positive-definite check)."""
    from torch.distributions import constraints

    weight = old.to(torch.float32)
    centered = weight - weight.mean(dim=0)
    covariance = centered.T @ centered / weight.shape[0]
    if bool(constraints.positive_definite.check(_COVARIANCE_SCALE * covariance).all()):
        torch.empty((added, weight.shape[1]), dtype=torch.float32).normal_(generator=generator)


def _noisy_mean(old: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """``old`` grown to ``size`` rows: the new ones the old rows' mean plus N(0, 1/sqrt(hidden))."""
    added, hidden = size - old.shape[0], old.shape[1]
    noise = torch.empty((added, hidden), dtype=old.dtype).normal_(0.0, 1.0 / math.sqrt(hidden),
                                                                   generator=generator)
    return torch.cat([old, old.mean(dim=0, keepdim=True) + noise])


def grown_rows(embedding: torch.Tensor, head: torch.Tensor | None, size: int,
               seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The input embedding and the untied output layer (None: tied) grown to ``size`` rows,
    as LLaMA-Factory grows them after ``torch.manual_seed(seed)``; computed on the CPU."""
    embedding, head = embedding.detach().cpu(), None if head is None else head.detach().cpu()
    rows, hidden = embedding.shape
    added = size - rows
    if added <= 0:
        raise ValueError(f"cannot grow {rows} embedding rows to {size}")
    generator = torch.Generator().manual_seed(seed)
    # transformers' resize: the new Embedding's own init, mean-resizing's samples
    torch.empty((size, hidden), dtype=embedding.dtype).normal_(generator=generator)
    _mean_resizing_draws(embedding, added, generator)
    if head is not None:  # the new Linear's kaiming-uniform init (a uniform draw per element)
        torch.empty((size, hidden), dtype=head.dtype).uniform_(generator=generator)
        _mean_resizing_draws(head, added, generator)
    # LLaMA-Factory's noise_init: the input embedding's rows, then the output layer's
    grown = _noisy_mean(embedding, size, generator)
    return grown, None if head is None else _noisy_mean(head, size, generator)


def _weight(module: torch.nn.Module | None) -> torch.Tensor | None:
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def grow_hf_model(model: PreTrainedModel, growth: VocabGrowth) -> None:
    """The standard backend's transformers model with its embedding (and untied output layer)
    grown as :func:`grown_rows` grows them (unless it has the rows already);
    ``config.vocab_size`` follows, so that ``save_pretrained`` writes the grown size."""
    embed = _weight(model.get_input_embeddings())
    if embed is None or growth.size <= embed.shape[0]:
        return
    head = _weight(model.get_output_embeddings())
    new_embed, new_head = grown_rows(embed, None if head is None or head is embed else head,
                                     growth.size, growth.seed)
    # transformers' resize makes the modules (and re-ties); its draws must not move this
    # process's generator, and the values are replaced just below
    with torch.random.fork_rng(devices=[]):
        model.resize_token_embeddings(growth.size, mean_resizing=False)
    with torch.no_grad():
        for module, rows in ((model.get_input_embeddings(), new_embed), (model.get_output_embeddings(), new_head)):
            weight = _weight(module)
            if rows is not None and weight is not None:
                weight.copy_(rows)
