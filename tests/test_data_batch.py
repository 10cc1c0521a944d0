"""PackedBatch and its context-parallel shard (hpc_mca/data/batch.py): the mirrored 2·CP
chunk layout, every slot on exactly one CP rank, equal work per rank, misalignment refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpc_mca.data.batch import PackedBatch, cp_indices
from hpc_mca.data.errors import DataError
from hpc_mca.data.rows import RowDataset, collate_rows
from hpc_mca.data.store import SampleStore


def _unpacked(rows: int, length: int) -> PackedBatch:
    slots = torch.arange(rows * length).reshape(rows, length)
    return PackedBatch(input_ids=slots, labels=slots + 1000, loss_mask=torch.ones(rows, length),
                       position_ids=torch.arange(length).repeat(rows, 1),
                       documents=torch.ones(rows, length, dtype=torch.long))


def test_unpacked_rows_keep_the_mirrored_chunk_pair():
    batch = _unpacked(2, 8)
    assert batch.cp_shard(2, 0).position_ids.tolist() == [[0, 1, 6, 7]] * 2
    assert batch.cp_shard(2, 1).position_ids.tolist() == [[2, 3, 4, 5]] * 2
    assert batch.cp_shard(4, 1).position_ids.tolist() == [[1, 6]] * 2
    shard = batch.cp_shard(2, 1)
    assert torch.equal(shard.labels, shard.input_ids + 1000)  # fields move together
    assert batch.cp_shard(1, 0) is batch


def test_packed_documents_are_cut_one_by_one():
    # Three documents padded to 4, 8 and 4 slots: chunks of 1, 2 and 1 slots at CP=2.
    bounds = torch.tensor([0, 4, 12, 16], dtype=torch.int32)
    assert cp_indices(bounds, 2, 0).tolist() == [0, 3, 4, 5, 10, 11, 12, 15]
    assert cp_indices(bounds, 2, 1).tolist() == [1, 2, 6, 7, 8, 9, 13, 14]


@pytest.mark.parametrize("cp", [2, 4])
def test_collated_packed_batch_splits_into_equal_disjoint_shards(cp):
    rng = np.random.default_rng(3)
    samples = []
    for length in (5, 9, 3, 14, 7, 2):
        ids = rng.integers(1, 50, length)
        samples.append((ids, np.where(rng.random(length) < 0.7, ids, -100)))
    rows = RowDataset(SampleStore.from_samples(samples), 32, pad_token_id=0, packed=True,
                      align=2 * cp)
    collated = collate_rows([rows[i] for i in range(len(rows))])
    batch = PackedBatch.from_collated(collated)
    shards = [batch.cp_shard(cp, r) for r in range(cp)]
    total = collated["input_ids"].numel()
    assert all(s.input_ids.shape == (1, total // cp) for s in shards)
    # Every slot on exactly one rank: mark each slot by its flat index.
    seen = torch.cat([cp_indices(batch.cu_seqlens_padded, cp, r) for r in range(cp)])
    assert sorted(seen.tolist()) == list(range(total))
    # The shards carry the batch's tokens, labels and loss mask, nothing lost or repeated.
    assert sum(float(s.loss_mask.sum()) for s in shards) == float(collated["loss_mask"].sum())
    for r, shard in enumerate(shards):
        index = cp_indices(batch.cu_seqlens_padded, cp, r)
        assert torch.equal(shard.labels[0], collated["labels"].reshape(-1)[index])
        assert torch.equal(shard.cu_seqlens, batch.cu_seqlens)  # the global description stays


def test_a_sequence_not_a_multiple_of_2cp_is_refused():
    with pytest.raises(DataError, match=r"the row is 6 slots long, not a multiple of 2·CP=4"):
        _unpacked(1, 6).cp_shard(2, 0)
    bounds = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(DataError, match=r"document 1 \(slots 4..10\) is 6 slots long"):
        cp_indices(bounds, 2, 1)
    with pytest.raises(ValueError, match=r"cp_rank=2 must be in \[0, 2\)"):
        _unpacked(1, 8).cp_shard(2, 2)


@pytest.mark.parametrize("packed", [False, True])
def test_the_loaders_yield_packed_batches_the_model_inputs_read(packed):
    """What the data loaders hand the trainer (collate_batch) and what the step feeds Megatron
    (model_inputs): the collated tensors unchanged; a packed batch flattened to one [1, B*S]
    stream with its document boundaries; ignored labels as token 0 with loss weight 0."""
    from hpc_mca.data.batch import collate_batch
    from hpc_mca.trainer.step import model_inputs

    samples = [(np.arange(1, n + 1), np.where(np.arange(n) % 3, np.arange(1, n + 1), -100))
               for n in (5, 9, 3, 7)]
    rows = RowDataset(SampleStore.from_samples(samples), 16, pad_token_id=0, packed=packed)
    picked = [rows[i] for i in range(len(rows))]
    batch, collated = collate_batch(picked), collate_rows(picked)
    assert batch.packed == packed and batch.rows == len(rows) and batch.seq_length == 16
    assert batch.input_tokens == 5 + 9 + 3 + 7 == int((collated["attention_mask"] > 0).sum())
    inputs = model_inputs(batch, torch.device("cpu"))
    shape = (1, batch.rows * 16) if packed else (batch.rows, 16)
    assert inputs["input_ids"].shape == shape
    assert torch.equal(inputs["labels"].reshape(-1), collated["labels"].clamp(min=0).reshape(-1))
    assert torch.equal(inputs["loss_mask"].reshape(-1) > 0, collated["labels"].reshape(-1) >= 0)
    params = inputs["packed_seq_params"]
    if packed:
        assert params.cu_seqlens_q.tolist() == collated["cu_seqlens"].tolist()
        assert params.cu_seqlens_q_padded.tolist() == collated["cu_seqlens_padded"].tolist()
    else:
        assert params is None


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_indices_equal_the_per_document_loop(cp):
    """The vectorised indices equal cutting each document's span by hand, 300 documents."""
    gen = torch.Generator().manual_seed(cp)
    spans = torch.randint(1, 6, (300,), generator=gen) * 2 * cp
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), spans.cumsum(0)])
    for rank in range(cp):
        want = []
        for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            chunk = (end - start) // (2 * cp)
            for piece in (rank, 2 * cp - 1 - rank):
                want += range(start + piece * chunk, start + (piece + 1) * chunk)
        assert cp_indices(bounds, cp, rank).tolist() == want
