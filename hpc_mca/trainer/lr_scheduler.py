"""Learning-rate schedules under Hugging Face names, run by Megatron-Core's scheduler.

Users write ``lr_scheduler_type: cosine`` and ``lr_scheduler_kwargs: {min_lr_rate: 0.1}`` as in
transformers; the run uses ``megatron.core.optimizer_param_scheduler.OptimizerParamScheduler``,
which writes the rate into every ``optimizer.param_groups`` entry (so Megatron's per-group
``max_lr``/``min_lr`` overrides keep working) and checkpoints with the rest of Megatron.

Two layers:

* :func:`scheduler_spec` (pure Python) maps a name, its kwargs, the peak rate, the warmup and the
  number of optimizer steps onto Megatron's arguments and rejects bad input with one line naming
  the field, the value and the valid choices. The config calls it at resolve time, before
  anything is allocated.
* :class:`MegatronLRScheduler` (imports megatron on first use) is the scheduler itself plus
  ``get_last_lr()`` and a default ``step()`` increment of 1, the interface HF loops expect.

Step convention (same as HF): after construction the rate is the one of step 0; each
``step()`` follows one optimizer step. With ``w`` warmup steps the rate at step ``s <= w`` is
``lr * s / w``; ``T`` is the number of training steps, and decay ends at ``T``.

| name                 | rate after warmup (s > w)                                     |
|----------------------|----------------------------------------------------------------|
| constant             | lr (warmup ignored, as in HF)                                  |
| constant_with_warmup | lr                                                             |
| linear               | min + (lr - min) * (T - s) / (T - w)                           |
| cosine               | min + (lr - min) * (1 + cos(pi * (s - w) / (T - w))) / 2       |
| cosine_with_min_lr   | cosine with min from ``min_lr`` or ``min_lr_rate`` (required)  |
| inverse_sqrt         | max(min, lr * sqrt(max(w, 1) / s))                             |
| wsd                  | lr until T - D, then min + (lr - min) * f((s - T + D) / D)     |

``min`` is 0 unless ``min_lr`` (absolute) or ``min_lr_rate`` (fraction of lr) is given. For
``wsd``, ``D`` comes from ``num_decay_steps`` or ``decay_ratio`` (fraction of T, default 0.1)
and ``f`` from ``wsd_decay_style`` (alias ``decay_type``): linear ``1 - x``, cosine
``(1 + cos(pi x)) / 2``, exponential ``2 * 0.5**x - 1``, minus_sqrt (alias ``1-sqrt``)
``1 - sqrt(x)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from hpc_mca.errors import UserError

__all__ = [
    "MegatronLRScheduler", "SCHEDULER_NAMES", "SchedulerError", "SchedulerSpec",
    "build_lr_scheduler", "get_megatron_lr_scheduler", "resolve_warmup_steps", "scheduler_spec",
]

SCHEDULER_NAMES = (
    "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr",
    "inverse_sqrt", "wsd",
)
"""Accepted ``lr_scheduler_type`` values (transformers' names)."""

# Megatron's lr_decay_style for each HF name.
_MEGATRON_STYLE = {
    "constant": "constant", "constant_with_warmup": "constant", "linear": "linear",
    "cosine": "cosine", "cosine_with_min_lr": "cosine", "inverse_sqrt": "inverse-square-root",
    "wsd": "WSD",
}
_MIN_KWARGS = ("min_lr", "min_lr_rate")
_KWARGS: dict[str, tuple[str, ...]] = {
    "constant": (), "constant_with_warmup": (), "linear": _MIN_KWARGS, "cosine": _MIN_KWARGS,
    "cosine_with_min_lr": _MIN_KWARGS, "inverse_sqrt": _MIN_KWARGS,
    "wsd": _MIN_KWARGS + ("num_decay_steps", "decay_ratio", "wsd_decay_style", "decay_type"),
}
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
_WSD_ALIASES = {"1-sqrt": "minus_sqrt"}
_DEFAULT_WSD_DECAY_RATIO = 0.1

_TYPE = "training.lr_scheduler_type"
_KW = "training.lr_scheduler_kwargs"


class SchedulerError(UserError):
    """A bad scheduler name, kwarg or step count; the message is one line."""


@dataclass(frozen=True)
class SchedulerSpec:
    """Everything OptimizerParamScheduler needs, derived from HF-style arguments."""

    name: str
    """The HF name the user gave."""
    max_lr: float
    """Peak rate (``learning_rate``)."""
    min_lr: float
    """Floor the decay ends at."""
    warmup_steps: int
    """Linear warmup from 0 over this many steps."""
    total_steps: int
    """Optimizer steps of the run (T)."""
    megatron_style: str
    """Megatron's ``lr_decay_style``."""
    decay_steps: int
    """Megatron's ``lr_decay_steps`` (T, or just past the warmup for constant schedules)."""
    wsd_decay_steps: int | None = None
    """WSD only: length D of the final decay."""
    wsd_decay_style: str | None = None
    """WSD only: shape of the final decay."""


def resolve_warmup_steps(warmup_steps: int, warmup_ratio: float, total_steps: int) -> int:
    """HF rule: ``warmup_steps`` when positive, else ``ceil(warmup_ratio * total_steps)``."""
    return warmup_steps if warmup_steps > 0 else math.ceil(warmup_ratio * total_steps)


def scheduler_spec(
    name: str,
    kwargs: Mapping[str, Any] | None,
    learning_rate: float,
    warmup_steps: int,
    total_steps: int,
) -> SchedulerSpec:
    """Validate HF-style scheduler arguments and translate them for Megatron."""
    if name not in _MEGATRON_STYLE:
        raise SchedulerError(f"{_TYPE}={name!r} is not a known scheduler; valid: "
                             + ", ".join(SCHEDULER_NAMES))
    kwargs = dict(kwargs or {})
    _check_kwarg_names(name, kwargs)
    if name == "constant":
        warmup_steps = 0
    _check_steps(name, warmup_steps, total_steps)
    min_lr = _min_lr(name, kwargs, learning_rate)
    constant = _MEGATRON_STYLE[name] == "constant"
    spec = SchedulerSpec(
        name=name, max_lr=float(learning_rate), min_lr=min_lr, warmup_steps=warmup_steps,
        total_steps=total_steps, megatron_style=_MEGATRON_STYLE[name],
        decay_steps=max(total_steps, warmup_steps + 1) if constant else total_steps,
    )
    if name == "wsd":
        return _with_wsd(spec, kwargs)
    return spec


def _check_kwarg_names(name: str, kwargs: dict[str, Any]) -> None:
    valid = _KWARGS[name]
    for key in kwargs:
        if key not in valid:
            choices = ", ".join(valid) if valid else "none"
            raise SchedulerError(f"{_KW}.{key} is not used by {_TYPE}={name!r}; valid: {choices}")


def _check_steps(name: str, warmup_steps: int, total_steps: int) -> None:
    if total_steps < 1:
        raise SchedulerError(f"the run has {total_steps} optimizer steps; need at least 1 "
                             "(set training.max_steps or training.num_train_epochs)")
    if warmup_steps < 0:
        raise SchedulerError(f"training.warmup_steps={warmup_steps} must be >= 0")
    if _MEGATRON_STYLE[name] != "constant" and warmup_steps >= total_steps:
        raise SchedulerError(
            f"warmup of {warmup_steps} steps leaves no decay for {_TYPE}={name!r} in a run of "
            f"{total_steps} steps; valid: warmup_steps < {total_steps}")


def _min_lr(name: str, kwargs: dict[str, Any], learning_rate: float) -> float:
    if "min_lr" in kwargs and "min_lr_rate" in kwargs:
        raise SchedulerError(f"{_KW} sets both min_lr and min_lr_rate; valid: one of them")
    if name == "cosine_with_min_lr" and not any(k in kwargs for k in _MIN_KWARGS):
        raise SchedulerError(f"{_TYPE}='cosine_with_min_lr' needs {_KW}.min_lr or "
                             f"{_KW}.min_lr_rate")
    if "min_lr_rate" in kwargs:
        rate = _number(kwargs, "min_lr_rate")
        if not 0.0 <= rate <= 1.0:
            raise SchedulerError(f"{_KW}.min_lr_rate={rate} must be in [0, 1]")
        return rate * float(learning_rate)
    min_lr = _number(kwargs, "min_lr") if "min_lr" in kwargs else 0.0
    if not 0.0 <= min_lr <= learning_rate:
        raise SchedulerError(f"{_KW}.min_lr={min_lr} must be in [0, learning_rate="
                             f"{learning_rate}]")
    return min_lr


def _number(kwargs: dict[str, Any], key: str) -> float:
    value = kwargs[key]
    try:
        if isinstance(value, bool):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise SchedulerError(f"{_KW}.{key}={value!r} must be a number") from None


def _with_wsd(spec: SchedulerSpec, kwargs: dict[str, Any]) -> SchedulerSpec:
    decay = _wsd_decay_steps(kwargs, spec.total_steps)
    room = spec.total_steps - spec.warmup_steps
    if not 1 <= decay <= room:
        raise SchedulerError(f"{_KW}: wsd decays over {decay} steps but the run has {room} "
                             f"steps after warmup; valid: 1..{room}")
    if "wsd_decay_style" in kwargs and "decay_type" in kwargs:
        raise SchedulerError(f"{_KW} sets both wsd_decay_style and decay_type; valid: one")
    style = str(kwargs.get("wsd_decay_style", kwargs.get("decay_type", "linear")))
    style = _WSD_ALIASES.get(style, style)
    if style not in WSD_DECAY_STYLES:
        raise SchedulerError(f"{_KW}.wsd_decay_style={style!r} is not known; valid: "
                             + ", ".join(WSD_DECAY_STYLES))
    return replace(spec, wsd_decay_steps=decay, wsd_decay_style=style)


def _wsd_decay_steps(kwargs: dict[str, Any], total_steps: int) -> int:
    if "num_decay_steps" in kwargs and "decay_ratio" in kwargs:
        raise SchedulerError(f"{_KW} sets both num_decay_steps and decay_ratio; valid: one")
    if "num_decay_steps" in kwargs:
        steps = kwargs["num_decay_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise SchedulerError(f"{_KW}.num_decay_steps={steps!r} must be an integer")
        return steps
    ratio = _number(kwargs, "decay_ratio") if "decay_ratio" in kwargs else _DEFAULT_WSD_DECAY_RATIO
    if not 0.0 < ratio <= 1.0:
        raise SchedulerError(f"{_KW}.decay_ratio={ratio} must be in (0, 1]")
    return max(1, round(ratio * total_steps))


# --- the Megatron scheduler ------------------------------------------------------------------


def build_lr_scheduler(spec: SchedulerSpec, optimizer: Any, weight_decay: float = 0.0) -> Any:
    """A :class:`MegatronLRScheduler` for ``spec`` on ``optimizer``.

    ``optimizer`` is a Megatron optimizer or anything with a ``param_groups`` list of dicts (all
    the scheduler touches). Weight decay stays constant at ``weight_decay``.
    """
    return _scheduler_class()(
        optimizer, spec,
        init_lr=0.0, max_lr=spec.max_lr, min_lr=spec.min_lr,
        lr_warmup_steps=spec.warmup_steps, lr_decay_steps=spec.decay_steps,
        lr_decay_style=spec.megatron_style,
        start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=spec.decay_steps,
        wd_incr_style="constant",
        wsd_decay_steps=spec.wsd_decay_steps, lr_wsd_decay_style=spec.wsd_decay_style,
    )


def get_megatron_lr_scheduler(training: Any, num_training_steps: int, optimizer: Any) -> Any:
    """The scheduler for a :class:`~hpc_mca.trainer.config.TrainingArguments` (read by attribute:
    lr_scheduler_type, lr_scheduler_kwargs, learning_rate, warmup_steps, warmup_ratio,
    weight_decay) over ``num_training_steps`` optimizer steps."""
    warmup = resolve_warmup_steps(training.warmup_steps, training.warmup_ratio,
                                  num_training_steps)
    spec = scheduler_spec(training.lr_scheduler_type, training.lr_scheduler_kwargs,
                          training.learning_rate, warmup, num_training_steps)
    return build_lr_scheduler(spec, optimizer, weight_decay=training.weight_decay)


@functools.cache
def _scheduler_class() -> type:
    """Defined on first use so that importing this module does not import megatron."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class MegatronLRScheduler(OptimizerParamScheduler):
        """OptimizerParamScheduler with HF's ``get_last_lr()`` and ``step()`` defaulting to 1.

        ``state_dict`` also records the HF name and the WSD settings. ``load_state_dict``
        restores the step count only: the schedule itself (peak and floor, warmup, decay and
        WSD lengths, weight decay) is the one this run's config defines, so a run resumed with
        a new max_steps (an extended run) or learning rate follows the schedule defined for
        the new settings from the resumed step on. What differs from the checkpoint is kept in
        ``rederived`` ({name: (checkpoint's, now)}) for the resume line.
        """

        def __init__(self, optimizer: Any, spec: SchedulerSpec, **kwargs: Any) -> None:
            self.spec = spec
            self.rederived: dict[str, tuple[Any, Any]] = {}
            super().__init__(optimizer, override_opt_param_scheduler=True,
                             use_checkpoint_opt_param_scheduler=False, **kwargs)

        def step(self, increment: int = 1) -> None:
            super().step(increment)

        def get_last_lr(self) -> list[float]:
            return [float(group["lr"]) for group in self.optimizer.param_groups]

        def state_dict(self) -> dict:
            state = super().state_dict()
            state.update(name=self.spec.name, wsd_decay_steps=self.wsd_decay_steps,
                         lr_wsd_decay_style=self.lr_wsd_decay_style)
            return state

        def load_state_dict(self, state_dict: dict) -> None:
            saved = state_dict.get("name", self.spec.name)
            if saved != self.spec.name:
                raise SchedulerError(f"{_TYPE}={self.spec.name!r} but the checkpoint's "
                                     f"scheduler is {saved!r}; valid: {saved!r}")
            now = {**super().state_dict(), "wsd_decay_steps": self.wsd_decay_steps}
            self.rederived = {key: (state_dict[key], now[key]) for key in _SCHEDULE_KEYS
                              if key in state_dict and state_dict[key] != now[key]}
            self.num_steps = 0
            super().load_state_dict(state_dict)  # overrides: keeps this run's schedule

    return MegatronLRScheduler


_SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "wsd_decay_steps",
                  "start_wd", "end_wd")
"""What a resumed run's config may change about the schedule (reported when it does)."""


def __getattr__(name: str) -> Any:
    if name == "MegatronLRScheduler":
        return _scheduler_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
