"""A script's datasets as training rows: any map-style dataset of token dicts.

An example is a dict in transformers' causal-LM convention, labels aligned with the inputs
(the model shifts them), ``-100`` where there is no loss:

* sft / pt: ``{"input_ids": [...], "labels": [...]}`` (``labels`` absent: every token trains);
* dpo (and orpo, simpo): ``{"chosen_input_ids", "chosen_labels", "rejected_input_ids",
  "rejected_labels"}``, each the prompt and one answer (the prompt's labels -100).

With ``data_collator=None`` (the default collator) the examples become the same shifted
samples and rows ``hpc-mca train`` makes of its files (:class:`~hpc_mca.data.rows.RowDataset`:
padded to ``seq_length``, or packed best-fit when ``sequence_packing`` is on), so a script
and a YAML run of the same token ids train the same. A script's own collator gets the
examples of a micro-batch and returns padded ``[B, S]`` tensors ``input_ids``, ``labels``
(aligned, unshifted) and optionally ``attention_mask`` (1 on real tokens) and
``position_ids``; :func:`batch_from_collated` shifts the labels by one (the last slot then
trains nothing) and makes the trainer's :class:`~hpc_mca.data.batch.PackedBatch`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hpc_mca.data.batch import PackedBatch
from hpc_mca.data.errors import DataError
from hpc_mca.data.packing import pack_alignment
from hpc_mca.data.preference import pair_rows
from hpc_mca.data.rows import RowDataset
from hpc_mca.data.store import SampleStore, check_token_ids
from hpc_mca.data.tokenize import IGNORE_INDEX
from hpc_mca.stages import FEEDBACK, PREFERENCE_PAIR, get_stage

__all__ = ["CollatedRows", "batch_from_collated", "example_rows"]

PAIR_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")


def example_rows(dataset: Any, config: Any, pad_token_id: int, vocab_size: int, what: str) -> RowDataset:
    """The rows of ``dataset``'s examples for the default collator (module docstring)."""
    data, stage = config.data, get_stage(config.finetuning.stage)
    seq_length = data.seq_length or data.cutoff_len
    pairs = stage.reads == PREFERENCE_PAIR
    if stage.reads == FEEDBACK:  # an example and its KL row: made from records only
        raise DataError(f"{what}: stage {stage.name!r} reads its rows from data files only; valid: "
                        f"data.dataset for it, or a dataset object with stage sft, pt or dpo")
    samples = []
    for index in range(len(dataset)):
        example = dataset[index]
        parts = ((example_field(example, "chosen_input_ids", index, what),
                  example_field(example, "chosen_labels", index, what)),
                 (example_field(example, "rejected_input_ids", index, what),
                  example_field(example, "rejected_labels", index, what))) if pairs else (
            (example_field(example, "input_ids", index, what), example.get("labels")),)
        for ids, labels in parts:
            samples.append(_shifted(ids, labels, seq_length, index, what))
    store = SampleStore.from_samples(samples, {"examples": len(dataset), "samples": len(samples)})
    check_token_ids(store, vocab_size, what)
    align = pack_alignment(config.parallel.context_parallel_size, data.pack_alignment) if data.sequence_packing else 1
    if pairs:
        return pair_rows(store, seq_length, pad_token_id, packed=data.sequence_packing, align=align)
    return RowDataset(store, seq_length, pad_token_id, packed=data.sequence_packing, align=align)


def example_field(example: Any, key: str, index: int, what: str) -> Any:
    if not isinstance(example, Mapping) or key not in example:
        keys = sorted(example) if isinstance(example, Mapping) else type(example).__name__
        raise DataError(f"{what}[{index}] has no {key!r} (it has {keys}); valid: token dicts "
                        f"with {key!r} (see hpc_mca.api.data)")
    return example[key]


def _shifted(ids: Any, labels: Any, seq_length: int, index: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of one example: inputs all but the last token, targets the labels
    from the second on (the causal shift, done once here)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    labels = ids if labels is None else np.asarray(labels, dtype=np.int64).reshape(-1)
    if labels.shape != ids.shape:
        raise DataError(f"{what}[{index}]: labels has {labels.size} tokens, input_ids {ids.size}; "
                        f"valid: labels aligned with input_ids (-100 where nothing trains)")
    if ids.size < 2 or ids.size - 1 > seq_length:
        raise DataError(f"{what}[{index}] has {ids.size} tokens; valid: 2 to seq_length + 1 = "
                        f"{seq_length + 1} (data.seq_length, or data.cutoff_len)")
    return ids[:-1].astype(np.int32), labels[1:].astype(np.int32)


class CollatedRows(torch.utils.data.Dataset):
    """A script's dataset and collator: the loader samples its examples as it samples rows,
    and each micro-batch comes from the collator (:func:`batch_from_collated`)."""

    packed = False

    def __init__(self, dataset: Any, collator: Callable[[list[Any]], Mapping[str, Any]], pad_token_id: int,
                 vocab_size: int, what: str) -> None:
        self.dataset, self.collator, self.pad_token_id = dataset, collator, pad_token_id
        self.vocab_size, self.what = vocab_size, what

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def collate(self, examples: Sequence[Any]) -> PackedBatch:
        batch = batch_from_collated(self.collator(list(examples)), self.what)
        if int(batch.input_ids.max()) >= self.vocab_size or int(batch.input_ids.min()) < 0:
            raise DataError(f"{self.what}: the collator gave token id {int(batch.input_ids.max())}; "
                            f"valid: ids below the model's vocab_size {self.vocab_size}")
        return batch


def batch_from_collated(batch: Mapping[str, Any], what: str = "data_collator") -> PackedBatch:
    """The trainer's micro-batch of a collator's padded ``[B, S]`` dict (module docstring)."""
    for key in ("input_ids", "labels"):
        if key not in batch:
            raise DataError(f"{what} returned no {key!r} (it returned {sorted(batch)}); valid: "
                            f"a dict with input_ids and labels [batch, seq] (attention_mask, position_ids optional)")
    input_ids = torch.as_tensor(batch["input_ids"], dtype=torch.long)
    labels = torch.as_tensor(batch["labels"], dtype=torch.long)
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise DataError(f"{what}: input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)}; "
                        f"valid: both [batch, seq]")
    mask = batch.get("attention_mask")
    documents = (torch.ones_like(input_ids) if mask is None
                 else torch.as_tensor(mask, dtype=torch.long).clamp(max=1))
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids).contiguous()
    positions = torch.as_tensor(positions, dtype=torch.long)
    if bool((positions[:, 1:] < positions[:, :-1]).any()):
        raise DataError(f"{what}: position_ids restart inside a row (several documents packed in "
                        f"one); valid: padded rows of one example each, or data_collator=None "
                        f"with sequence_packing: true for packed rows")
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    return PackedBatch(input_ids, shifted, (shifted != IGNORE_INDEX).float(), positions, documents)
