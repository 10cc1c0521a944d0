"""hpc_mca.data.sampler: seed-determined order, data-parallel slices, exact resume."""

import itertools

import pytest

from hpc_mca.data.errors import DataError
from hpc_mca.data.sampler import DataSampler


def _take(sampler: DataSampler, micro_batches: int) -> list[list[int]]:
    return list(itertools.islice(iter(sampler), micro_batches))


def _global_stream(num: int, mbs: int, dp: int, gbs: int, seed: int, consumed: int,
                   steps: int) -> list[int]:
    """Interleave the ranks' micro-batches back into the global sample order."""
    ranks = [_take(DataSampler(num, micro_batch_size=mbs, data_parallel_rank=r,
                               data_parallel_size=dp, global_batch_size=gbs, seed=seed,
                               consumed_samples=consumed), steps) for r in range(dp)]
    return [i for step in zip(*ranks) for micro in step for i in micro]


def test_same_seed_same_order_other_seed_other_order():
    a = _take(DataSampler(50, micro_batch_size=5, global_batch_size=10, seed=1), 10)
    b = _take(DataSampler(50, micro_batch_size=5, global_batch_size=10, seed=1), 10)
    c = _take(DataSampler(50, micro_batch_size=5, global_batch_size=10, seed=2), 10)
    assert a == b != c
    assert sorted(i for micro in a for i in micro) == list(range(50))  # one epoch, each once


def test_ranks_take_disjoint_slices_of_each_global_batch():
    num, mbs, dp, gbs = 40, 2, 2, 8
    one_rank = _global_stream(num, mbs * dp, 1, gbs, 3, 0, 10)
    assert _global_stream(num, mbs, dp, gbs, 3, 0, 10) == one_rank
    rank0 = _take(DataSampler(num, micro_batch_size=mbs, data_parallel_rank=0,
                              data_parallel_size=dp, global_batch_size=gbs, seed=3), 2)
    rank1 = _take(DataSampler(num, micro_batch_size=mbs, data_parallel_rank=1,
                              data_parallel_size=dp, global_batch_size=gbs, seed=3), 2)
    first_global_batch = one_rank[:gbs]
    assert sorted(sum(rank0 + rank1, [])) == sorted(first_global_batch)
    assert rank0[0] == first_global_batch[0:2] and rank1[0] == first_global_batch[2:4]


@pytest.mark.parametrize("consumed", [0, 4, 12, 36, 40, 44, 100])
def test_resume_at_k_consumed_yields_exactly_the_rest(consumed: int):
    num, mbs, dp, gbs, seed = 42, 1, 2, 4, 7  # 42 rows: epochs of 40 (a ragged tail of 2)
    full = _global_stream(num, mbs, dp, gbs, seed, 0, 80)
    resumed = _global_stream(num, mbs, dp, gbs, seed, consumed, 80 - consumed // dp)
    assert resumed == full[consumed:]


def test_epochs_train_every_row_and_reshuffle():
    """42 rows in micro-batches of 4: 44 samples an epoch (the epoch's first 2 rows again fill
    its last micro-batch), 6 steps of 8, the last of 4 (one micro-batch)."""
    sampler = DataSampler(42, micro_batch_size=4, global_batch_size=8, seed=0)
    assert sampler.samples_per_epoch == 44 and sampler.steps_per_epoch == 6
    micro = _take(sampler, 11)
    assert [len(m) for m in micro] == [4] * 11  # every micro-batch full
    epoch0 = sum(micro, [])
    assert sorted(set(epoch0)) == list(range(42)) and epoch0[42:] == epoch0[:2]
    epoch1 = sum(_take(DataSampler(42, micro_batch_size=4, global_batch_size=8, seed=0,
                                   consumed_samples=44), 11), [])
    assert sorted(epoch1[:42]) == list(range(42)) and epoch0 != epoch1
    assert sampler.global_indices(44, 44).tolist() == epoch1


def test_eval_order_is_sequential_and_finite():
    sampler = DataSampler(10, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2,
                          shuffle=False, total_samples=8)
    assert list(sampler) == [[2, 3], [6, 7]]
    assert len(sampler) == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_samples=0, micro_batch_size=2, global_batch_size=4), "the data has no rows"),
    (dict(num_samples=10, micro_batch_size=2, global_batch_size=5), "not a multiple of"),
    (dict(num_samples=10, micro_batch_size=2, consumed_samples=3), "consumed_samples=3 is not at a micro-step"),
    (dict(num_samples=11, micro_batch_size=4, consumed_samples=14), "consumed_samples=14 is not at a micro-step"),
    (dict(num_samples=10, micro_batch_size=2, data_parallel_rank=2, data_parallel_size=2),
     "data_parallel_rank=2 is outside 0..1"),
])
def test_bad_arguments(kwargs: dict, message: str):
    with pytest.raises(DataError, match=message):
        DataSampler(**kwargs)
