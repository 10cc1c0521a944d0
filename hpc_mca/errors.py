"""The one base class of every "your input cannot work" error.

Each package raises its own subclass (``ConfigError``, ``DataError``, ``ModelLoadError``,
``LayoutError``, ``SchedulerError``, ``CheckpointSpaceError``) with a one-line message that
names the value and what would be valid. On the rank side, ``hpc-mca train`` turns any
:class:`UserError` into that line, a bad-input record in the run directory and exit status 2
(:data:`hpc_mca.rundir.EXIT_BAD_INPUT`), so the batch script never requeues a job that cannot
succeed; anything else is a crash (exit 1), which may be retried.

Every rank of a job stops on bad input, never only the one that found it (the others would
wait in a collective for a rank that is gone, then crash): inputs every rank reads are checked
by every rank before the process group exists, and what only global rank 0 reads (the data it
tokenizes for all) is shared with the others (:func:`hpc_mca.runtime.distributed.rank_zero_first`).
Such an error is marked :attr:`UserError.on_every_rank`, and only rank 0 prints it.

Pure Python, no imports: every package may import it.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input (config, data, model files, layout, the machine's installed kernels, disk
    room): retrying cannot help. ``str(err)`` is ready to print."""

    on_every_rank: bool = False
    """Every rank of the job stops with this same error: global rank 0 reports it, the
    others exit 2 quietly (one line in the job's log, not one per rank)."""


class BadInputOnRankZero(UserError):
    """Raised on the other ranks when global rank 0 found bad input in a step only it runs;
    the message is rank 0's."""

    on_every_rank = True
