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
* vision-language rows only (``vision`` set): ``pixel_values`` [patches, C·T·P·P] float32 and
  ``image_grid_thw`` [images, 3] int64 of the row's samples' images in the order their tokens
  stand in the row (computed here from the cached paths, as LLaMA-Factory's collator does),
  and ``mrope_position_ids`` [3, S] int64, each sample's M-RoPE positions
  (:func:`hpc_mca.data.mrope.rope_index`) restarting at 0 like ``position_ids`` (padding
  slots: positions running on from the last sample's, no loss there).

:func:`collate_rows` stacks rows into ``[B, S]`` and, for packed rows, describes the whole
micro-batch as one THD stream of ``B * S`` slots: ``cu_seqlens`` over real lengths (from
:func:`hpc_mca.data.masks.get_seqlens_in_batch`), ``cu_seqlens_padded`` over slots, and
``max_seqlen``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from .errors import DataError
from .masks import get_seqlens_in_batch
from .mrope import rope_index
from .packing import PackingReport, aligned, measure_packing, pack
from .store import Samples
from .tokenize import IGNORE_INDEX

if TYPE_CHECKING:
    from .multimodal import VisionInputs

_ROW_FIELDS = ("input_ids", "labels", "loss_mask", "attention_mask", "position_ids")


class RowDataset(torch.utils.data.Dataset):
    """Rows of ``seq_length`` slots over ``samples``; ``rows[r]`` lists the samples of row r.

    ``packed=False`` gives one sample per row. ``rows`` may be given explicitly (e.g. to pack
    chosen samples together); by default packed rows come from best-fit-decreasing.
    """

    vision: VisionInputs | None = None
    """A vision-language run's image processor and tokens: rows then carry their images'
    pixels, grids and M-RoPE positions (set by the pipeline after the rows are made)."""

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
        if self.vision is not None:
            row.update(self._vision_fields(index, input_ids, starts, lengths))
        out = {key: torch.from_numpy(value) for key, value in row.items()}
        if self.packed:
            out["cu_seqlens"] = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32)
            out["cu_seqlens_padded"] = torch.tensor(starts + [size], dtype=torch.int32)
        return out


    def _vision_fields(self, index: int, input_ids: np.ndarray, starts: list[int],
                       lengths: list[int]) -> dict[str, np.ndarray]:
        vision = self.vision
        assert vision is not None
        images = getattr(self.samples, "images", None)
        pixels, grids = [], []
        mrope = np.zeros((3, self.seq_length), dtype=np.int64)
        end = 0
        for sample, start, n in zip(self.rows[index], starts, lengths):
            paths, cached = images(sample) if images is not None else ((), np.zeros((0, 3), dtype=np.int64))
            if paths:
                where = f"sample {sample} (images {', '.join(paths)})"
                values, grid = vision.pixels(paths, where)
                if not np.array_equal(grid, cached):
                    raise DataError(f"{where}: the images' grids {grid.tolist()} differ from the tokenized "
                                    f"{cached.tolist()} (an image changed since); valid: data.overwrite_cache=true")
                pixels.append(values)
                grids.append(grid)
            mrope[:, start:start + n] = rope_index(input_ids[start:start + n], cached, vision.image_token_id,
                                                   vision.merge)
            end = start + n
        if end < self.seq_length:  # padding: positions run on (no loss there)
            mrope[:, end:] = int(mrope[:, :end].max(initial=-1)) + 1 + np.arange(self.seq_length - end)
        width = self._pixel_width(pixels)
        return {"pixel_values": np.concatenate(pixels) if pixels else np.zeros((0, width), dtype=np.float32),
                "image_grid_thw": np.concatenate(grids) if grids else np.zeros((0, 3), dtype=np.int64),
                "mrope_position_ids": mrope}

    def _pixel_width(self, pixels: list[np.ndarray]) -> int:
        """C·T·P·P of the processor (so that a row without images has a [0, width] tensor)."""
        if pixels:
            return int(pixels[0].shape[1])
        processor = getattr(self.vision, "processor", None)
        patch = int(getattr(processor, "patch_size", 14))
        return 3 * int(getattr(processor, "temporal_patch_size", 2)) * patch * patch


def collate_rows(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One micro-batch: row fields stacked to ``[B, S]``; packed rows also get the THD
    description of the flattened ``B * S`` stream (``cu_seqlens``, ``cu_seqlens_padded``,
    ``max_seqlen``)."""
    batch = {key: torch.stack([row[key] for row in rows]) for key in _ROW_FIELDS}
    if "mrope_position_ids" in rows[0]:  # vision-language rows: images in row-major token order
        batch["pixel_values"] = torch.cat([row["pixel_values"] for row in rows])
        batch["image_grid_thw"] = torch.cat([row["image_grid_thw"] for row in rows])
        batch["mrope_position_ids"] = torch.stack([row["mrope_position_ids"] for row in rows], dim=1)
    if "cu_seqlens_padded" not in rows[0]:
        return batch
    size = batch["input_ids"].shape[1]
    cu, max_seqlen = get_seqlens_in_batch(batch["attention_mask"])
    padded = [torch.zeros(1, dtype=torch.int32)]
    padded += [row["cu_seqlens_padded"][1:] + b * size for b, row in enumerate(rows)]
    batch.update(cu_seqlens=cu, cu_seqlens_padded=torch.cat(padded), max_seqlen=max_seqlen)
    return batch
