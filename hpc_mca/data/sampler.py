"""Deterministic, data-parallel, resumable order of training rows (Megatron-style sampler).

The global order is a function of the seed only: epoch ``e`` visits the rows in the
permutation drawn from ``numpy.random.default_rng([seed, e])``, keeping the first
``samples_per_epoch`` of them (whole global batches; the ragged tail of an epoch is left out,
like a drop-last loader). Global sample ``k`` of the run is therefore known without iterating,
and a run resumed after ``consumed_samples`` continues with exactly the rows an uninterrupted
run would have seen next.

Each micro-step takes the next ``micro_batch_size × data_parallel_size`` global samples;
data-parallel rank ``r`` gets the ``r``-th slice of ``micro_batch_size`` of them (the layout of
Megatron's MegatronPretrainingSampler). A global batch is ``global_batch_size`` consecutive
global samples, whatever the split into ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .errors import DataError


class DataSampler:
    """Yields this rank's micro-batches (lists of row indices), starting at ``consumed_samples``.

    ``shuffle=False`` keeps file order (evaluation). ``total_samples`` stops the iteration after
    that many global samples (None = endless, epoch after epoch).
    """

    def __init__(self, num_samples: int, *, micro_batch_size: int, data_parallel_rank: int = 0,
                 data_parallel_size: int = 1, global_batch_size: int | None = None,
                 seed: int = 0, shuffle: bool = True, consumed_samples: int = 0,
                 total_samples: int | None = None) -> None:
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.micro_batch_size, self.rank = micro_batch_size, data_parallel_rank
        self.step_size = micro_batch_size * data_parallel_size
        self.global_batch_size = global_batch_size or self.step_size
        self.consumed_samples, self.total_samples = consumed_samples, total_samples
        self._check(data_parallel_size)
        self.samples_per_epoch = num_samples // self.global_batch_size * self.global_batch_size
        self._epoch_order: tuple[int, np.ndarray] | None = None

    def _check(self, dp_size: int) -> None:
        if not 0 <= self.rank < dp_size:
            raise DataError(f"data_parallel_rank={self.rank} is outside 0..{dp_size - 1}")
        if self.global_batch_size % self.step_size:
            raise DataError(f"training.global_batch_size={self.global_batch_size} is not a "
                            f"multiple of micro-batch × data-parallel size={self.step_size}")
        if self.num_samples < self.global_batch_size:
            raise DataError(f"the data has {self.num_samples} rows, fewer than one global batch "
                            f"of {self.global_batch_size}; valid: global_batch_size <= "
                            f"{self.num_samples}")
        if self.consumed_samples < 0 or self.consumed_samples % self.step_size:
            raise DataError(f"consumed_samples={self.consumed_samples} must be a multiple of "
                            f"micro-batch × data-parallel size={self.step_size}")

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps (global batches) in one epoch."""
        return self.samples_per_epoch // self.global_batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row indices visited in ``epoch``, in order."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            self._epoch_order = (epoch, order[:self.samples_per_epoch])
        return self._epoch_order[1]

    def global_indices(self, start: int, count: int) -> np.ndarray:
        """Row indices of global samples ``start .. start + count - 1``."""
        out = []
        for k in range(start, start + count):
            epoch, position = divmod(k, self.samples_per_epoch)
            out.append(int(self.epoch_order(epoch)[position]))
        return np.asarray(out, dtype=np.int64)

    def __iter__(self) -> Iterator[list[int]]:
        consumed = self.consumed_samples
        while self.total_samples is None or consumed + self.step_size <= self.total_samples:
            epoch, position = divmod(consumed, self.samples_per_epoch)
            step = self.epoch_order(epoch)[position:position + self.step_size]
            mine = step[self.rank * self.micro_batch_size:(self.rank + 1) * self.micro_batch_size]
            consumed += self.step_size
            yield [int(i) for i in mine]

    def __len__(self) -> int:
        """Micro-batches left for this rank (only when ``total_samples`` is set)."""
        if self.total_samples is None:
            raise TypeError("an endless DataSampler has no length; set total_samples")
        return max(0, (self.total_samples - self.consumed_samples) // self.step_size)
