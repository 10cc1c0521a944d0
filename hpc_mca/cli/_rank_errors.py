"""What a rank command (``train``, ``run``) does with a bad input that reaches it: one line,
recorded for the batch script, exit 2, so the job is never requeued for it."""

from __future__ import annotations

import sys
from typing import NoReturn

import click


def exit_bad_input(command: str, err: Exception) -> NoReturn:
    """Report ``err`` (a :class:`hpc_mca.errors.UserError`) as ``hpc-mca COMMAND: error: ...``
    on one line and exit 2. An error every rank finds alike (``on_every_rank``) is reported by
    rank 0 only; any other by the rank that found it, since the others may not know it."""
    from hpc_mca.rundir import EXIT_BAD_INPUT, record_bad_input

    if not (getattr(err, "on_every_rank", False) and global_rank() != 0):
        message = "; ".join(str(err).splitlines() or [type(err).__name__])
        # For the batch script: this job cannot succeed, whatever srun makes of the exit codes.
        record_bad_input(message)
        click.echo(f"hpc-mca {command}: error: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def global_rank() -> int:
    """This process's global rank from the launcher's environment (0 when unreadable)."""
    from hpc_mca.runtime.env import from_environ

    try:
        return from_environ().rank
    except Exception:  # noqa: BLE001 - an environment it cannot read: report on every rank, to be safe
        return 0
