"""From a resolved run config's data section to training/eval rows and their data-parallel
loaders. What the pipeline reads of the other sections (stage, seed, batch and parallel
sizes) comes as a :class:`~hpc_mca.data.arguments.DataRun`, never the whole config.

The pipeline, one function each:

1. :func:`load_samples` - files to shifted samples: read records through HF ``datasets``
   (direct paths or dataset_info.json entries, :mod:`.sources`; errors as ``path:line``),
   render and tokenize them per stage (cached on disk by content key), or open a Megatron
   indexed corpus.
2. :func:`build_datasets` - train/eval samples (several training datasets mixed by
   ``mix_strategy``, :mod:`.mix`; ``eval_dataset`` or ``val_size`` held out) into
   :class:`~hpc_mca.data.rows.RowDataset` rows, packed or padded.
3. :func:`train_dataloader` / :func:`eval_dataloader` - micro-batches for one data-parallel
   rank, in the seed's order, resumable from a consumed-sample count.

Stages are routed by how they read their rows (:attr:`hpc_mca.stages.Stage.reads`, through
``_READERS``); preference pairs (:mod:`.preference`) and kto feedback (:mod:`.feedback`)
also get their own rows and held-out split, which keep an example's two rows together.
Everything happens before the first training step, so every input error surfaces first.
Ranks may call :func:`build_datasets` concurrently: cache files are written atomically (a
launcher can also let rank 0 go first and the others read its cache after a barrier).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from hpc_mca.stages import CONVERSATION, FEEDBACK, PREFERENCE_PAIR, STAGE_NAMES, TEXT, Stage, get_stage

from .arguments import DataArguments, DataRun
from .batch import collate_batch
from .cache import default_cache_dir
from .encode import conversation_format, conversation_store, prepare_template, pt_eos_id
from .errors import DataError
from .feedback import feedback_rows, tokenize_feedback
from .mix import mix_order, parse_probs
from .multimodal import VisionInputs, vision_inputs
from .packing import pack_alignment
from .preference import pair_rows, split_pairs, tokenize_pairs
from .records import Record, check_dataset_path, text_of
from .rows import RowDataset
from .sampler import DataSampler, EpochPlan
from .sources import DatasetSource, resolve_sources, source_records
from .store import (
    IndexedSamples,
    Samples,
    SampleStore,
    cache_key,
    cached,
    check_token_ids,
    concat_samples,
    indexed_prefix,
    subset,
)
from .tokenize import encode_documents, load_tokenizer, pad_id, pt_samples, tokenizer_fingerprint
from .training_data import TrainingData
from .vision import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, ImageSettings

if TYPE_CHECKING:
    from collections.abc import Iterable

    from transformers import PreTrainedTokenizerBase

# --- tokenization per stage ----------------------------------------------------------------


def _tokenize_pt(records: list[Record], tokenizer: PreTrainedTokenizerBase, data: DataArguments) -> SampleStore:
    texts = [text_of(record, data.text_field) for record in records]
    documents = list(encode_documents(tokenizer, texts, pt_eos_id(tokenizer, data.template)))
    samples = list(pt_samples(documents, data.cutoff_len, data.pt_chunking))
    return SampleStore.from_samples(samples, {"records": len(records), "samples": len(samples)})


def _tokenize_sft(records: list[Record], tokenizer: PreTrainedTokenizerBase, data: DataArguments,
                  vision: VisionInputs | None = None, media_root: str = "") -> SampleStore:
    fmt = conversation_format(records, data)
    return conversation_store(records, tokenizer, prepare_template(tokenizer, data), data, fmt, ranking=False,
                              vision=vision, media_root=media_root)


_READERS: dict[str, Callable[[list[Record], PreTrainedTokenizerBase, DataArguments], SampleStore]] = {
    TEXT: _tokenize_pt,
    CONVERSATION: _tokenize_sft,
    PREFERENCE_PAIR: tokenize_pairs,
    FEEDBACK: tokenize_feedback,
}
"""How each kind of row (:attr:`hpc_mca.stages.Stage.reads`) is tokenized."""


def _stage(stage: str) -> Stage:
    """The registry's ``stage``; a name it lacks is bad input here too (callers other than
    a resolved config's reach the data pipeline directly)."""
    if stage not in STAGE_NAMES:
        raise DataError(f"finetuning.stage={stage!r} has no data pipeline; valid: "
                        + ", ".join(STAGE_NAMES))
    return get_stage(stage)


CONVERSATION_KEYS = ("template", "train_on_prompt", "mask_history", "enable_thinking", "default_system",
                     "tool_format")
"""The ``data.*`` settings that change the tokens of a conversation (sft, dpo)."""


def fix_tokenizer(tokenizer: PreTrainedTokenizerBase, data: DataArguments, stage: str) -> None:
    """Let ``data.template`` fix the tokenizer in place (eos, pad, stop words), as
    LLaMA-Factory does before any stage reads data; pt skips chat and plain, which change
    nothing and need no chat template."""
    if _stage(stage).reads != TEXT or data.template not in ("chat", "plain"):
        prepare_template(tokenizer, data)


def _settings(stage: str, data: DataArguments) -> dict[str, Any]:
    """The settings a cached tokenization depends on."""
    keys: tuple[str, ...] = ("dataset_format", "cutoff_len", "max_samples")
    keys += _stage(stage).data_keys
    # The template's settings change token ids (pt: its document end, see encode.PT_EOS).
    keys += ("template",) if _stage(stage).reads == TEXT else CONVERSATION_KEYS
    return {"stage": stage, **{key: getattr(data, key, None) for key in dict.fromkeys(keys)}}


def _indexed_source(path: str, data: DataArguments, stage: str, field: str) -> str | None:
    """The indexed prefix ``path`` names, or None for a records file (checked to exist)."""
    prefix = indexed_prefix(path)
    if data.dataset_format == "indexed" or (prefix and _stage(stage).reads == TEXT):
        if prefix is None:
            raise DataError(f"{field}: no Megatron .bin/.idx pair at {path!r}")
        return prefix
    check_dataset_path(path, field)
    return None


def load_samples(path: str, tokenizer: PreTrainedTokenizerBase, data: DataArguments, stage: str,
                 field: str = "data.dataset", vocab_size: int | None = None,
                 source: DatasetSource | None = None, vision: VisionInputs | None = None) -> Samples:
    """Shifted samples of one dataset file, directory or indexed prefix (``data`` is a
    DataArguments; ``source`` a dataset_info entry for ``path``, None for a direct path);
    with ``vocab_size``, every token id is checked to be below it (see check_token_ids). With
    ``vision`` (:func:`run_vision`), sft samples and dpo pairs keep their images."""
    _stage(stage)
    source = source or DatasetSource(path, path)
    fix_tokenizer(tokenizer, data, stage)  # before the fingerprint, which sees the fixed tokenizer
    prefix = _indexed_source(path, data, stage, field)
    if prefix is not None:
        return IndexedSamples(prefix, data.cutoff_len, data.pt_chunking, vocab_size)
    if source.formatting is not None:  # records come out in the parsers' own field names
        data = dataclasses.replace(data, text_field="text", dataset_format=(
            "text" if _stage(stage).reads == TEXT else source.formatting))
    media_root = data.media_dir or source.media_root or os.path.dirname(path)
    vl = {} if vision is None else {"media_root": os.path.abspath(media_root), **vision.cache_settings()}
    key = cache_key([path], tokenizer_fingerprint(tokenizer),
                    {**_settings(stage, data), **source.settings(), **vl})
    cache_dir = Path(data.preprocessing_cache_dir or default_cache_dir())

    def tokenize() -> SampleStore:
        records = source_records(source, stage, data.max_samples, field, cache_dir / "datasets")
        if _stage(stage).reads == CONVERSATION:
            return _tokenize_sft(records, tokenizer, data, vision, media_root)
        if _stage(stage).reads == PREFERENCE_PAIR:
            return tokenize_pairs(records, tokenizer, data, vision, media_root)
        return _READERS[_stage(stage).reads](records, tokenizer, data)

    store, hit = cached(cache_dir / f"{stage}-{key}.npz", tokenize,
                        overwrite=data.overwrite_cache)
    store.stats["cache_hits"] = int(hit)
    if vocab_size is not None:
        check_token_ids(store, vocab_size, f"{field}: {path}")
    return store


def _load_all(data: DataArguments, field_name: str, tokenizer: PreTrainedTokenizerBase, stage: str,
              vocab_size: int | None, seed: int, vision: VisionInputs | None = None) -> Samples:
    """The samples of ``data.dataset`` (mixed by ``data.mix_strategy``) or of
    ``data.eval_dataset`` (concatenated)."""
    field = f"data.{field_name}"
    sources = resolve_sources(data, field_name, seed)
    for source in sources:  # report a bad second file before tokenizing the first
        _indexed_source(source.path, data, stage, field)
    parts = [load_samples(s.path, tokenizer, data, stage, field, vocab_size, s, vision) for s in sources]
    samples = concat_samples(parts)
    strategy = getattr(data, "mix_strategy", "concat") if field_name == "dataset" else "concat"
    if strategy != "concat":
        samples = _mixed(samples, [len(p) for p in parts], data, stage, seed)
    if len(samples) == 0:
        raise DataError(f"{field}={[s.name for s in sources]!r} yields no trainable samples")
    return samples


def _mixed(samples: Samples, sizes: list[int], data: DataArguments, stage: str, seed: int) -> Samples:
    # Pairs are mixed whole (samples 2p, 2p + 1 stay neighbours); the others mix samples.
    unit = _stage(stage).rows_per_example
    source, index = mix_order([n // unit for n in sizes], data.mix_strategy,
                              parse_probs(data.interleave_probs), seed)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    first = starts[source] + unit * index
    order = np.stack([first + k for k in range(unit)], axis=1).reshape(-1)
    return subset(samples, order)


def _split_val(samples: Samples, val_size: float, seed: int) -> tuple[Samples, Samples]:
    n = len(samples)
    n_val = int(val_size) if val_size >= 1 else max(1, round(val_size * n))
    if n_val >= n:
        raise DataError(f"data.val_size={val_size} leaves no training samples out of {n}")
    order = np.random.default_rng(seed).permutation(n)
    return subset(samples, np.sort(order[n_val:])), subset(samples, np.sort(order[:n_val]))


class _MakeRows(Protocol):
    """How a stage's samples become rows (:class:`RowDataset` or a subclass that keeps pairs)."""

    def __call__(self, samples: Samples, seq_length: int, pad_token_id: int, *, packed: bool,
                 align: int) -> RowDataset: ...


def build_datasets(data: DataArguments, run: DataRun, tokenizer: PreTrainedTokenizerBase | None = None,
                   vocab_size: int | None = None) -> TrainingData:
    """Train/eval rows of a resolved config's data section (``run``: what else it reads, see
    ``TrainConfig.data_run``); with the model's ``vocab_size``, token ids at or above it are
    bad input (DataError)."""
    stage = run.stage
    if tokenizer is None:
        tokenizer = load_tokenizer(run.tokenizer_path)
    fix_tokenizer(tokenizer, data, stage)  # the pad id of the rows and both backends see it fixed
    if getattr(data, "data_path", None) is not None:  # Megatron's weighted blend (pt)
        from .blended import blended_training_data

        return blended_training_data(data, run, tokenizer, vocab_size)
    seed = run.seed
    vision = run_vision(tokenizer, data, run)
    train = _load_all(data, "dataset", tokenizer, stage, vocab_size, seed, vision)
    evaluation = None
    if data.eval_dataset:
        evaluation = _load_all(data, "eval_dataset", tokenizer, stage, vocab_size, seed, vision)
    elif data.val_size and _stage(stage).rows_per_example == 2:  # pairs, kto examples
        kept, held = split_pairs(train, data.val_size, seed)
        train, evaluation = subset(train, kept), subset(train, held)
    elif data.val_size:
        train, evaluation = _split_val(train, data.val_size, seed)
    seq_length = run.seq_length
    cp = run.context_parallel_size
    align = pack_alignment(cp, data.pack_alignment) if data.sequence_packing else 1
    row_makers: dict[str, _MakeRows] = {
        PREFERENCE_PAIR: pair_rows, FEEDBACK: partial(feedback_rows, cutoff_len=data.cutoff_len)}
    make_rows = row_makers.get(_stage(stage).reads, RowDataset)

    def rows(samples: Samples) -> RowDataset:
        made = make_rows(samples, seq_length, pad_id(tokenizer), packed=data.sequence_packing, align=align)
        made.vision = vision
        return made

    return TrainingData(rows(train), rows(evaluation) if evaluation is not None else None,
                        tokenizer)


def run_vision(tokenizer: PreTrainedTokenizerBase, data: DataArguments, run: DataRun) -> VisionInputs | None:
    """The vision inputs of an sft or dpo run with a vision-language ``data.template`` (the
    image processor of the model directory, ``run.tokenizer_path``); None otherwise (a record
    with images is then refused in one line)."""
    if _stage(run.stage).reads not in (CONVERSATION, PREFERENCE_PAIR):
        return None
    settings = ImageSettings(getattr(data, "image_max_pixels", DEFAULT_MAX_PIXELS),
                             getattr(data, "image_min_pixels", DEFAULT_MIN_PIXELS))
    return vision_inputs(tokenizer, prepare_template(tokenizer, data), run.tokenizer_path, settings)


# --- loaders -------------------------------------------------------------------------------


def _plain_batches(sampler: DataSampler) -> DataSampler:
    return sampler


def _loader(dataset: RowDataset, sampler: DataSampler, run: DataRun) -> torch.utils.data.DataLoader:
    # Pair rows (dpo, unpacked) are sampled a pair at a time and collate their two rows each.
    collate = getattr(dataset, "collate", collate_batch)
    # kto rows also need each example's predecessor in the micro-step (its KL row's answer).
    batches: Callable[[DataSampler], Iterable[list[int]] | Iterable[list[tuple[int, int]]]] = getattr(
        dataset, "batch_sampler", _plain_batches)
    # The sampler runs in this process and hands each worker whole micro-batches in order, so
    # the batches do not depend on the number of workers (the rows are read, not drawn).
    return torch.utils.data.DataLoader(dataset, batch_sampler=batches(sampler), collate_fn=collate,
                                       num_workers=run.num_workers, prefetch_factor=run.prefetch_factor)


def epoch_plan(dataset: RowDataset, run: DataRun) -> EpochPlan:
    """How the training loaders split an epoch of ``dataset`` into steps (every row trained, the
    last step partial): what each backend's step consumes and how many micro-batches it has."""
    return EpochPlan(len(dataset), run.micro_batch_size, run.data_parallel_size, run.global_batch_size)


def train_dataloader(dataset: RowDataset, run: DataRun, *, data_parallel_rank: int,
                     consumed_samples: int = 0) -> torch.utils.data.DataLoader:
    """Endless micro-batches of this rank, epoch after epoch (each ending with a partial step,
    :func:`epoch_plan`), from ``consumed_samples`` on (global samples, at a micro-step boundary:
    the sum of the steps' :meth:`EpochPlan.step_samples`)."""
    sampler = DataSampler(len(dataset), micro_batch_size=run.micro_batch_size,
                          data_parallel_rank=data_parallel_rank,
                          data_parallel_size=run.data_parallel_size,
                          global_batch_size=run.global_batch_size, seed=run.seed,
                          consumed_samples=consumed_samples)
    return _loader(dataset, sampler, run)


def check_eval_rows(rows: RowDataset | None, run: DataRun) -> None:
    """Eval rows that fill no evaluation step (the tail that does not fill one on every rank
    is left out) are bad input. Both backends call it once the rows are built, before step 1:
    found at the first evaluation instead (the last step at the latest), a run lost its final
    checkpoint and exports after training every step."""
    if rows is None:
        return
    batch, dp = run.eval_batch_size, run.data_parallel_size
    if len(rows) >= batch * dp:
        return
    packed = f" ({len(rows.samples)} samples packed into rows)" if rows.packed else ""
    valid = (f"training.per_device_eval_batch_size at most {len(rows) // dp}, or more eval data"
             if len(rows) >= dp else f"at least {dp} eval rows (more eval data)")
    raise DataError(f"the eval data has {len(rows)} rows{packed}, fewer than one evaluation step "
                    f"of training.per_device_eval_batch_size={batch} × data-parallel size {dp} "
                    f"= {batch * dp} rows; valid: {valid}")


def eval_dataloader(dataset: RowDataset, run: DataRun, *,
                    data_parallel_rank: int) -> torch.utils.data.DataLoader:
    """One pass over the eval rows in file order; the tail that does not fill a micro-batch on
    every rank is left out (so all ranks run the same number of steps)."""
    check_eval_rows(dataset, run)  # the runs checked it before step 1; other callers here
    step = run.eval_batch_size * run.data_parallel_size
    sampler = DataSampler(len(dataset), micro_batch_size=run.eval_batch_size,
                          data_parallel_rank=data_parallel_rank,
                          data_parallel_size=run.data_parallel_size, shuffle=False,
                          total_samples=len(dataset) // step * step)
    return _loader(dataset, sampler, run)
