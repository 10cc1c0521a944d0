"""Tokenized samples in flat arrays, their on-disk cache, and Megatron indexed corpora.

A sample store answers three questions: how many samples (``len``), how long each one is
(``lengths``, what packing needs) and what sample ``i`` holds (``sample(i)`` ->
``(input_ids, labels)``, already shifted). :class:`SampleStore` keeps tokenized jsonl/parquet
samples in three numpy arrays and saves them as one ``.npz`` named by a content key, so a rerun
with the same files, tokenizer and settings skips tokenization. :class:`IndexedSamples` reads a
Megatron ``.bin``/``.idx`` corpus lazily (nothing is cached: it is already tokens).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .choices import PT_CHUNKINGS
from .errors import DataError
from .records import indexed_prefix
from .tokenize import windows

CACHE_VERSION = 2
"""Bump when the meaning of cached arrays changes (2: dpo pairs label only the final answer,
not earlier assistant turns of the history)."""


class Samples(Protocol):
    """What rows and samplers need from a set of samples."""

    @property
    def lengths(self) -> np.ndarray: ...

    def __len__(self) -> int: ...

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass
class SampleStore:
    """Shifted samples back to back: sample i is ``[offsets[i], offsets[i+1])``."""

    input_ids: np.ndarray
    """All inputs, int32."""
    labels: np.ndarray
    """All labels, int32, ``IGNORE_INDEX`` where there is no loss."""
    offsets: np.ndarray
    """Sample boundaries, int64, leading 0."""
    stats: dict[str, int] = field(default_factory=dict)
    """Counts from tokenization: records, samples, truncated, dropped."""
    image_paths: np.ndarray | None = None
    """Vision-language samples only: every image path, str [images], sample by sample."""
    image_grids: np.ndarray | None = None
    """Their ``image_grid_thw``, int64 [images, 3]."""
    image_offsets: np.ndarray | None = None
    """Sample i's images are ``[image_offsets[i], image_offsets[i+1])``, int64, leading 0."""

    @classmethod
    def from_samples(cls, samples: list[tuple[np.ndarray, np.ndarray]],
                     stats: dict[str, int] | None = None,
                     images: list[tuple[tuple[str, ...], np.ndarray]] | None = None) -> SampleStore:
        """``images``: per sample, its image paths and grids [n, 3] (vision-language samples)."""
        lengths = np.asarray([len(ids) for ids, _ in samples], dtype=np.int64)
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        empty = np.zeros(0, dtype=np.int32)
        store = cls(
            input_ids=np.concatenate([ids for ids, _ in samples]) if samples else empty,
            labels=np.concatenate([lab for _, lab in samples]) if samples else empty,
            offsets=offsets, stats=dict(stats or {}))
        if images is not None:
            store.image_paths = np.asarray([p for paths, _ in images for p in paths], dtype=str)
            grids = [np.asarray(g, dtype=np.int64).reshape(-1, 3) for _, g in images]
            store.image_grids = np.concatenate(grids) if grids else np.zeros((0, 3), dtype=np.int64)
            store.image_offsets = np.zeros(len(images) + 1, dtype=np.int64)
            np.cumsum([len(paths) for paths, _ in images], out=store.image_offsets[1:])
        return store

    @property
    def has_images(self) -> bool:
        """Whether the samples are vision-language samples (each with its images, maybe none)."""
        return self.image_offsets is not None

    def images(self, index: int) -> tuple[tuple[str, ...], np.ndarray]:
        """Sample ``index``'s image paths and grids [n, 3] (none for a text-only store)."""
        if self.image_offsets is None or self.image_paths is None or self.image_grids is None:
            return (), np.zeros((0, 3), dtype=np.int64)
        lo, hi = int(self.image_offsets[index]), int(self.image_offsets[index + 1])
        return tuple(str(p) for p in self.image_paths[lo:hi]), self.image_grids[lo:hi]

    def _all_images(self) -> list[tuple[tuple[str, ...], np.ndarray]] | None:
        return [self.images(i) for i in range(len(self))] if self.has_images else None

    @classmethod
    def concat(cls, stores: list[SampleStore]) -> SampleStore:
        stats: dict[str, int] = {}
        offsets, base = [np.zeros(1, dtype=np.int64)], 0
        for store in stores:
            for key, value in store.stats.items():
                stats[key] = stats.get(key, 0) + value
            offsets.append(store.offsets[1:] + base)
            base += int(store.offsets[-1])
        out = cls(np.concatenate([s.input_ids for s in stores]).astype(np.int32),
                  np.concatenate([s.labels for s in stores]).astype(np.int32),
                  np.concatenate(offsets), stats)
        if any(s.has_images for s in stores):
            merged = cls.from_samples([], images=[s.images(i) for s in stores for i in range(len(s))])
            out.image_paths, out.image_grids, out.image_offsets = (
                merged.image_paths, merged.image_grids, merged.image_offsets)
        return out

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[index], self.offsets[index + 1]
        return self.input_ids[lo:hi], self.labels[lo:hi]

    def subset(self, indices: np.ndarray) -> SampleStore:
        images = self._all_images()
        return SampleStore.from_samples([self.sample(int(i)) for i in indices], self.stats,
                                        None if images is None else [images[int(i)] for i in indices])

    def save(self, path: Path) -> None:
        """Write atomically (concurrent ranks may race to write the same content)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npz")
        arrays = {"input_ids": self.input_ids, "labels": self.labels, "offsets": self.offsets,
                  "stats": np.asarray(json.dumps(self.stats))}
        if self.image_paths is not None and self.image_grids is not None and self.image_offsets is not None:
            arrays.update(image_paths=self.image_paths, image_grids=self.image_grids,
                          image_offsets=self.image_offsets)
        np.savez(tmp, **arrays)  # type: ignore[arg-type]  # numpy types **kwds as its allow_pickle flag too
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> SampleStore:
        with np.load(path, allow_pickle=False) as arrays:
            vision = [arrays[k] if k in arrays else None for k in ("image_paths", "image_grids", "image_offsets")]
            return cls(arrays["input_ids"], arrays["labels"], arrays["offsets"],
                       json.loads(str(arrays["stats"])), *vision)


def check_token_ids(store: SampleStore, vocab_size: int, where: str) -> None:
    """DataError (one line naming ``where``, the sample and the id) when a token id of the
    tokenized ``store`` is not below ``vocab_size`` (a tokenizer that does not fit the model:
    the embedding lookup would fail on CPU, or assert on a GPU, mid-training)."""
    from .tokenize import IGNORE_INDEX

    labels = store.labels[store.labels != IGNORE_INDEX]
    top = max(int(store.input_ids.max(initial=0)), int(labels.max(initial=0)))
    if top < vocab_size:
        return
    position = int(np.argmax((store.input_ids >= vocab_size)
                             | ((store.labels >= vocab_size) & (store.labels != IGNORE_INDEX))))
    sample = int(np.searchsorted(store.offsets, position, side="right")) - 1
    raise DataError(f"{where}: token id {top} (first in sample {sample} of {len(store)}) is not "
                    f"below the model's vocab_size {vocab_size}; valid: the model's tokenizer "
                    "(tokenizer_name_or_path)")


# --- cache ---------------------------------------------------------------------------------


def file_digest(path: str | os.PathLike[str]) -> str:
    """Content hash of a dataset file (its name and location do not matter); of a dataset
    directory, the hash of its files' relative names and contents."""
    if os.path.isdir(path):
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
        parts = [f"{p.relative_to(path)}:{file_digest(p)}" for p in files]
        return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "blake2b").hexdigest()[:32]


def cache_key(paths: list[str], tokenizer_digest: str, settings: dict[str, Any]) -> str:
    """Key of a tokenized dataset: file contents, tokenizer and every setting that matters."""
    payload = json.dumps({"version": CACHE_VERSION, "files": [file_digest(p) for p in paths],
                          "tokenizer": tokenizer_digest, "settings": settings}, sort_keys=True)
    return hashlib.blake2b(payload.encode(), digest_size=16).hexdigest()


def cached(path: Path, build: Callable[[], SampleStore], overwrite: bool = False) -> tuple[SampleStore, bool]:
    """``(store, hit)``: the store at ``path``, or ``build()`` saved there."""
    if path.is_file() and not overwrite:
        return SampleStore.load(path), True
    store = build()
    store.save(path)
    return store, False


# --- Megatron indexed corpora --------------------------------------------------------------


class IndexedSamples:
    """pt samples read lazily from a Megatron IndexedDataset (one sequence = one document).

    ``chunking="concat"`` cuts the corpus as one stream into windows of ``cutoff_len + 1``
    tokens (overlapping by one, like Megatron's GPTDataset); ``"document"`` cuts each sequence
    on its own. Labels are the shifted tokens, all trained.
    """

    def __init__(self, prefix: str, cutoff_len: int, chunking: str,
                 vocab_size: int | None = None) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.prefix, self.vocab_size = prefix, vocab_size
        self.dataset = IndexedDataset(prefix)
        seq_lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        self.seq_starts = np.concatenate([[0], np.cumsum(seq_lengths)])
        if chunking == "concat":
            spans = windows(int(self.seq_starts[-1]), cutoff_len)
        elif chunking == "document":
            spans = [(int(self.seq_starts[s]) + lo, int(self.seq_starts[s]) + hi)
                     for s, n in enumerate(seq_lengths) for lo, hi in windows(int(n), cutoff_len)]
        else:
            raise DataError(f"data.pt_chunking={chunking!r} is not valid; valid: "
                            + ", ".join(PT_CHUNKINGS))
        self.spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        self.lengths = self.spans[:, 1] - self.spans[:, 0] - 1
        self.stats = {"records": len(seq_lengths), "samples": len(self.spans)}

    def __len__(self) -> int:
        return len(self.spans)

    def _tokens(self, start: int, end: int) -> np.ndarray:
        """Global token range [start, end), possibly across sequences."""
        pieces = []
        seq = int(np.searchsorted(self.seq_starts, start, side="right")) - 1
        while start < end:
            seq_end = int(self.seq_starts[seq + 1])
            stop = min(end, seq_end)
            offset = start - int(self.seq_starts[seq])
            pieces.append(self.dataset.get(seq, offset=offset, length=stop - start))
            start, seq = stop, seq + 1
        return np.concatenate(pieces).astype(np.int32)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = self._tokens(*map(int, self.spans[index]))
        # Checked as samples are read: a corpus can be too large to scan at every start.
        if self.vocab_size is not None and len(tokens) and int(tokens.max()) >= self.vocab_size:
            bad = int(tokens.max())
            raise DataError(f"{self.prefix}: token id {bad} in sample {index} (tokens "
                            f"{int(self.spans[index][0])}..{int(self.spans[index][1]) - 1} of the "
                            f"corpus) is not below the model's vocab_size {self.vocab_size}; "
                            "valid: a corpus tokenized with the model's tokenizer")
        return tokens[:-1], tokens[1:].copy()


def subset(samples: Samples, indices: np.ndarray) -> Samples:
    """The samples at ``indices``, in that order."""
    if isinstance(samples, SampleStore):
        return samples.subset(indices)
    return _Subset(samples, np.asarray(indices, dtype=np.int64))


def concat_samples(parts: list[Samples]) -> Samples:
    """The samples of ``parts`` one after the other."""
    if len(parts) == 1:
        return parts[0]
    stores = [p for p in parts if isinstance(p, SampleStore)]
    if len(stores) == len(parts):
        return SampleStore.concat(stores)
    return _Concat(parts)


class _Concat:
    def __init__(self, parts: list[Samples]) -> None:
        self.parts = parts
        self.lengths = np.concatenate([p.lengths for p in parts])
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
        self.stats: dict[str, int] = {}
        for part in parts:
            for key, value in getattr(part, "stats", {}).items():
                self.stats[key] = self.stats.get(key, 0) + value

    def __len__(self) -> int:
        return int(self.starts[-1])

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        part = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.parts[part].sample(index - int(self.starts[part]))


class _Subset:
    def __init__(self, base: Samples, indices: np.ndarray) -> None:
        self.base, self.indices = base, indices
        self.lengths = base.lengths[indices]
        self.stats = getattr(base, "stats", {})

    def __len__(self) -> int:
        return len(self.indices)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.base.sample(int(self.indices[index]))


__all__ = ["IndexedSamples", "SampleStore", "Samples", "cache_key", "cached", "concat_samples",
           "file_digest", "indexed_prefix", "subset"]
