"""The one exception type of the operator commands."""

from __future__ import annotations


class OpsError(ValueError):
    """Bad input or a failed Slurm interaction; ``str(err)`` is ready to print (one line per
    problem, each naming the value and what would be valid)."""
