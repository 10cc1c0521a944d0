"""Several training datasets as one: concatenated, or interleaved by probability.

``data.mix_strategy`` as in LLaMA-Factory: ``concat`` (one after the other),
``interleave_under`` (draw each next sample from dataset ``k`` with ``interleave_probs[k]``
until the first dataset runs out) or ``interleave_over`` (until every dataset has been seen
whole; the shorter ones repeat). The drawing is ``datasets.interleave_datasets``' own, seeded
with ``training.seed``; it runs on each dataset's sample indices, after tokenization, so every
dataset keeps its own tokenization cache and the mix costs no re-tokenization.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_STOPPING = {"interleave_under": "first_exhausted", "interleave_over": "all_exhausted"}


def parse_probs(value: Sequence[float] | str | None) -> list[float] | None:
    """``interleave_probs`` as floats (a comma-separated string is split)."""
    if value is None or isinstance(value, (list, tuple)) and not value:
        return None
    items = value.split(",") if isinstance(value, str) else value
    return [float(item) for item in items if str(item).strip()]


def mix_order(sizes: Sequence[int], strategy: str, probs: Sequence[float] | None,
              seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(source, index)`` of every mixed unit: which dataset, and which unit within it."""
    if strategy == "concat":
        source = np.concatenate([np.full(n, k, dtype=np.int64) for k, n in enumerate(sizes)])
        index = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes])
        return source, index
    import datasets

    parts = [datasets.Dataset.from_dict({"source": np.full(n, k, dtype=np.int64),
                                         "index": np.arange(n, dtype=np.int64)})
             for k, n in enumerate(sizes)]
    mixed = datasets.interleave_datasets(parts, probabilities=list(probs) if probs else None,
                                         seed=seed, stopping_strategy=_STOPPING[strategy])
    table = mixed.with_format("numpy")
    return np.asarray(table["source"], dtype=np.int64), np.asarray(table["index"], dtype=np.int64)
