"""``TrainingData``: the train and eval rows a backend trains on, with their tokenizer (a module
of its own: both the file pipeline, :mod:`.dataset`, and Megatron's blended corpora,
:mod:`.blended`, build one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .rows import RowDataset

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TrainingData"]


@dataclass
class TrainingData:
    """What the loop trains and evaluates on."""

    train: RowDataset
    """Training rows."""
    eval: RowDataset | None
    """Evaluation rows, or None."""
    tokenizer: PreTrainedTokenizerBase
    """The tokenizer the rows were made with, as ``data.template`` fixed it (eos, pad, stop
    words): both backends take their tokenizer from here."""

    def describe(self) -> str:
        """One line per split: samples, rows, packing efficiency, tokenization counts
        (``invalid``: records dropped for their turn order or a missing answer, ``truncated``:
        samples shortened to cutoff_len, ``dropped``: samples left with nothing to train)."""
        lines = []
        for name, rows in (("train", self.train), ("eval", self.eval)):
            if rows is not None:
                stats = getattr(rows.samples, "stats", {})
                counts = ", ".join(f"{k} {v}" for k, v in sorted(stats.items()))
                lines.append(f"{name}: {rows.report.describe()} ({counts})")
        return "\n".join(lines)
