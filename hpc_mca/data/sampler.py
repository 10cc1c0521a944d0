"""Deterministic, data-parallel, resumable order of training rows (Megatron-style sampler).

The global order is a function of the seed only: epoch ``e`` visits the rows in the
permutation drawn from ``numpy.random.default_rng([seed, e])``. Every epoch trains all its
rows, as transformers' Trainer does: the epoch's order is padded to whole micro-steps
(micro-batch × data-parallel size) by repeating rows from its own start (torch's
DistributedSampler pads to the data-parallel size that way, and transformers' last micro-batch
is then shorter; here every micro-batch is full, so pipeline stages always exchange one shape),
so ``samples_per_epoch = ceil(n / (mbs × dp)) × mbs × dp`` global samples, and its last
optimizer step is a partial global batch of fewer micro-batches (see :class:`EpochPlan`). The
step count is transformers': ``ceil(n / global_batch_size)`` per epoch. Steps never cross an epoch boundary.
Global sample ``k`` of the run is therefore known without iterating (epoch ``k //
samples_per_epoch``, offset ``k % samples_per_epoch``), and a run resumed after
``consumed_samples`` continues with exactly the rows an uninterrupted run would have seen next.

Each micro-step takes the next ``micro_batch_size × data_parallel_size`` global samples;
data-parallel rank ``r`` gets the ``r``-th slice of ``micro_batch_size`` of them (the layout of
Megatron's MegatronPretrainingSampler). A global batch is ``global_batch_size`` consecutive
global samples of one epoch (fewer, whole micro-steps, for the epoch's last), whatever the
split into ranks and micro-batches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np

from .errors import DataError


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """How an epoch of ``num_rows`` rows splits into optimizer steps and micro-steps. Both
    backends size each step from it (the samples it consumes, its micro-batches per rank)."""

    num_rows: int
    """Rows of the training data (packed rows when packing; pairs for the preference stages)."""
    micro_batch_size: int
    """Rows of a full micro-batch on one data-parallel rank."""
    data_parallel_size: int
    """Data-parallel ranks the rows are split over."""
    global_batch_size: int
    """Rows of a full optimizer step over all ranks (a multiple of micro-batch × DP)."""

    @property
    def samples_per_epoch(self) -> int:
        """Global samples of an epoch: the rows, padded to whole micro-steps."""
        return math.ceil(self.num_rows / self.micro_step_size) * self.micro_step_size

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of an epoch, the last one partial: ``ceil(n / global_batch_size)``,
        transformers' count (per-rank batches rounded up, then accumulation steps rounded up)."""
        return math.ceil(self.samples_per_epoch / self.global_batch_size)

    @property
    def micro_step_size(self) -> int:
        """Global samples of a full micro-step."""
        return self.micro_batch_size * self.data_parallel_size

    def step_samples(self, consumed: int) -> int:
        """Global samples of the step that starts after ``consumed`` samples."""
        return min(self.global_batch_size, self.samples_per_epoch - consumed % self.samples_per_epoch)

    def micro_steps_in_step(self, consumed: int) -> int:
        """Micro-batches per rank of the step that starts after ``consumed`` samples (every one
        full: an epoch is whole micro-steps)."""
        return self.step_samples(consumed) // self.micro_step_size


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
        self.data_parallel_size = data_parallel_size
        self.step_size = micro_batch_size * data_parallel_size
        self.global_batch_size = global_batch_size or self.step_size
        self.consumed_samples, self.total_samples = consumed_samples, total_samples
        self.plan = EpochPlan(num_samples, micro_batch_size, data_parallel_size, self.global_batch_size)
        self.samples_per_epoch = self.plan.samples_per_epoch
        self._check(data_parallel_size)
        self._epoch_order: tuple[int, np.ndarray] | None = None

    def _check(self, dp_size: int) -> None:
        if not 0 <= self.rank < dp_size:
            raise DataError(f"data_parallel_rank={self.rank} is outside 0..{dp_size - 1}")
        if self.global_batch_size % self.step_size:
            raise DataError(f"training.global_batch_size={self.global_batch_size} is not a "
                            f"multiple of micro-batch × data-parallel size={self.step_size}")
        if self.num_samples < 1:
            raise DataError("the data has no rows; valid: at least one row")
        offset = self.consumed_samples % self.samples_per_epoch
        if self.consumed_samples < 0 or offset % self.step_size:
            raise DataError(f"consumed_samples={self.consumed_samples} is not at a micro-step "
                            f"boundary (epochs of {self.samples_per_epoch} samples, micro-steps of "
                            f"micro-batch × data-parallel size={self.step_size})")

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch (the last a partial global batch)."""
        return self.plan.steps_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row indices visited in ``epoch``, in order (``samples_per_epoch`` of them)."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            # DistributedSampler's padding: the epoch's own order again from its start.
            padded = np.resize(order, self.samples_per_epoch)
            self._epoch_order = (epoch, padded)
        return self._epoch_order[1]

    def global_indices(self, start: int, count: int) -> np.ndarray:
        """Row indices of global samples ``start .. start + count - 1``."""
        out = []
        for k in range(start, start + count):
            epoch, position = divmod(k, self.samples_per_epoch)
            out.append(int(self.epoch_order(epoch)[position]))
        return np.asarray(out, dtype=np.int64)

    def micro_steps(self) -> Iterator[np.ndarray]:
        """The global samples (row indices) of each micro-step from ``consumed_samples`` on:
        ``micro_batch_size × data_parallel_size`` of them, ``micro_batch_size`` for each rank."""
        consumed, size = self.consumed_samples, self.step_size
        while self.total_samples is None or consumed + size <= self.total_samples:
            epoch, position = divmod(consumed, self.samples_per_epoch)
            consumed += size
            yield self.epoch_order(epoch)[position:position + size]

    def rank_slice(self, micro_step: np.ndarray) -> slice:
        """This rank's part of a micro-step's global samples."""
        return slice(self.rank * self.micro_batch_size, (self.rank + 1) * self.micro_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.micro_steps():
            yield [int(i) for i in step[self.rank_slice(step)]]

    def __len__(self) -> int:
        """Micro-batches left for this rank (only when ``total_samples`` is set)."""
        if self.total_samples is None:
            raise TypeError("an endless DataSampler has no length; set total_samples")
        return max(0, (self.total_samples - self.consumed_samples) // self.step_size)
