"""Dataclasses that are frozen once resolved.

The run config's sections are filled in field by field while a config is read (YAML, CLI
overrides, a script's arguments) and while the rules derive their values, so they cannot be
``frozen=True`` dataclasses; :meth:`TrainConfig.resolve` freezes its result instead. Setting a
field of a frozen instance raises :class:`dataclasses.FrozenInstanceError` (a program error,
not bad input): a later change goes through :func:`dataclasses.replace`, which builds a new,
unfrozen value.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TypeVar

__all__ = ["Freezable", "thawed_copy"]

_FLAG = "_frozen_"
"""The instance attribute that marks a frozen value (in ``__dict__``, so copies and pickles
keep it)."""

T = TypeVar("T")


class Freezable:
    """A dataclass mix-in: :meth:`freeze` makes the instance read-only."""

    def __setattr__(self, name: str, value: object) -> None:
        if self.__dict__.get(_FLAG):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {type(self).__name__}.{name}: a resolved config does not change; "
                f"build a new one (dataclasses.replace) and resolve it")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get(_FLAG):
            raise dataclasses.FrozenInstanceError(f"cannot delete {type(self).__name__}.{name}")
        object.__delattr__(self, name)

    def freeze(self) -> None:
        """Make this instance and the Freezable values of its fields read-only."""
        for value in vars(self).values():
            if isinstance(value, Freezable):
                value.freeze()
        object.__setattr__(self, _FLAG, True)

    @property
    def frozen(self) -> bool:
        """Whether :meth:`freeze` was called on this instance."""
        return bool(self.__dict__.get(_FLAG))


def thawed_copy(value: T) -> T:
    """A deep copy of ``value`` with every Freezable in it writable again (a copy of a frozen
    value is frozen: :func:`copy.deepcopy` restores the instance's ``__dict__`` as it was)."""
    duplicate = copy.deepcopy(value)
    pending: list[object] = [duplicate]
    while pending:
        item = pending.pop()
        if isinstance(item, Freezable):
            item.__dict__.pop(_FLAG, None)
            pending.extend(vars(item).values())
    return duplicate
