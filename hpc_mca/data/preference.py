"""Preference pairs for stage dpo: records to chosen/rejected samples, and rows that keep the
two answers of a pair together.

Records use LLaMA-Factory's pairwise formats (read by :mod:`.conversation`):

* alpaca: ``instruction`` (optional ``input``, ``system``, ``history``), ``chosen`` and
  ``rejected`` as strings;
* sharegpt: ``conversations`` (or ``messages``) ending on the prompt side, ``chosen`` and
  ``rejected`` as one answer turn each (``{"from", "value"}`` or ``{"role", "content"}``),
  optional ``system``.

A pair becomes two shifted samples, chosen at index ``2p`` and rejected at ``2p + 1``, as
LLaMA-Factory's pairwise processor builds them (:func:`.samples.pairwise_samples`): both start
with the same prompt tokens (system prompt, earlier turns, the last prompt turn) and only the
answer carries labels. When prompt plus the longer answer exceed ``cutoff_len`` tokens, one
``infer_seqlen`` split cuts the prompt (kept from its start) and both answers, so the two
samples still share their prompt. A pair with an answer left with nothing to score (an empty
answer the template writes no token for) is dropped and counted.

Rows keep pairs whole. Unpacked, each sample is a row, and a sampling unit is a pair: a
micro-batch of ``per_device_train_batch_size`` pairs holds rows ``[c1, r1, c2, r2, ...]``.
Packed, whole pairs go into rows as neighbouring documents, and the unit is a packed row. In
both cases the documents of a micro-batch alternate chosen, rejected.

Pairs with images (a vision-language template, records with ``images`` and ``<image>``
placeholders, as for sft): the chosen and the rejected sample each hold the example's image
tokens, as LLaMA-Factory's pairwise processor writes them, so a micro-batch's pixels hold each
image once per sample, in the order of the samples' image tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from .batch import PackedBatch, collate_batch
from .encode import conversation_format, conversation_store, prepare_template
from .errors import DataError
from .packing import aligned, best_fit_decreasing
from .records import Record
from .rows import RowDataset
from .store import Samples, SampleStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .arguments import DataArguments
    from .multimodal import VisionInputs


def tokenize_pairs(records: list[Record], tokenizer: PreTrainedTokenizerBase, data: DataArguments,
                   vision: VisionInputs | None = None, media_root: str = "") -> SampleStore:
    """Shifted samples of pairwise records, chosen and rejected interleaved; with ``vision``
    (a vision-language template's) each keeps the pair's images."""
    for record in records:
        check_pairwise(record)
    fmt = conversation_format(records, data)
    return conversation_store(records, tokenizer, prepare_template(tokenizer, data), data, fmt, ranking=True,
                              vision=vision, media_root=media_root)


def check_pairwise(record: Record) -> None:
    """DataError (one line) when a record of a dpo dataset is not a pair."""
    if "chosen" not in record.data or "rejected" not in record.data:
        raise DataError(f"{record.where}: finetuning.stage='dpo' needs pairwise records "
                        f"('chosen' and 'rejected' answers); this one has keys "
                        f"{sorted(record.data)}")


class PairRows(RowDataset):
    """Unpacked pairs: every sample is a row and a sampling unit is a pair of rows."""

    def __len__(self) -> int:
        return len(self.rows) // 2

    def __getitem__(self, index: int) -> list[dict[str, torch.Tensor]]:  # type: ignore[override]
        return [RowDataset.__getitem__(self, 2 * index), RowDataset.__getitem__(self, 2 * index + 1)]

    @staticmethod
    def collate(items: Sequence[list[dict[str, torch.Tensor]]]) -> PackedBatch:
        return collate_batch([row for pair in items for row in pair])


def pair_rows(samples: Samples, seq_length: int, pad_token_id: int, *, packed: bool,
              align: int) -> RowDataset:
    """Rows that keep every pair (samples ``2p``, ``2p + 1``) in one micro-batch."""
    if not packed:
        return PairRows(samples, seq_length, pad_token_id, packed=False)
    lengths = samples.lengths
    slots = [aligned(int(lengths[2 * p]), align) + aligned(int(lengths[2 * p + 1]), align)
             for p in range(len(samples) // 2)]
    rows = [[i for p in sorted(row) for i in (2 * p, 2 * p + 1)]
            for row in best_fit_decreasing(slots, seq_length)]
    return RowDataset(samples, seq_length, pad_token_id, packed=True, align=align, rows=rows)


def split_pairs(samples: Samples, val_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample indices of the train and held-out pairs (``data.val_size`` counts pairs)."""
    pairs = len(samples) // 2
    n_val = int(val_size) if val_size >= 1 else max(1, round(val_size * pairs))
    if n_val >= pairs:
        raise DataError(f"data.val_size={val_size} leaves no training pairs out of {pairs}")
    order = np.random.default_rng(seed).permutation(pairs)

    def expand(chosen: np.ndarray) -> np.ndarray:
        return np.stack([2 * chosen, 2 * chosen + 1], axis=1).reshape(-1)

    return expand(np.sort(order[n_val:])), expand(np.sort(order[:n_val]))
