"""Blended pretraining corpora: Megatron's weighted ``data_path`` through megatron-core's builder.

``data.data_path`` lists Megatron indexed prefixes with weights (``0.7 prefixA 0.3 prefixB``),
or prefixes alone (equal weights). :func:`build_blended` hands the blend to megatron-core's
``BlendedMegatronDatasetBuilder`` with ``GPTDataset``: it splits each corpus by documents
(``data.split``), draws each corpus's ``GPTDataset`` of seq_length+1-token windows (shuffled by
``training.seed``), and blends them into a ``BlendedDataset`` that meets the weights sample by
sample. Its index arrays are cached in ``path_to_cache`` (:func:`index_cache_dir`), keyed by
megatron's own hash of the blend, seed, length and sizes, so later ranks and requeued jobs load
them instead of rebuilding.

:class:`BlendedSamples` presents the blend as the pipeline's ``Samples`` (``sample(i)`` ->
shifted ``(input_ids, labels)``, every sample ``seq_length`` long), so rows, both backends and
the resumable :class:`~hpc_mca.data.sampler.DataSampler` work unchanged: the blend is a fixed,
cached sequence, and the sampler's seed-only order over it resumes exactly from
``consumed_samples``.

The builder needs megatron's C++ helpers (``megatron.core.datasets.helpers_cpp``), which the
source install compiles; the installed package ships no Makefile, so megatron's runtime
``compile_helpers()`` cannot rebuild them (see :func:`check_helpers`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .arguments import DataArguments, DataRun
from .cache import default_cache_dir
from .errors import DataError
from .records import indexed_prefix
from .training_data import TrainingData

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

DEFAULT_SPLIT = "100,0,0"
"""Train, validation, test shares of each corpus's documents (Megatron's ``--split``)."""


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(items: list[str]) -> tuple[list[str], list[float]]:
    """``(prefixes, weights)`` of a ``data_path`` list: weight/prefix pairs, or prefixes alone
    (equal weights). Each prefix must name a .bin/.idx pair. DataError (one line) otherwise."""
    if not items:
        raise DataError("data.data_path is empty; valid: [weight, prefix, ...] or [prefix, ...]")
    pairs: list[tuple[float | None, str]]
    if _number(items[0]) is None:
        pairs = [(1.0, item) for item in items]
    elif len(items) % 2:
        raise DataError(f"data.data_path={items!r} has {len(items)} entries, not weight/prefix "
                        "pairs; valid: [0.7, prefixA, 0.3, prefixB] or prefixes alone")
    else:
        pairs = [(_number(w), p) for w, p in zip(items[::2], items[1::2])]
    weights: list[float] = []
    for weight, prefix in pairs:
        if weight is None or _number(prefix) is not None:
            raise DataError(f"data.data_path={items!r} mixes weights and prefixes out of turn; "
                            "valid: weight, prefix, weight, prefix ... or prefixes alone")
        if not weight > 0 or not np.isfinite(weight):
            raise DataError(f"data.data_path: weight {weight} of {prefix!r} is not positive; "
                            "valid: weights > 0")
        weights.append(weight)
    prefixes = []
    for _, path in pairs:
        found = indexed_prefix(path)
        if found is None:
            raise DataError(f"data.data_path: no Megatron .bin/.idx pair at {path!r}")
        prefixes.append(os.path.abspath(found))
    return prefixes, weights


def parse_split(split: str) -> list[float]:
    """The three train/valid/test shares of a ``"969,30,1"`` string (missing ones are 0)."""
    parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    values = [_number(p.strip()) for p in parts]
    shares = [v for v in values if not (v is None or v < 0)]
    if not 1 <= len(values) <= 3 or len(shares) != len(values) or not sum(shares):
        raise DataError(f"data.split={split!r} is not train,valid,test shares; valid: e.g. "
                        "'969,30,1' or '100,0,0'")
    return shares + [0.0] * (3 - len(shares))


def check_helpers() -> None:
    """DataError (one line) when megatron's compiled dataset helpers cannot be imported."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError as err:
        raise DataError(f"data.data_path needs megatron-core's compiled dataset helpers "
                        f"(megatron.core.datasets.helpers_cpp: {err}); valid: install "
                        "megatron-core from a wheel or build its sdist with a C++ compiler") from None


def index_cache_dir(data: DataArguments, run: DataRun) -> Path:
    """Where megatron's blend indices are cached: ``data.preprocessing_cache_dir`` when set,
    else the run directory (shared by all ranks and every requeue of the job)."""
    base: str | Path = data.preprocessing_cache_dir or run.output_dir
    if not base:
        base = default_cache_dir()
    return Path(base) / "megatron_indices"


class _TokensOnly:
    """The tokenizer megatron's GPTDatasetConfig requires. Tokens are already ids, and the
    indices do not depend on the tokenizer: a constant identity lets runs with different
    tokenizers share the cache. No ``pad``: megatron then pads with -1, which no corpus holds."""

    vocab_size = None
    eod = None
    unique_identifiers = {"class": "hpc_mca.pretokenized"}


@contextlib.contextmanager
def _as_one_process() -> Iterator[None]:
    """Run megatron's builder as if torch.distributed were down. hpc-mca already builds data on
    rank 0 first (rank_zero_first), and the other ranks then find rank 0's index cache; the
    builder's own rank-0-first barriers would be collectives that only rank 0 enters at that
    point, and hang."""
    import torch.distributed as dist

    original = dist.is_initialized
    dist.is_initialized = lambda: False
    try:
        yield
    finally:
        dist.is_initialized = original


def _build(data: DataArguments, run: DataRun, prefixes: list[str], weights: list[float],
           sizes: list[int]) -> list[_Windows | None]:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    gpt_config = GPTDatasetConfig(
        random_seed=run.seed, sequence_length=run.seq_length,
        blend=(prefixes, weights), split=data.split or DEFAULT_SPLIT,
        path_to_cache=str(index_cache_dir(data, run)), tokenizer=_TokensOnly(),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, gpt_config)
    with _as_one_process():
        return builder.build()


def _blend_sizes(data: DataArguments, run: DataRun, shares: list[float]) -> list[int]:
    """Samples to draw per split: what the run trains on (max_steps × global batch), and for
    evaluation ``val_size`` (a count, or a fraction of that), else one evaluation step."""
    # Set by resolve, which every config that reaches the data pipeline went through.
    train = run.max_steps * run.global_batch_size
    if shares[1] == 0:
        return [train, 0, 0]
    val = data.val_size
    valid = run.eval_batch_size * run.data_parallel_size
    if val >= 1:
        valid = int(val)
    elif val > 0:
        valid = max(valid, round(val * train))
    return [train, valid, 0]


def build_blended(data: DataArguments, run: DataRun,
                  vocab_size: int | None = None) -> tuple[BlendedSamples, BlendedSamples | None]:
    """``(train, eval or None)`` Samples of ``data.data_path`` for a resolved config."""
    prefixes, weights = parse_blend(data.data_path or [])
    shares = parse_split(data.split or DEFAULT_SPLIT)
    if shares[0] == 0:
        raise DataError(f"data.split={data.split!r} leaves no training documents")
    check_helpers()
    sizes = _blend_sizes(data, run, shares)
    try:
        train, valid, _ = _build(data, run, prefixes, weights, sizes)
    except (AssertionError, IndexError, ValueError) as err:
        # A corpus whose split share holds no document, or too few tokens for one sample.
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"data.data_path: megatron-core could not build the blend with "
                        f"data.split={data.split or DEFAULT_SPLIT!r}, data.seq_length="
                        f"{run.seq_length}: {reason}") from None
    length = run.seq_length
    evaluation = BlendedSamples(valid, length, vocab_size) if valid else None
    assert train is not None  # a training share was checked above, so megatron built its split
    return BlendedSamples(train, length, vocab_size), evaluation


def blended_training_data(data: DataArguments, run: DataRun, tokenizer: PreTrainedTokenizerBase,
                          vocab_size: int | None = None) -> TrainingData:
    """:class:`~hpc_mca.data.training_data.TrainingData` of ``data.data_path``: one sample per row
    (every sample fills its row; packed rows also carry cu_seqlens, as the THD path needs)."""
    from .packing import pack_alignment
    from .rows import RowDataset
    from .tokenize import pad_id

    train, evaluation = build_blended(data, run, vocab_size)
    align = (pack_alignment(run.context_parallel_size, data.pack_alignment)
             if data.sequence_packing else 1)

    def rows(samples: BlendedSamples) -> RowDataset:
        return RowDataset(samples, run.seq_length, pad_id(tokenizer),
                          packed=data.sequence_packing, align=align)

    return TrainingData(rows(train), rows(evaluation) if evaluation is not None else None,
                        tokenizer)


class _Windows(Protocol):
    """What megatron's BlendedDataset and GPTDataset offer: samples of seq_length+1 tokens."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]: ...


class BlendedSamples:
    """A megatron Blended/GPT dataset as shifted samples: sample i is its seq_length+1 tokens
    cut into inputs and next-token labels, all trained."""

    def __init__(self, dataset: _Windows, seq_length: int, vocab_size: int | None = None) -> None:
        self.dataset, self.vocab_size = dataset, vocab_size
        self.lengths = np.full(len(dataset), seq_length, dtype=np.int64)
        self.stats = {"samples": len(dataset)}

    def __len__(self) -> int:
        return len(self.lengths)

    def corpus_of(self, index: int) -> int:
        """Which data_path entry sample ``index`` comes from."""
        return int(self.dataset[index].get("dataset_id", 0))

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        item = self.dataset[index]
        tokens = item["tokens"].numpy().astype(np.int32)
        labels = item["labels"].numpy().astype(np.int32)
        # Checked as samples are read, like IndexedSamples: a corpus can be too large to scan.
        top = int(max(tokens.max(), labels.max()))
        if self.vocab_size is not None and top >= self.vocab_size:
            raise DataError(f"data.data_path: token id {top} in blended sample {index} is not "
                            f"below the model's vocab_size {self.vocab_size}; valid: corpora "
                            "tokenized with the model's tokenizer")
        return tokens, labels


__all__ = ["BlendedSamples", "DEFAULT_SPLIT", "blended_training_data", "build_blended",
           "check_helpers",
           "index_cache_dir", "parse_blend", "parse_split"]
