"""A script's datasets as training rows: any map-style dataset of token dicts.

An example is a dict in transformers' causal-LM convention, labels aligned with the inputs
(the model shifts them), ``-100`` where there is no loss:

* sft / pt: ``{"input_ids": [...], "labels": [...]}`` (``labels`` absent: every token trains);
* dpo (and orpo, simpo): ``{"chosen_input_ids", "chosen_labels", "rejected_input_ids",
  "rejected_labels"}``, each the prompt and one answer (the prompt's labels -100).

With ``data_collator=None`` (the default collator) the examples become the same shifted
samples and rows ``hpc-mca train`` makes of its files (:class:`~hpc_mca.data.rows.RowDataset`:
padded to ``seq_length``, or packed best-fit when ``sequence_packing`` is on), so a script
and a YAML run of the same token ids train the same. A script's own collator is
:mod:`hpc_mca.api.collated`'s (both label conventions, LLaMA-Factory's pair layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from hpc_mca.data.errors import DataError
from hpc_mca.data.packing import pack_alignment
from hpc_mca.data.preference import pair_rows
from hpc_mca.data.rows import RowDataset
from hpc_mca.data.store import SampleStore, check_token_ids
from hpc_mca.stages import FEEDBACK, PREFERENCE_PAIR, get_stage

if TYPE_CHECKING:
    from hpc_mca.config.sections import TrainConfig

__all__ = ["example_rows"]

PAIR_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")


def example_rows(dataset: Any, config: TrainConfig, pad_token_id: int, vocab_size: int, what: str) -> RowDataset:
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
