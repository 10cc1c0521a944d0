"""Fixed-length training rows built from shifted samples, and their micro-batch collation.

A row has ``seq_length`` slots and holds either one sample followed by padding, or, packed,
several whole samples back to back (each starting at a multiple of ``align``) followed by
padding. Row fields (torch tensors):

* ``input_ids`` [S] int64 (padding: the tokenizer's pad id), ``labels`` [S] int64
  (``IGNORE_INDEX`` = -100 where there is no loss; replace it before a vocab-parallel loss),
  ``loss_mask`` [S] float32 (1 where ``labels`` is trained).
* ``attention_mask`` [S] int64: the number of the sample each slot belongs to (1, 2, ...) and
  0 for padding, the packed label mask of :mod:`hpc_mca.data.masks` (an unpacked row is 1s then
  0s, usable as a 1-D mask).
* ``position_ids`` [S] int64: restart at 0 for every sample.
* packed rows only: ``cu_seqlens`` [k+1] int32 (real lengths, leading 0) and
  ``cu_seqlens_padded`` [k+1] int32 (where each sample's slots start; the last sample's slots
  run to the end of the row).

:func:`collate_rows` stacks rows into ``[B, S]`` and, for packed rows, describes the whole
micro-batch as one THD stream of ``B * S`` slots: ``cu_seqlens`` over real lengths (from
:func:`hpc_mca.data.masks.get_seqlens_in_batch`), ``cu_seqlens_padded`` over slots, and
``max_seqlen``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .masks import get_seqlens_in_batch
from .packing import PackingReport, aligned, measure_packing, pack
from .store import Samples
from .tokenize import IGNORE_INDEX

_ROW_FIELDS = ("input_ids", "labels", "loss_mask", "attention_mask", "position_ids")


class RowDataset(torch.utils.data.Dataset):
    """Rows of ``seq_length`` slots over ``samples``; ``rows[r]`` lists the samples of row r.

    ``packed=False`` gives one sample per row. ``rows`` may be given explicitly (e.g. to pack
    chosen samples together); by default packed rows come from best-fit-decreasing.
    """

    def __init__(self, samples: Samples, seq_length: int, pad_token_id: int, *,
                 packed: bool, align: int = 1, rows: list[list[int]] | None = None) -> None:
        self.samples, self.seq_length, self.pad_token_id = samples, seq_length, pad_token_id
        self.packed, self.align = packed, align
        if rows is None:
            rows = (pack(samples.lengths, seq_length, align) if packed
                    else [[i] for i in range(len(samples))])
        self.rows = rows
        self._check_rows()

    def _check_rows(self) -> None:
        for r, members in enumerate(self.rows):
            if not self.packed and len(members) != 1:
                raise ValueError(f"row {r} holds {len(members)} samples but packed=False")
            used = sum(aligned(int(self.samples.lengths[i]), self.align) for i in members)
            if used > self.seq_length:
                raise ValueError(f"row {r} needs {used} slots; data.seq_length="
                                 f"{self.seq_length}")

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def report(self) -> PackingReport:
        """Real tokens / slots of these rows."""
        return measure_packing(self.samples.lengths, self.seq_length, self.align, self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        size = self.seq_length
        input_ids = np.full(size, self.pad_token_id, dtype=np.int64)
        labels = np.full(size, IGNORE_INDEX, dtype=np.int64)
        doc = np.zeros(size, dtype=np.int64)
        positions = np.zeros(size, dtype=np.int64)
        starts, lengths, at = [], [], 0
        for number, sample in enumerate(self.rows[index], start=1):
            ids, labs = self.samples.sample(sample)
            n = len(ids)
            input_ids[at:at + n], labels[at:at + n], doc[at:at + n] = ids, labs, number
            starts.append(at)
            lengths.append(n)
            at += aligned(n, self.align)
        for start, end in zip(starts, starts[1:] + [size]):
            positions[start:end] = np.arange(end - start)
        row = {"input_ids": input_ids, "labels": labels,
               "loss_mask": (labels != IGNORE_INDEX).astype(np.float32),
               "attention_mask": doc, "position_ids": positions}
        out = {key: torch.from_numpy(value) for key, value in row.items()}
        if self.packed:
            out["cu_seqlens"] = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32)
            out["cu_seqlens_padded"] = torch.tensor(starts + [size], dtype=torch.int32)
        return out


def collate_rows(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One micro-batch: row fields stacked to ``[B, S]``; packed rows also get the THD
    description of the flattened ``B * S`` stream (``cu_seqlens``, ``cu_seqlens_padded``,
    ``max_seqlen``)."""
    batch = {key: torch.stack([row[key] for row in rows]) for key in _ROW_FIELDS}
    if "cu_seqlens_padded" not in rows[0]:
        return batch
    size = batch["input_ids"].shape[1]
    cu, max_seqlen = get_seqlens_in_batch(batch["attention_mask"])
    padded = [torch.zeros(1, dtype=torch.int32)]
    padded += [row["cu_seqlens_padded"][1:] + b * size for b, row in enumerate(rows)]
    batch.update(cu_seqlens=cu, cu_seqlens_padded=torch.cat(padded), max_seqlen=max_seqlen)
    return batch
