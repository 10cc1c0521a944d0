"""The two primitive checks every rule module shares: a value among its choices, a number
not below its floor; each raises :class:`ConfigError` with one line naming the dotted field."""

from __future__ import annotations

import typing
from typing import Any

from .input import ConfigError, choice_message

__all__ = ["at_least", "choice"]


def choice(dotted: str, value: object, choices: typing.Iterable[Any]) -> None:
    problem = choice_message(dotted, value, tuple(choices))
    if problem:
        raise ConfigError(problem)


def at_least(dotted: str, value: int | float | None, low: int | float) -> None:
    if value is not None and value < low:
        raise ConfigError(f"{dotted}={value} must be >= {low}")
