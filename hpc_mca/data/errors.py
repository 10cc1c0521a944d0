"""The one exception type of the data pipeline."""

from __future__ import annotations


class DataError(ValueError):
    """Bad dataset input, reported before training starts.

    The message is one line: ``path:line: reason`` for a bad record, otherwise the dotted config
    field, its value and the valid choices.
    """
