"""hpc_mca.data.packing / rows: best-fit-decreasing, efficiency, packed and padded rows."""

import random

import numpy as np
import pytest
import torch

from hpc_mca.data.errors import DataError
from hpc_mca.data.masks import get_seqlens_in_batch
from hpc_mca.data.packing import best_fit_decreasing, measure_packing, pack
from hpc_mca.data.rows import RowDataset, collate_rows
from hpc_mca.data.store import SampleStore
from hpc_mca.data.tokenize import IGNORE_INDEX


def _reference_bfd_loads(lengths: list[int], capacity: int) -> list[int]:
    """Textbook best-fit decreasing, O(n * rows): sorted row loads."""
    loads: list[int] = []
    for need in sorted(lengths, reverse=True):
        fits = [r for r, load in enumerate(loads) if load + need <= capacity]
        if fits:
            best = max(fits, key=lambda r: loads[r])
            loads[best] += need
        else:
            loads.append(need)
    return sorted(loads)


def long_tailed(n: int, seq_length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [min(seq_length, max(1, int(rng.lognormvariate(5.0, 1.0)))) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_bfd_places_each_sample_once_and_matches_reference(seed: int):
    lengths = long_tailed(300, 512, seed)
    rows = best_fit_decreasing(lengths, 512)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    loads = sorted(sum(lengths[i] for i in row) for row in rows)
    assert max(loads) <= 512
    assert loads == _reference_bfd_loads(lengths, 512)
    assert rows == best_fit_decreasing(lengths, 512)  # deterministic


def test_long_tailed_efficiency_is_high():
    lengths = long_tailed(5000, 2048)
    report = measure_packing(lengths, 2048)
    assert report.efficiency >= 0.98
    assert report.padding_efficiency < 0.2
    assert report.real_tokens == sum(lengths)


def test_sample_longer_than_a_row_is_refused():
    with pytest.raises(DataError, match="sample 1 has 9 tokens; a packed row holds 1..8"):
        best_fit_decreasing([3, 9], 8)


def _store(lengths: list[int], seed: int = 0) -> SampleStore:
    rng = np.random.default_rng(seed)
    samples = []
    for n in lengths:
        ids = rng.integers(3, 50, n + 1).astype(np.int32)
        trained = rng.random(n + 1) < 0.6
        trained[-1] = True
        samples.append((ids[:-1], np.where(trained[1:], ids[1:], IGNORE_INDEX).astype(np.int32)))
    return SampleStore.from_samples(samples)


def test_packed_row_fields():
    store = _store([3, 5, 2])
    rows = RowDataset(store, 12, pad_token_id=0, packed=True, rows=[[0, 1, 2]])
    row = rows[0]
    assert row["attention_mask"].tolist() == [1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 0, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert row["cu_seqlens"].tolist() == [0, 3, 8, 10]
    assert row["cu_seqlens_padded"].tolist() == [0, 3, 8, 12]
    assert row["input_ids"][10:].tolist() == [0, 0]
    assert row["labels"][10:].tolist() == [IGNORE_INDEX] * 2
    assert torch.equal(row["loss_mask"], (row["labels"] != IGNORE_INDEX).float())
    expected = np.concatenate([store.sample(i)[1] for i in range(3)])
    assert row["labels"][:10].tolist() == expected.tolist()


def test_alignment_for_context_parallel():
    rows = RowDataset(_store([3, 5, 2]), 16, pad_token_id=0, packed=True, align=4,
                      rows=[[0, 1, 2]])
    row = rows[0]
    assert row["cu_seqlens"].tolist() == [0, 3, 8, 10]
    assert row["cu_seqlens_padded"].tolist() == [0, 4, 12, 16]
    assert row["position_ids"][:12].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    assert row["attention_mask"][:12].tolist() == [1, 1, 1, 0, 2, 2, 2, 2, 2, 0, 0, 0]


def test_overfull_explicit_row_is_refused():
    with pytest.raises(ValueError, match="row 0 needs 10 slots; data.seq_length=8"):
        RowDataset(_store([5, 5]), 8, pad_token_id=0, packed=True, rows=[[0, 1]])


def test_collate_describes_one_thd_stream():
    store = _store([3, 5, 2, 6])
    rows = RowDataset(store, 8, pad_token_id=0, packed=True, rows=[[0, 1], [2, 3]])
    batch = collate_rows([rows[0], rows[1]])
    assert batch["input_ids"].shape == (2, 8)
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 10, 16]
    assert batch["cu_seqlens_padded"].tolist() == [0, 3, 8, 10, 16]
    assert int(batch["max_seqlen"]) == 6
    cu, _ = get_seqlens_in_batch(batch["attention_mask"])
    assert torch.equal(cu, batch["cu_seqlens"])
    rows = RowDataset(store, 10, pad_token_id=0, packed=True, rows=[[0, 2], [1]])
    batch = collate_rows([rows[0], rows[1]])
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 10]
    assert batch["cu_seqlens_padded"].tolist() == [0, 3, 10, 20]


def _tiny_causal_lm_loss(batch: dict, packed: bool) -> torch.Tensor:
    """Sum of token losses of a fixed one-layer attention LM; documents never see each other."""
    torch.manual_seed(0)
    emb, pos = torch.nn.Embedding(64, 16), torch.nn.Embedding(64, 16)
    head = torch.nn.Linear(16, 64)
    x = emb(batch["input_ids"]) + pos(batch["position_ids"])
    doc = batch["attention_mask"]
    seq = doc.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    if packed:
        same = doc[:, :, None] == doc[:, None, :]
        allowed = causal & same & (doc[:, :, None] > 0)
    else:
        allowed = causal & (doc[:, None, :] > 0)
    allowed = allowed | torch.eye(seq, dtype=torch.bool)  # keep padding rows finite
    out = torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None],
                                                           attn_mask=allowed[:, None])[:, 0]
    logits = head(out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch["labels"].reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="sum")


def test_packed_and_padded_rows_give_the_same_loss():
    store = _store([7, 3, 5, 9, 2, 4], seed=1)
    packed = RowDataset(store, 16, pad_token_id=0, packed=True)
    padded = RowDataset(store, 16, pad_token_id=0, packed=False)
    assert len(packed) < len(padded) == 6
    packed_loss = _tiny_causal_lm_loss(collate_rows([packed[i] for i in range(len(packed))]), True)
    padded_loss = _tiny_causal_lm_loss(collate_rows([padded[i] for i in range(6)]), False)
    assert packed_loss.item() == pytest.approx(padded_loss.item(), rel=1e-5)
    tokens = sum(float(packed[i]["loss_mask"].sum()) for i in range(len(packed)))
    assert tokens == sum(float(padded[i]["loss_mask"].sum()) for i in range(6))


def test_row_report_counts_real_tokens():
    store = _store([7, 3, 5, 9, 2, 4])
    rows = RowDataset(store, 16, pad_token_id=0, packed=True)
    assert rows.rows == pack(store.lengths, 16)
    assert rows.report.efficiency == pytest.approx(30 / (16 * len(rows)))
