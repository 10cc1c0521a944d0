"""The standard backend's view of the shared data pipeline: micro-batches as one packed stream.

The rows come from the same datasets and the same resumable, data-parallel sampler as the
Megatron backend's (:mod:`hpc_mca.data.dataset`). A micro-batch of ``B`` rows of ``S`` slots
becomes one stream ``[1, B·S]``: each row's documents restart their position ids, so the
packed attention (:mod:`hpc_mca.models.hf_attention`) keeps every document to itself, and a
row's padding continues its last document after the real tokens with label -100 (causal
attention keeps it out of them). Labels are already the next token's.

Under Ulysses sequence parallelism every rank of an SP group reads the same rows (the sampler
shards over data-parallel groups, not ranks) and keeps its slice of the stream
(:func:`hpc_mca.runtime.sequence_parallel.slice_and_pad`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hpc_mca.data.arguments import DataRun
from hpc_mca.data.batch import PackedBatch
from hpc_mca.data.dataset import eval_dataloader, train_dataloader
from hpc_mca.data.rows import RowDataset
from hpc_mca.runtime.sequence_parallel import slice_and_pad

__all__ = ["StreamLoader", "eval_streams", "model_inputs", "stream_of"]


def stream_of(batch: PackedBatch, *, sp_rank: int = 0, sp_size: int = 1,
              pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """This rank's part of a micro-batch as model inputs: ``input_ids``, ``position_ids`` and
    ``labels``, each ``[1, B·S / sp]`` (the stream padded to a multiple of ``sp_size``); for
    the per-document sums of dpo also ``documents`` (the document of each slot, numbered 0..
    over the micro-batch; SP padding counts to document 0 and carries no label) and
    ``num_documents``; for kto ``tags``. A vision-language batch (:func:`_vision_stream`) adds
    its images and makes ``position_ids`` ``[4, 1, B·S]``."""
    ids, pos, labels = (getattr(batch, key).reshape(1, -1)
                        for key in ("input_ids", "position_ids", "labels"))
    documents = batch.document_index().reshape(1, -1)
    count = torch.tensor(batch.num_documents)
    extra = {"tags": batch.tags} if batch.tags is not None else {}  # kto's feedback
    if batch.has_images:
        if sp_size != 1:  # the config rules refuse it (a slice's image tokens ≠ its images)
            raise ValueError(f"sequence_parallel_size={sp_size} with images; valid: 1")
        extra.update(_vision_stream(batch, pos))
    if sp_size == 1:
        return {"input_ids": ids, "position_ids": pos, "labels": labels,
                "documents": documents, "num_documents": count, **extra}
    part = slice_and_pad(ids, pos, labels, rank=sp_rank, size=sp_size, pad_token_id=pad_token_id)
    width = part.input_ids.size(1)
    assert part.labels is not None  # slice_and_pad returns the labels it was given
    documents = torch.cat([documents, documents.new_zeros(1, part.pad)], dim=1)
    return {"input_ids": part.input_ids, "position_ids": part.position_ids,
            "labels": part.labels, "documents": documents[:, sp_rank * width:(sp_rank + 1) * width],
            "num_documents": count, **extra}


def _vision_stream(batch: PackedBatch, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a vision-language batch adds to its stream: ``pixel_values`` and
    ``image_grid_thw`` (already in the order of their image tokens in the flattened row, when
    there are images), and ``position_ids`` ``[4, 1, B·S]`` as transformers' Qwen2-VL takes
    packed rows: the text positions first (restarting per document: what the packed attention
    reads to tell documents apart), then the three M-RoPE rows (what its rope rotates by)."""
    assert batch.mrope_position_ids is not None  # batch.has_images
    mrope = batch.mrope_position_ids.reshape(3, 1, -1)
    out = {"position_ids": torch.cat([positions[None], mrope.to(positions)], dim=0)}
    if batch.pixel_values is not None and batch.image_grid_thw is not None:
        out.update(pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw)
    return out


def model_inputs(stream: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword arguments of the transformers model's forward in a stream: the tokens, their
    positions and, for a vision-language batch with images, the images."""
    return {key: stream[key] for key in ("input_ids", "position_ids", "pixel_values", "image_grid_thw")
            if key in stream}


class StreamLoader:
    """Endless training streams of this rank from ``consumed_samples`` on (no ``len``: the
    run's length is ``max_steps``). Also counts the non-padding input tokens it handed out,
    for throughput."""

    def __init__(self, rows: RowDataset, run: DataRun, *, data_parallel_rank: int, consumed_samples: int,
                 sp_rank: int, sp_size: int, pad_token_id: int) -> None:
        self.rows, self.run = rows, run
        self.dp_rank, self.consumed = data_parallel_rank, consumed_samples
        self.sp_rank, self.sp_size, self.pad = sp_rank, sp_size, pad_token_id
        self.input_tokens = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        loader = train_dataloader(self.rows, self.run, data_parallel_rank=self.dp_rank,
                                  consumed_samples=self.consumed)
        for batch in loader:
            # Counted once per SP group (its ranks read the same rows).
            self.input_tokens += batch.input_tokens if self.sp_rank == 0 else 0
            yield stream_of(batch, sp_rank=self.sp_rank, sp_size=self.sp_size,
                            pad_token_id=self.pad)


def eval_streams(rows: RowDataset, run: DataRun, *, data_parallel_rank: int, sp_rank: int,
                 sp_size: int, pad_token_id: int) -> Iterator[tuple[PackedBatch, dict[str, torch.Tensor]]]:
    """One pass over the eval rows: (the micro-batch, this rank's stream of it)."""
    for batch in eval_dataloader(rows, run, data_parallel_rank=data_parallel_rank):
        yield batch, stream_of(batch, sp_rank=sp_rank, sp_size=sp_size, pad_token_id=pad_token_id)
