"""The one exception type of the topology planner."""

from __future__ import annotations

from collections.abc import Iterable

from hpc_mca.errors import UserError


class LayoutError(UserError):
    """Bad planner input or a layout that breaks a rule.

    ``violations`` holds one human-readable line per problem, each naming the field, its value
    and the nearest valid choices; ``str(err)`` is those lines joined by newlines, so a CLI can
    print it as is.
    """

    def __init__(self, violations: str | Iterable[str]) -> None:
        lines = [violations] if isinstance(violations, str) else list(violations)
        if not lines:
            raise ValueError("LayoutError needs at least one violation line")
        self.violations: list[str] = lines
        super().__init__("\n".join(lines))


def raise_if(violations: list[str]) -> None:
    """Raise a LayoutError carrying ``violations`` unless the list is empty."""
    if violations:
        raise LayoutError(violations)
