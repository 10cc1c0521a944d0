"""The vocabulary a run grows its model to (``model.resize_vocab``), recorded per model directory
for this process.

The run's checks record it on every rank before anything is built; everything that describes
the model afterwards (:func:`hpc_mca.models.hf_config.read_hf_config`, the weights' import, both
backends' builds and the export) reads it from here, so they agree on the grown vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class VocabGrowth:
    """This process's model directory trains with a grown vocabulary (``model.resize_vocab``)."""

    size: int
    """The grown vocab_size (the template-fixed tokenizer's length, rounded up to 64)."""
    seed: int
    """The run's seed, from which the new rows are drawn (:mod:`hpc_mca.models.vocab`)."""
    tokenizer: PreTrainedTokenizerBase = field(compare=False, repr=False)
    """The template-fixed tokenizer, saved with every export."""


_GROWTH: dict[str, VocabGrowth] = {}


def record_vocab_growth(directory: str | Path, growth: VocabGrowth | None) -> None:
    """Make every later :func:`read_hf_config` of ``directory`` in this process describe the
    model with ``growth.size`` vocabulary rows (None: forget it). The run's checks record it
    on every rank before anything is built (``hpc_mca.api.session.check_inputs``), so the
    build, the import of the weights, the checkpoint's records and the export agree."""
    key = str(Path(directory).resolve())
    if growth is None:
        _GROWTH.pop(key, None)
    else:
        _GROWTH[key] = growth


def vocab_growth(directory: str | Path) -> VocabGrowth | None:
    """The growth recorded for ``directory``, if any."""
    return _GROWTH.get(str(Path(directory).resolve()))
