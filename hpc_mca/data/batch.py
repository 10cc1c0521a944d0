"""One micro-batch as one typed value, and this rank's context-parallel share of it.

:class:`PackedBatch` is what the data loaders yield (:func:`collate_batch` over
:func:`hpc_mca.data.rows.collate_rows`) and what the model inputs and the loss are made from
(:mod:`hpc_mca.trainer.step`): token ids, shifted labels, the loss mask, position ids, the
document of each slot and, for packed rows, the description of the flattened ``B * S`` stream
(``cu_seqlens`` over real lengths, ``cu_seqlens_padded`` over slots). :meth:`PackedBatch.cp_shard` cuts it for context
parallelism the way Megatron-Core and Transformer Engine expect:

* every sequence (a row when unpacked, a document's padded span when packed) is cut into
  ``2·cp`` equal chunks and rank ``r`` keeps chunks ``r`` and ``2·cp-1-r``. Under a causal
  mask early chunks attend to little and late ones to a lot, so the mirrored pair gives every
  rank the same attention work;
* a packed shard keeps the stream description of the whole batch. TE's context-parallel
  attention takes the global ``cu_seqlens`` together with each rank's tokens in this order
  (``thd_get_partitioned_indices`` computes the same indices).

Every sequence must be a multiple of ``2·cp`` slots long: the planner's sequence alignment
rule and the packer's ``align`` see to it, and a batch that breaks it is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from .errors import DataError
from .rows import collate_rows


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """A collated micro-batch. Unpacked: every tensor is [B, S]. Packed: [B, S] rows that are
    read as one stream of ``B * S`` slots (or [1, N] once flattened or sharded)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    """Shifted targets; -100 where there is no loss."""
    loss_mask: torch.Tensor
    """1.0 where ``labels`` is trained."""
    position_ids: torch.Tensor
    """Restart at 0 for every document."""
    documents: torch.Tensor
    """The document (1, 2, ...) each slot belongs to, 0 for padding."""
    cu_seqlens: torch.Tensor | None = None
    """Packed only: int32 [docs+1], document boundaries over real tokens (leading 0)."""
    cu_seqlens_padded: torch.Tensor | None = None
    """Packed only: int32 [docs+1], document boundaries over slots (each span padded)."""
    cp_size: int = 1
    """Context-parallel ranks the batch is split over (1: the whole batch)."""
    cp_rank: int = 0
    """Which share this is, once split (:meth:`cp_shard`)."""
    tags: torch.Tensor | None = None
    """kto only: int64 [examples], 1 where the example's answer is desirable (its ``kto_tag``);
    the rows are answer, KL row, answer, KL row, ... (:mod:`hpc_mca.data.feedback`)."""
    pixel_values: torch.Tensor | None = None
    """Vision-language only: float32 [patches, C·T·P·P], the processor's pixel values of every
    image of the micro-batch in the order their image tokens stand in ``input_ids`` read
    row-major; None for text."""
    image_grid_thw: torch.Tensor | None = None
    """Vision-language only: int64 [images, 3], each image's (t, h, w) patch grid, same order."""
    mrope_position_ids: torch.Tensor | None = None
    """Vision-language only: int64 [3, B, S], M-RoPE positions (temporal, height, width) of
    every slot, each document's as if it were alone (transformers' ``get_rope_index``)."""

    @classmethod
    def from_collated(cls, batch: Mapping[str, torch.Tensor]) -> PackedBatch:
        """From :func:`hpc_mca.data.rows.collate_rows`'s dict."""
        return cls(batch["input_ids"], batch["labels"], batch["loss_mask"],
                   batch["position_ids"], batch["attention_mask"],
                   batch.get("cu_seqlens"), batch.get("cu_seqlens_padded"),
                   pixel_values=batch.get("pixel_values"), image_grid_thw=batch.get("image_grid_thw"),
                   mrope_position_ids=batch.get("mrope_position_ids"))

    @property
    def has_images(self) -> bool:
        """A vision-language batch (its rows carry M-RoPE positions, images or not)."""
        return self.mrope_position_ids is not None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_padded is not None

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_length(self) -> int:
        """Slots per row (per shard row once sharded)."""
        return self.input_ids.shape[-1]

    @property
    def schedule_shape(self) -> tuple[int, int]:
        """(seq_length, micro_batch_size) for Megatron's schedule, which sizes the activations
        pipeline stages exchange from them (dividing the sequence by CP itself): the rows'
        length and count, or for packed rows the one ``[1, B·S]`` stream the model runs."""
        if self.packed:
            return self.input_ids.numel() * self.cp_size, 1
        return self.seq_length * self.cp_size, self.rows

    @property
    def input_tokens(self) -> int:
        """Non-padding input tokens (what throughput counts)."""
        return int((self.documents > 0).sum())

    def _token_fields(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in
                ("input_ids", "labels", "loss_mask", "position_ids", "documents")}

    def padded_to(self, seq_length: int) -> PackedBatch:
        """An unpacked batch with every row padded at its end to ``seq_length`` slots: token 0,
        no label, no document, positions running on. After the real tokens and under the
        causal mask, padding changes nothing the real tokens compute (how a pipeline's
        micro-batches get the one shape its stages exchange)."""
        extra = seq_length - self.seq_length
        if extra < 0 or self.packed or self.cp_size != 1:
            raise ValueError(f"cannot pad a batch of {self.seq_length} slots (packed={self.packed}, "
                             f"cp_size={self.cp_size}) to {seq_length}")
        if extra == 0:
            return self

        def padded(tensor: torch.Tensor, value: int) -> torch.Tensor:
            return torch.nn.functional.pad(tensor, (0, extra), value=value)

        last = self.position_ids[:, -1:]
        more = last + torch.arange(1, extra + 1, device=last.device)
        mrope = self.mrope_position_ids
        if mrope is not None:
            steps = torch.arange(1, extra + 1, device=mrope.device)
            mrope = torch.cat([mrope, mrope.amax(dim=(0, 2), keepdim=True).expand(3, -1, 1) + steps], dim=2)
        return dataclasses.replace(
            self, input_ids=padded(self.input_ids, 0), labels=padded(self.labels, -100),
            loss_mask=padded(self.loss_mask, 0), documents=padded(self.documents, 0),
            position_ids=torch.cat([self.position_ids, more], dim=1), mrope_position_ids=mrope)

    def cp_shard(self, cp_size: int, cp_rank: int) -> PackedBatch:
        """This CP rank's slots: chunks ``cp_rank`` and ``2·cp_size-1-cp_rank`` of every
        sequence (see the module docstring); the batch itself when ``cp_size`` is 1."""
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank={cp_rank} must be in [0, {cp_size})")
        if self.cp_size != 1:
            raise ValueError("this batch is already a context-parallel share")
        if cp_size == 1:
            return self
        if self.has_images:
            raise DataError(f"vision-language batches are not split over context parallelism "
                            f"(parallel.context_parallel_size={cp_size}); valid: context_parallel_size 1")
        index = self.cp_slots(cp_size, cp_rank)
        if self.packed:
            fields = {k: v.reshape(-1)[index.to(v.device)].unsqueeze(0)
                      for k, v in self._token_fields().items()}
        else:
            fields = {k: v[:, index.to(v.device)] for k, v in self._token_fields().items()}
        return dataclasses.replace(self, **fields, cp_size=cp_size, cp_rank=cp_rank)

    @property
    def num_documents(self) -> int:
        """Documents of the whole micro-batch: packed documents, or rows."""
        cu = self.cu_seqlens_padded  # set exactly when packed
        return len(cu) - 1 if cu is not None else self.rows

    def document_index(self) -> torch.Tensor:
        """int64, one per token of this batch (or share) in the model's flattened order: the
        document it belongs to, numbered 0.. over the whole micro-batch. A padding slot
        counts to the document whose span holds it (it carries no loss)."""
        if self.cu_seqlens_padded is None:  # not packed
            rows = torch.arange(self.rows, device=self.input_ids.device)
            return rows.unsqueeze(1).expand(self.input_ids.shape).reshape(-1)
        cu = self.cu_seqlens_padded.long()
        slots = (cp_indices(cu, self.cp_size, self.cp_rank) if self.cp_size > 1
                 else torch.arange(int(cu[-1])))
        return (torch.searchsorted(cu, slots, right=True) - 1).to(self.input_ids.device)

    def cp_slots(self, cp_size: int, cp_rank: int) -> torch.Tensor:
        """Where CP rank ``cp_rank``'s share sits in this (whole) batch: indices into the
        flattened stream when packed, column indices of every row otherwise."""
        if self.cu_seqlens_padded is not None:  # packed
            return cp_indices(self.cu_seqlens_padded, cp_size, cp_rank)
        return cp_indices(torch.tensor([0, self.seq_length]), cp_size, cp_rank, what="the row")


def collate_batch(rows: Sequence[dict[str, torch.Tensor]]) -> PackedBatch:
    """The data loaders' ``collate_fn``: rows of a :class:`~hpc_mca.data.rows.RowDataset` into
    one :class:`PackedBatch`."""
    return PackedBatch.from_collated(collate_rows(rows))


def cp_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int,
               what: str | None = None) -> torch.Tensor:
    """Slot indices of a packed stream that CP rank ``cp_rank`` keeps, in order: for each
    document's padded span, its chunks ``cp_rank`` and ``2·cp_size-1-cp_rank``. ``what``
    names a span in errors (default: the document and its slots)."""
    firsts, lengths = cp_pieces(cu_seqlens_padded, cp_size, cp_rank, what)
    offsets = lengths.cumsum(0) - lengths  # where each piece starts among this rank's slots
    return torch.arange(int(lengths.sum())) + (firsts - offsets).repeat_interleave(lengths)


def cp_pieces(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int,
              what: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(first stream slot, length) of each chunk CP rank ``cp_rank`` keeps, two per document
    (chunk ``cp_rank``, then chunk ``2·cp_size-1-cp_rank``), in the order it holds them."""
    cu = cu_seqlens_padded.detach().cpu().long()
    spans = cu[1:] - cu[:-1]
    bad = (spans % (2 * cp_size)).nonzero()
    if bad.numel():
        doc = int(bad[0])
        _chunk(int(spans[doc]), cp_size,
               what or f"document {doc} (slots {int(cu[doc])}..{int(cu[doc + 1])})")
    chunk = spans // (2 * cp_size)
    firsts = torch.stack([cu[:-1] + cp_rank * chunk,
                          cu[:-1] + (2 * cp_size - 1 - cp_rank) * chunk], dim=1)
    return firsts.reshape(-1), chunk.repeat_interleave(2)


def _chunk(length: int, cp_size: int, what: str) -> int:
    if length % (2 * cp_size):
        raise DataError(f"{what} is {length} slots long, not a multiple of 2·CP={2 * cp_size} "
                        f"(context_parallel_size={cp_size}); valid: pad every sequence to a "
                        f"multiple of {2 * cp_size}")
    return length // (2 * cp_size)
