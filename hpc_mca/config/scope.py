"""Settings that mean something only in a context, refused outside it.

``pref_beta`` on an sft run, ``lora_rank`` on a full fine-tune, ``eval_steps`` without eval
data: each would be accepted, change nothing, and leave the user believing it did. A setting of
a :data:`SCOPES` entry that differs from its default while the entry's context does not hold is
refused, all such settings of a config in one message, one line each.

Compared with the default rather than with "was it written": a resolved config
(``resolved_config.yaml``, which ``hpc-mca resume`` reads back) writes every field, and its
out-of-context fields hold their defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc_mca.stages import (
    CONVERSATION_DATA_KEYS,
    LOSS_SETTINGS,
    STAGE_NAMES,
    TEXT,
    TEXT_DATA_KEYS,
    Stage,
    get_stage,
    stage_context,
    stages_where,
    stages_with,
)

from .input import ConfigError

if TYPE_CHECKING:  # the sections import the rules: a runtime import here would be a circle
    from _typeshed import DataclassInstance

    from .sections import TrainConfig

__all__ = ["SCOPES", "Scope", "check_scopes", "has_eval_data"]


@dataclass(frozen=True)
class Scope:
    """Fields that only act when ``holds(config)``."""

    fields: tuple[str, ...]
    """Dotted field names."""
    holds: Callable[[TrainConfig], bool]
    """Whether the context is there."""
    context: str | Callable[[], str]
    """The context, as the message names it; a function for a context of stages, read from
    the registry when the message is made (a stage registered after this import counts)."""

    def describe(self) -> str:
        return self.context if isinstance(self.context, str) else self.context()


def has_eval_data(config: TrainConfig) -> bool:
    """Eval data: an eval dataset, a held-out share of the train set, or (with Megatron's
    blend) a validation share in ``data.split``."""
    data = config.data
    if data.eval_dataset or data.val_size > 0 or config.datasets_in_code:
        return True  # (in code: McaTrainer checks the eval settings against its eval_dataset)
    if data.data_path is None or data.split is None:
        return False
    from hpc_mca.data.blended import parse_split
    from hpc_mca.data.errors import DataError

    try:
        return parse_split(data.split)[1] > 0
    except DataError:
        return False  # the blend rule reports the split itself


def _scheduler_has_warmup(config: TrainConfig) -> bool:
    from .schedule import ALIASES

    name = config.training.lr_scheduler_type
    return ALIASES.get(name, name) != "constant"


def _stage_holds(test: Callable[[Stage], bool]) -> Callable[[TrainConfig], bool]:
    """A context of the run's stage (its registry traits). An unknown stage holds every
    context: its own rule reports it, and nothing else is known to be out of place."""
    def holds(config: TrainConfig) -> bool:
        name = config.finetuning.stage
        return name not in STAGE_NAMES or test(get_stage(name))
    return holds


def _data_keys_scope(keys: tuple[str, ...], why: Callable[[], str] = lambda: "") -> Scope:
    """The ``data.*`` keys that act only for the stages whose rows read them."""
    return Scope(tuple(f"data.{key}" for key in keys),
                 _stage_holds(lambda stage: stage.data_keys == keys),
                 lambda: stage_context(stages_where("data_keys", keys)) + why())


def _loss_scope(name: str) -> Scope:
    """``finetuning.<name>``, which acts only for the stages whose loss reads it (their rows'
    ``loss_settings``: dpo's ``pref_*``, kto's weights, both's β)."""
    def reads(stage: Stage) -> bool:
        return name in stage.loss_settings

    return Scope((f"finetuning.{name}",), _stage_holds(reads), lambda: stage_context(stages_with(reads)))


SCOPES: tuple[Scope, ...] = (
    *(_loss_scope(name) for name in LOSS_SETTINGS),
    Scope(("finetuning.lora_rank", "finetuning.lora_alpha", "finetuning.lora_dropout",
           "finetuning.lora_target"),
          lambda c: c.finetuning.finetuning_type == "lora", "finetuning.finetuning_type='lora'"),
    Scope(("finetuning.freeze_trainable_layers", "finetuning.freeze_trainable_modules",
           "finetuning.freeze_extra_modules"),
          lambda c: c.finetuning.finetuning_type == "freeze", "finetuning.finetuning_type='freeze'"),
    Scope(("finetuning.create_new_adapter",), lambda c: bool(c.model.adapter_name_or_path),
          "model.adapter_name_or_path (adapters to start from)"),
    Scope(("data.dataset_format",), lambda c: not c.data.dataset_dir,
          "direct dataset paths (with data.dataset_dir, each dataset_info.json entry's "
          "'formatting' decides)"),
    Scope(("training.eval_steps", "training.per_device_eval_batch_size"), has_eval_data,
          "eval data (data.eval_dataset, data.val_size, or data.split's validation share)"),
    Scope(("model.mtp_loss_scaling_factor",), lambda c: c.model.mtp_num_layers > 0,
          "model.mtp_num_layers > 0"),
    _data_keys_scope(TEXT_DATA_KEYS),
    _data_keys_scope(CONVERSATION_DATA_KEYS,
                     lambda: f" ({' and '.join(stages_where('reads', TEXT))} trains on plain text)"),
    Scope(("data.pack_alignment",), lambda c: c.data.sequence_packing,
          "data.sequence_packing=true"),
    Scope(("parallel.recompute_num_layers",),
          lambda c: c.parallel.recompute_granularity is not None,
          "parallel.recompute_granularity full (or selective, which Megatron-Core refuses it "
          "with)"),
    Scope(("parallel.recompute_modules",),
          lambda c: c.parallel.recompute_granularity == "selective",
          "parallel.recompute_granularity='selective'"),
    Scope(("parallel.cp_comm_type",), lambda c: c.parallel.context_parallel_size > 1,
          "parallel.context_parallel_size > 1"),
    Scope(("training.adam_beta1", "training.adam_beta2", "training.adam_epsilon"),
          lambda c: c.training.optim == "adam", "training.optim='adam'"),
    Scope(("training.warmup_steps", "training.warmup_ratio"), _scheduler_has_warmup,
          "a training.lr_scheduler_type with a warmup (constant has none; "
          "constant_with_warmup does)"),
)
"""Every context-bound setting; tests/test_config_scope.py checks each one's refusal."""


def _default(section: DataclassInstance, name: str) -> object:
    spec = {f.name: f for f in dataclasses.fields(section)}[name]
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def check_scopes(config: TrainConfig, world_size: int) -> None:
    """ConfigError naming every setting that differs from its default outside its context."""
    lines = []
    for scope in SCOPES:
        if scope.holds(config):
            continue
        for dotted in scope.fields:
            section_name, name = dotted.split(".")
            section = getattr(config, section_name)
            value = getattr(section, name)
            if value != _default(section, name):
                lines.append(f"{dotted}={value!r} acts only with {scope.describe()}, which this "
                             "run does not have; valid: remove it, or set that context")
    if lines:
        raise ConfigError("\n".join(lines))
