"""The one base class of every "your input cannot work" error.

Each package raises its own subclass (``ConfigError``, ``DataError``, ``ModelLoadError``,
``LayoutError``, ``SchedulerError``, ``CheckpointSpaceError``) with a one-line message that
names the value and what would be valid. On the rank side, ``hpc-mca train`` turns any
:class:`UserError` into that line, a bad-input record in the run directory and exit status 2
(:data:`hpc_mca.rundir.EXIT_BAD_INPUT`), so the batch script never requeues a job that cannot
succeed; anything else is a crash (exit 1), which may be retried.

Pure Python, no imports: every package may import it.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input (config, data, model files, layout, the machine's installed kernels, disk
    room): retrying cannot help. ``str(err)`` is ready to print."""
