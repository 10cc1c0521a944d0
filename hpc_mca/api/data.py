"""A script's datasets as training rows: any map-style dataset of token dicts.

An example is a dict in transformers' causal-LM convention, labels aligned with the inputs
(the model shifts them), ``-100`` where there is no loss:

* sft / pt: ``{"input_ids": [...], "labels": [...]}`` (``labels`` absent: every token trains);
* dpo (and orpo, simpo): ``{"chosen_input_ids", "chosen_labels", "rejected_input_ids",
  "rejected_labels"}``, each the prompt and one answer (the prompt's labels -100).

The layout follows how the stage reads its rows (its registry row's ``reads``,
:data:`EXAMPLE_KEYS`), never its name: a stage reading rows as one of these does needs no edit
here. Unpaired feedback (kto) has no layout: its KL rows are built from records (data files).

With ``data_collator=None`` (the default collator) the examples become the same shifted
samples and rows ``hpc-mca train`` makes of its files (:class:`~hpc_mca.data.rows.RowDataset`:
padded to ``seq_length``, or packed best-fit when ``sequence_packing`` is on), so a script
and a YAML run of the same token ids train the same. A script's own collator is
:mod:`hpc_mca.api.collated`'s (both label conventions, LLaMA-Factory's pair layout).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hpc_mca.data.errors import DataError
from hpc_mca.data.packing import pack_alignment
from hpc_mca.data.preference import pair_rows
from hpc_mca.data.rows import RowDataset
from hpc_mca.data.store import SampleStore, check_token_ids
from hpc_mca.stages import CONVERSATION, PREFERENCE_PAIR, TEXT, get_stage, stages_with

if TYPE_CHECKING:
    from hpc_mca.config.sections import TrainConfig

__all__ = ["example_rows"]

PAIR_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
EXAMPLE_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    TEXT: (("input_ids", "labels"),),
    CONVERSATION: (("input_ids", "labels"),),
    PREFERENCE_PAIR: (("chosen_input_ids", "chosen_labels"), ("rejected_input_ids", "rejected_labels")),
}
"""How an example of each kind of rows is laid out: (input ids key, labels key) per row, in the
row order (``labels`` may be absent from a one-row example: every token trains)."""


class ExampleDataset(Protocol):
    """A map-style dataset: ``len`` and examples by index (a ``datasets.Dataset``, a list)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> object: ...


def example_rows(dataset: ExampleDataset, config: TrainConfig, pad_token_id: int, vocab_size: int,
                 what: str) -> RowDataset:
    """The rows of ``dataset``'s examples for the default collator (module docstring)."""
    data, stage = config.data, get_stage(config.finetuning.stage)
    seq_length = data.seq_length or data.cutoff_len
    if stage.reads not in EXAMPLE_KEYS:  # unpaired feedback: its KL rows are made from records
        accepted = ", ".join(stages_with(lambda other: other.reads in EXAMPLE_KEYS))
        raise DataError(f"{what}: stage {stage.name!r} reads its rows from data files only; valid: "
                        f"data.dataset for it, or a dataset object with stage {accepted}")
    layout = EXAMPLE_KEYS[stage.reads]
    samples = []
    for index in range(len(dataset)):
        example = dataset[index]
        if len(layout) == 1:
            ids_key, labels_key = layout[0]
            labels = example.get(labels_key) if isinstance(example, Mapping) else None
            parts: Sequence[tuple[object, object]] = ((example_field(example, ids_key, index, what), labels),)
        else:
            parts = [(example_field(example, ids_key, index, what), example_field(example, labels_key, index, what))
                     for ids_key, labels_key in layout]
        for ids, labels in parts:
            samples.append(_shifted(ids, labels, seq_length, index, what))
    store = SampleStore.from_samples(samples, {"examples": len(dataset), "samples": len(samples)})
    check_token_ids(store, vocab_size, what)
    align = pack_alignment(config.parallel.context_parallel_size, data.pack_alignment) if data.sequence_packing else 1
    if len(layout) == 2:  # the pair's rows kept together
        return pair_rows(store, seq_length, pad_token_id, packed=data.sequence_packing, align=align)
    return RowDataset(store, seq_length, pad_token_id, packed=data.sequence_packing, align=align)


def example_field(example: object, key: str, index: int, what: str) -> Any:  # Any: the dataset's own value
    if not isinstance(example, Mapping) or key not in example:
        keys = sorted(example) if isinstance(example, Mapping) else type(example).__name__
        raise DataError(f"{what}[{index}] has no {key!r} (it has {keys}); valid: token dicts "
                        f"with {key!r} (see hpc_mca.api.data)")
    return example[key]


def _shifted(ids: object, labels: object, seq_length: int, index: int, what: str
             ) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of one example: inputs all but the last token, targets the labels
    from the second on (the causal shift, done once here)."""
    tokens = np.asarray(ids, dtype=np.int64).reshape(-1)
    targets = tokens if labels is None else np.asarray(labels, dtype=np.int64).reshape(-1)
    if targets.shape != tokens.shape:
        raise DataError(f"{what}[{index}]: labels has {targets.size} tokens, input_ids {tokens.size}; "
                        f"valid: labels aligned with input_ids (-100 where nothing trains)")
    if tokens.size < 2 or tokens.size - 1 > seq_length:
        raise DataError(f"{what}[{index}] has {tokens.size} tokens; valid: 2 to seq_length + 1 = "
                        f"{seq_length + 1} (data.seq_length, or data.cutoff_len)")
    return tokens[:-1].astype(np.int32), targets[1:].astype(np.int32)
