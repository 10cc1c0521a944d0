"""Reading a run config: defaults, then a YAML file, then ``key=value`` overrides
(:func:`load_config`), and the same followed by the cross-field rules with every problem in one
message (:func:`load_resolved`). The dataclasses are :mod:`.sections`' (which re-exports these
functions); the key aliases and type coercion are :mod:`.input`'s.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

from hpc_mca.data.templates import TEMPLATE_NAMES

from .choices import OPTIMIZERS, REPORT_TO
from .input import (
    ConfigError,
    choice_message,
    coerce,
    optimizer_fields,
    parse_value,
    read_yaml,
    unknown_key_message,
)
from .key_answers import refusal, refused_name
from .lf_keys import lf_assignments, lf_name
from .sections import (
    INPUT_PATHS,
    SECTION_TYPES,
    TrainConfig,
    field_section,
    flat_fields,
)

__all__ = ["config_items", "load_config", "load_items", "load_resolved", "set_value"]


def load_config(path: str | os.PathLike[str] | None = None,
                overrides: typing.Iterable[str] = ()) -> TrainConfig:
    """Defaults, then the YAML file at ``path``, then ``key=value`` overrides, in that order.

    Every unknown key, every value of the wrong type or out of its choices and every refused
    LLaMA-Factory key is reported at once, one line each, in the order written (a key set
    again later, e.g. by an override, counts by its last value)."""
    config, problems = _load(path, overrides)
    if problems:
        raise ConfigError("\n".join(problems))
    return config


def load_resolved(path: str | os.PathLike[str] | None, overrides: typing.Iterable[str],
                  world_size: int) -> TrainConfig:
    """:func:`load_config`, then :meth:`TrainConfig.resolve` for ``world_size`` ranks, with
    the problems of both in one message: the rules also run on a config whose keys had
    problems (those keys keep their defaults), and a rule's line about a field that already
    has a line is left out."""
    config, problems = _load(path, overrides)
    try:
        resolved = config.resolve(world_size)
    except ConfigError as err:
        named = {line.split("=")[0].split(" ")[0] for line in problems}
        problems += [line for line in str(err).splitlines()
                     if line.split("=")[0].split(" ")[0] not in named]
    if problems:
        raise ConfigError("\n".join(problems))
    return resolved


def _load(path: str | os.PathLike[str] | None,
          overrides: typing.Iterable[str]) -> tuple[TrainConfig, list[str]]:
    """The config and its load problems, one line each, in the order their keys come."""
    return load_items(config_items(path, overrides))


def load_items(items: list[tuple[str, Any, Path | None]],
               config: TrainConfig | None = None) -> tuple[TrainConfig, list[str]]:
    """A config from ``(key, value, base directory of relative paths or None)`` items, in
    order, read over ``config`` (default: the defaults; it is changed in place), and its load
    problems, one line each (a script's arguments come this way,
    :mod:`hpc_mca.training_args`, so they get the YAML's key aliases, types and messages)."""
    config = TrainConfig() if config is None else config
    problems: dict[str, tuple[int, str]] = {}  # by the field a key names (flat and dotted are one)
    written: dict[str, int] = {}  # field -> the position of the item that set it last
    lf_items: dict[str, tuple[int, Any]] = {}  # a LLaMA-Factory key -> its last position, value
    for at, (key, value, base) in enumerate(items):
        name = lf_name(key, tuple(SECTION_TYPES))
        if name is not None:
            lf_items.pop(name, None)  # re-inserted: they are applied in the order written
            lf_items[name] = (at, value)
            continue
        refused = refused_name(key, tuple(SECTION_TYPES))
        if refused is not None:  # another tool's key: its default sets nothing, else one line
            line = refusal(refused, value)
            problems.pop(refused, None)
            if line is not None:
                problems[refused] = (at, line)
            continue
        try:
            written.update(dict.fromkeys(set_value(config, key, value, base_dir=base), at))
            problems.pop(_field_of(key), None)
        except ConfigError as err:
            problems[_field_of(key)] = (at, str(err))
    for name, (at, value) in lf_items.items():
        try:
            for dotted, field_value in lf_assignments(name, value, config, at, written).items():
                set_value(config, dotted, field_value)
                written[dotted] = at
        except ConfigError as err:
            problems[name] = (at, str(err))
    return config, [line for _, line in sorted(problems.values())]


def config_items(path: str | os.PathLike[str] | None,
                 overrides: typing.Iterable[str]) -> list[tuple[str, Any, Path | None]]:
    """(key, value, the YAML file's directory or None) for every key, in order."""
    items: list[tuple[str, Any, Path | None]] = []
    if path is not None:
        base = Path(path).resolve().parent
        items += [(key, value, base) for key, value in _flatten(read_yaml(Path(path)))]
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value")
        items.append((key.strip(), parse_value(key, text), None))
    return items


def _field_of(key: str) -> str:
    try:
        dotted, subkey = _lookup(key)
    except ConfigError:
        return key
    return dotted if subkey is None else f"{dotted}.{subkey}"


def _flatten(data: dict[str, Any]) -> list[tuple[str, Any]]:
    """Section mappings (``training: {...}``) become dotted keys; other keys pass through."""
    items: list[tuple[str, Any]] = []
    for key, value in data.items():
        if key in SECTION_TYPES and isinstance(value, dict):
            items += [(f"{key}.{sub}", v) for sub, v in value.items()]
        else:
            items.append((str(key), value))
    return items


_LOAD_CHOICES: dict[str, tuple[str, ...]] = {"data.template": TEMPLATE_NAMES,
                                              "training.report_to": REPORT_TO}
"""Fields whose values are checked against their choices as they are read (so that a typo
is in the load message, with a close spelling); the rules check the others."""


def set_value(config: TrainConfig, key: str, value: object,
              base_dir: Path | None = None) -> list[str]:
    """Set one flat or dotted key (``lr_scheduler_kwargs.min_lr`` sets a kwarg), type-checked;
    returns the dotted fields it set (transformers' ``optim: adamw_torch_fused`` sets two)."""
    dotted, subkey = _lookup(key)
    section, name = dotted.split(".")
    if subkey is not None:
        getattr(getattr(config, section), name)[subkey] = value
        return [dotted]
    if dotted == "training.optim":
        fields = optimizer_fields(value, OPTIMIZERS)
        for target, target_value in fields.items():
            setattr(config.training, target.split(".")[1], target_value)
        return list(fields)
    hint = typing.get_type_hints(SECTION_TYPES[section])[name]
    value = coerce(dotted, value, hint)
    for item in (value if isinstance(value, list) else [value]):
        problem = choice_message(dotted, item, _LOAD_CHOICES[dotted]) if dotted in _LOAD_CHOICES else None
        if problem:
            raise ConfigError(problem)
    if base_dir is not None and dotted in INPUT_PATHS and value is not None:
        value = _relative_to(base_dir, value)
    setattr(getattr(config, section), name, value)
    return [dotted]


def _lookup(key: str) -> tuple[str, str | None]:
    """``(dotted field, dict subkey or None)`` for a flat or dotted key."""
    parts = key.split(".")
    if parts[0] in SECTION_TYPES and len(parts) >= 2 and field_section(parts[1]) == ".".join(
            parts[:2]):
        dotted, rest = ".".join(parts[:2]), parts[2:]
    elif field_section(parts[0]) is not None:
        dotted, rest = str(field_section(parts[0])), parts[1:]
    else:
        raise ConfigError(_unknown_key_message(key))
    if not rest:
        return dotted, None
    if dotted != "training.lr_scheduler_kwargs" or len(rest) != 1:
        raise ConfigError(_unknown_key_message(key))
    return dotted, rest[0]


def _unknown_key_message(key: str) -> str:
    return unknown_key_message(key, flat_fields())


def _relative_to(base: Path, value: object) -> Any:
    if isinstance(value, list):
        return [_relative_to(base, v) for v in value]
    if not isinstance(value, str) or not value or os.path.isabs(value):
        return value
    candidate = base / value
    exists = candidate.exists() or Path(f"{candidate}.idx").exists()
    return str(candidate) if exists else value
