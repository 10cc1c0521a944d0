"""``TrainingArguments``: the run config as one flat dataclass, for scripts.

Every field of the five config sections (:mod:`hpc_mca.config.sections`: model, data,
finetuning, training, parallel) is a field here under its flat name, the name a YAML config
writes (``learning_rate``, ``tensor_model_parallel_size``, ``dataset``), with the same default;
each field's documentation is in its section's dataclass. Keyword arguments go through the
same loader as a YAML file's keys, so they take the same aliases (LLaMA-Factory's
``packing``, transformers' ``optim``), types and one-line errors, all problems in one
:class:`~hpc_mca.config.input.ConfigError`:

    args = TrainingArguments(output_dir="runs/x", tensor_model_parallel_size=2, bf16=True)
    args = TrainingArguments.from_yaml("sft.yaml", ["max_steps=100"])
    args = TrainingArguments.parse_args(sys.argv[1:])   # [CONFIG.yaml] [key=value | --key value ...]

:meth:`TrainingArguments.resolve` checks the cross-field rules for a world size, as
``hpc-mca train`` does, and gives the :class:`~hpc_mca.config.sections.TrainConfig` the
trainer runs. Two environment variables of the batch script reach a script here (see
``sbatch/train.sbatch``): ``HPC_MCA_RUN_DIR``, the job's run directory, becomes ``output_dir``
when the script leaves it unset; ``HPC_MCA_PLAN_OVERRIDES``, the planned layout
(``key=value`` pairs), sets the fields the script left at their defaults.

Pure Python (no torch): a login-node script may build its arguments to plan with them.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hpc_mca.config.input import ConfigError, parse_value
from hpc_mca.config.loading import config_items, load_items, set_value
from hpc_mca.config.sections import _FLAT, _SECTION_TYPES, TrainConfig
from hpc_mca.rundir import PLAN_OVERRIDES_ENV, RUN_DIR_ENV

__all__ = ["PLAN_ENV", "RUN_DIR_ENV", "Seq2SeqTrainingArguments", "TrainingArguments"]

PLAN_ENV = PLAN_OVERRIDES_ENV
"""The planned layout as ``key=value`` pairs (space-separated): applied to the fields a
script left at their defaults. (``RUN_DIR_ENV``: the batch script's run directory, the
``output_dir`` of a script that leaves it unset.)"""


def _section_fields() -> list[tuple[str, Any, dataclasses.Field[Any]]]:
    """(flat name, annotation, a field with the same default) of every section field."""
    out = []
    for cls in _SECTION_TYPES.values():
        for f in dataclasses.fields(cls):
            default: dataclasses.Field[Any] = (
                dataclasses.field(default_factory=f.default_factory)
                if f.default_factory is not dataclasses.MISSING else dataclasses.field(default=f.default))
            out.append((f.name, f.type, default))
    return out


class _Arguments:
    """Methods of :class:`TrainingArguments` (the fields are generated from the sections)."""

    def __init__(self, **kwargs: Any) -> None:
        config, problems = load_items([(key, value, None) for key, value in kwargs.items()])
        if problems:
            raise ConfigError("\n".join(problems))
        self._take(config)

    def _take(self, config: TrainConfig) -> None:
        for section in _SECTION_TYPES:
            for name, value in dataclasses.asdict(getattr(config, section)).items():
                object.__setattr__(self, name, value)

    @classmethod
    def from_config(cls, config: TrainConfig) -> TrainingArguments:
        """The flat arguments of a section config (``hpc-mca train`` builds them this way)."""
        args = cls.__new__(cls)
        args._take(config)
        return args

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str] | None, overrides: Iterable[str] = (),
                  **kwargs: Any) -> TrainingArguments:
        """A YAML run config (relative input paths read next to it), then ``key=value``
        overrides, then keyword arguments, as ``hpc-mca train CONFIG key=value`` reads them."""
        items = config_items(path, overrides) + [(key, value, None) for key, value in kwargs.items()]
        config, problems = load_items(items)
        if problems:
            raise ConfigError("\n".join(problems))
        return cls.from_config(config)

    @classmethod
    def parse_args(cls, argv: Sequence[str]) -> TrainingArguments:
        """A script's command line: an optional YAML config first, then ``key=value``,
        ``--key=value`` or ``--key value`` items (``--flag`` alone sets a boolean)."""
        argv = list(argv)
        path = argv.pop(0) if argv and argv[0].endswith((".yaml", ".yml")) else None
        overrides: list[str] = []
        while argv:
            item = argv.pop(0)
            if item.startswith("--"):
                key, sep, value = item[2:].partition("=")
                if not sep:
                    value = argv.pop(0) if argv and not argv[0].startswith("--") else "true"
                item = f"{key}={value}"
            overrides.append(item)
        return cls.from_yaml(path, overrides)

    def to_config(self) -> TrainConfig:
        """The section config of these arguments, each value type-checked again (a field set
        after construction too); with the batch script's run dir and planned layout applied
        (see the module docstring). Raises ConfigError with every problem."""
        config, problems = TrainConfig(), []
        defaults = TrainConfig()
        for section in _SECTION_TYPES:
            for name, value in dataclasses.asdict(self._sections_of(section)).items():
                default = getattr(getattr(defaults, section), name)
                if value == default or (value is None and isinstance(default, list)):
                    continue  # (None for a list: the empty list, e.g. no dataset files)
                try:
                    set_value(config, name, value)
                except ConfigError as err:
                    problems.append(str(err))
        problems += _apply_environment(config)
        if problems:
            raise ConfigError("\n".join(problems))
        config.datasets_in_code = True
        return config

    def _sections_of(self, section: str) -> Any:
        cls = _SECTION_TYPES[section]
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    def resolve(self, world_size: int) -> TrainConfig:
        """:meth:`to_config` with the cross-field rules checked for ``world_size`` ranks and
        the derived fields (data-parallel size, accumulation, global batch) filled in."""
        return self.to_config().resolve(world_size)


def _apply_environment(config: TrainConfig) -> list[str]:
    """The batch script's run directory and planned layout (module docstring); problems."""
    problems: list[str] = []
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        given = config.training.output_dir
        if not given:
            config.training.output_dir = run_dir
        elif Path(given).resolve() != Path(run_dir).resolve():
            problems.append(f"training.output_dir={given!r} but this job's run directory is "
                            f"{RUN_DIR_ENV}={run_dir!r}; valid: leave output_dir unset or set it "
                            f"to {run_dir!r}")
    defaults = TrainConfig()
    for item in shlex.split(os.environ.get(PLAN_ENV, "")):
        key, _, text = item.partition("=")
        section, name = _dotted(key)
        if getattr(getattr(config, section), name) != getattr(getattr(defaults, section), name):
            continue  # the script chose this one itself
        try:
            set_value(config, key, parse_value(key, text))
        except ConfigError as err:
            problems.append(f"{PLAN_ENV}: {err}")
    return problems


def _dotted(key: str) -> tuple[str, str]:
    name = key.split(".")[-1]
    if name not in _FLAT:
        raise ConfigError(f"{PLAN_ENV}: unknown key {key!r}; valid: layout fields such as "
                          "tensor_model_parallel_size")
    section, field_name = _FLAT[name].split(".")
    return section, field_name


TrainingArguments = dataclasses.make_dataclass(
    "TrainingArguments", _section_fields(), bases=(_Arguments,), init=False)
TrainingArguments.__module__ = __name__
TrainingArguments.__doc__ = (
    "Every run-config field under its flat YAML name (see the module docstring); built from "
    "keyword arguments, :meth:`from_yaml` or :meth:`parse_args`.")
Seq2SeqTrainingArguments = TrainingArguments
"""The same class under the name ROLL's and transformers' seq2seq scripts import."""
