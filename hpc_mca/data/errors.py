"""The one exception type of the data pipeline."""

from __future__ import annotations

from hpc_mca.errors import UserError


class DataError(UserError):
    """Bad dataset input, reported before training starts.

    The message is one line: ``path:line: reason`` for a bad record, otherwise the dotted config
    field, its value and the valid choices.
    """
