"""Learning-rate schedules exactly as transformers' ``get_scheduler``, run by Megatron-Core's
scheduler.

Users write ``lr_scheduler_type: cosine`` and ``lr_scheduler_kwargs: {num_cycles: 0.5}`` as in
transformers (the same names, kwarg names and defaults; the rate at every step agrees with
``transformers.get_scheduler`` to rounding, checked in tests/test_lr_scheduler.py). The run uses
``megatron.core.optimizer_param_scheduler.OptimizerParamScheduler``, which writes the rate into
every ``optimizer.param_groups`` entry (a group's own ``max_lr`` scales its curve) and
checkpoints with the rest of Megatron; only its ``get_lr`` is replaced by the HF factor below.

Two layers:

* :func:`scheduler_spec` (pure Python) validates a name, its kwargs, the peak rate, the warmup
  and the number of optimizer steps, with one line naming the field, the value and the valid
  choices. The config calls it at resolve time, before anything is allocated.
* :class:`MegatronLRScheduler` (imports megatron on first use) is the scheduler itself plus
  ``get_last_lr()`` and a default ``step()`` increment of 1, the interface HF loops expect.

Step convention (HF's): after construction the rate is the one of step 0; each ``step()``
follows one optimizer step. ``w`` is the warmup, ``T`` the number of training steps, the rate
is ``lr × factor(s)``; during warmup (``s < w``) the factor is ``s / w`` unless said otherwise.

| name (alias)                     | kwargs (defaults)                        | factor after warmup, p = (s - w) / (T - w)          |
|----------------------------------|------------------------------------------|-----------------------------------------------------|
| constant                         | -                                        | 1 (no warmup)                                       |
| constant_with_warmup             | -                                        | 1                                                   |
| linear                           | -                                        | max(0, 1 - p)                                       |
| cosine                           | num_cycles=0.5                           | max(0, (1 + cos(2π·num_cycles·p)) / 2)              |
| cosine_with_restarts             | num_cycles=1                             | (1 + cos(π·(num_cycles·p mod 1))) / 2, 0 from p ≥ 1  |
| polynomial                       | lr_end=1e-7, power=1.0                   | ((lr - lr_end)·(1 - p)^power + lr_end) / lr          |
| inverse_sqrt (inverse-square-root) | timescale=w or 10000                   | 1 / sqrt((s + timescale - w) / timescale)           |
| cosine_with_min_lr               | num_cycles=0.5, min_lr or min_lr_rate    | cosine, scaled to [min_lr_rate, 1]                  |
| cosine_warmup_with_min_lr        | as above + warmup_lr_rate=None           | the same on (s - w + 1); warmup from warmup_lr_rate |
| warmup_stable_decay (wsd, WSD)   | num_decay_steps (required),              | warmup (warmup_type), 1 until T - D, then decay     |
|                                  | num_stable_steps=T - w - D,              | (decay_type) to min_lr_ratio; warm-up starts at     |
|                                  | warmup_type=linear, decay_type=cosine,   | min_lr_ratio too                                    |
|                                  | min_lr_ratio=0, num_cycles=0.5           |                                                     |

``reduce_lr_on_plateau`` and ``greedy`` (rates driven by a metric each step) are refused in one
line. The aliases are Megatron's ``lr_decay_style`` names.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from hpc_mca.errors import UserError

if TYPE_CHECKING:
    from .sections import TrainingArguments

__all__ = [
    "MegatronLRScheduler",  # noqa: F822 - built on first use by the module __getattr__
    "SCHEDULER_NAMES", "SchedulerError", "SchedulerSpec",
    "build_lr_scheduler", "get_megatron_lr_scheduler", "resolve_warmup_steps", "scheduler_spec",
]

_REQUIRED = object()
_MIN_LR = {"min_lr": None, "min_lr_rate": None}
_KWARGS: dict[str, dict[str, Any]] = {
    "linear": {},
    "cosine": {"num_cycles": 0.5},
    "cosine_with_restarts": {"num_cycles": 1},
    "polynomial": {"lr_end": 1e-7, "power": 1.0},
    "constant": {},
    "constant_with_warmup": {},
    "inverse_sqrt": {"timescale": None},
    "cosine_with_min_lr": {"num_cycles": 0.5, **_MIN_LR},
    "cosine_warmup_with_min_lr": {"num_cycles": 0.5, **_MIN_LR, "warmup_lr_rate": None},
    "warmup_stable_decay": {"num_decay_steps": _REQUIRED, "num_stable_steps": None,
                            "warmup_type": "linear", "decay_type": "cosine",
                            "min_lr_ratio": 0.0, "num_cycles": 0.5},
}
"""Each accepted name's kwargs and their defaults, as transformers has them."""
SCHEDULER_NAMES = tuple(_KWARGS)
"""Accepted ``lr_scheduler_type`` values (transformers' names; see also the aliases)."""
ALIASES = {"inverse-square-root": "inverse_sqrt", "WSD": "warmup_stable_decay",
           "wsd": "warmup_stable_decay"}
"""Megatron's ``lr_decay_style`` names for the same schedules."""
_METRIC_DRIVEN = ("reduce_lr_on_plateau", "greedy")
WSD_SHAPES = ("linear", "cosine", "1-sqrt")

_TYPE = "training.lr_scheduler_type"
_KW = "training.lr_scheduler_kwargs"


class SchedulerError(UserError):
    """A bad scheduler name, kwarg or step count; the message is one line."""


@dataclass(frozen=True)
class SchedulerSpec:
    """A validated schedule: the HF name and kwargs (defaults filled in), the peak rate, the
    warmup and the run's length."""

    name: str
    """transformers' name (an alias is resolved)."""
    max_lr: float
    """Peak rate (``learning_rate``)."""
    min_lr: float
    """Where the schedule ends (its floor: min_lr, lr_end, min_lr_ratio·lr; 0 for most)."""
    warmup_steps: int
    """HF's ``num_warmup_steps``."""
    total_steps: int
    """Optimizer steps of the run (T)."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The schedule's kwargs with transformers' defaults filled in."""

    @property
    def decay_steps(self) -> int:
        """Megatron's ``lr_decay_steps`` (kept in its state dict): T, or just past the warmup
        for schedules that do not decay."""
        return max(self.total_steps, self.warmup_steps + 1)

    def factor(self, step: int) -> float:
        """The rate at ``step`` as a fraction of the peak (transformers' lambda)."""
        return _FACTORS[self.name](self, step)


def resolve_warmup_steps(warmup_steps: int, warmup_ratio: float, total_steps: int) -> int:
    """HF rule: ``warmup_steps`` when positive, else ``ceil(warmup_ratio * total_steps)``."""
    return warmup_steps if warmup_steps > 0 else math.ceil(warmup_ratio * total_steps)


def scheduler_spec(name: str, kwargs: Mapping[str, Any] | None, learning_rate: float,
                   warmup_steps: int, total_steps: int) -> SchedulerSpec:
    """Validate HF-style scheduler arguments (one-line SchedulerError otherwise)."""
    canonical = ALIASES.get(name, name)
    if canonical in _METRIC_DRIVEN:
        raise SchedulerError(f"{_TYPE}={name!r} sets the rate from a metric at every step, which "
                             f"this trainer does not feed it; valid: {', '.join(SCHEDULER_NAMES)}")
    if canonical not in _KWARGS:
        raise SchedulerError(f"{_TYPE}={name!r} is not a known scheduler; valid: "
                             + ", ".join(SCHEDULER_NAMES) + " (aliases: " + ", ".join(ALIASES) + ")")
    given = dict(kwargs or {})
    for key in given:
        if key not in _KWARGS[canonical]:
            choices = ", ".join(_KWARGS[canonical]) or "none"
            raise SchedulerError(f"{_KW}.{key} is not a kwarg of {_TYPE}={name!r}; valid: {choices}")
    resolved = {**_KWARGS[canonical], **given}
    for key, value in resolved.items():
        if value is _REQUIRED:
            raise SchedulerError(f"{_TYPE}={name!r} needs {_KW}.{key}")
    if total_steps < 1:
        raise SchedulerError(f"the run has {total_steps} optimizer steps; need at least 1 "
                             "(set training.max_steps or training.num_train_epochs)")
    if warmup_steps < 0:
        raise SchedulerError(f"training.warmup_steps={warmup_steps} must be >= 0")
    if canonical == "constant":
        warmup_steps = 0  # transformers ignores the warmup for it
    spec = SchedulerSpec(canonical, float(learning_rate), 0.0, warmup_steps, total_steps, resolved)
    return _CHECKS.get(canonical, _check_decay)(spec)


def _number(spec: SchedulerSpec, key: str, low: float, high: float = math.inf) -> float:
    value = spec.kwargs[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise SchedulerError(f"{_KW}.{key}={value!r} must be a number in [{low}, {high}]")
    return float(value)


def _check_decay(spec: SchedulerSpec) -> SchedulerSpec:
    """Schedules that decay over T - w steps. A warmup as long as the run (or longer) is
    allowed, as in transformers: the whole run is then warmup (``warmup_ratio: 0.1`` of a
    1-step run rounds up to one warmup step, which runs at rate 0)."""
    if "num_cycles" in spec.kwargs:
        _number(spec, "num_cycles", 0.0)
    return spec


def _check_polynomial(spec: SchedulerSpec) -> SchedulerSpec:
    lr_end, _ = _number(spec, "lr_end", 0.0), _number(spec, "power", 0.0)
    if not spec.max_lr > lr_end:
        raise SchedulerError(f"{_KW}.lr_end={lr_end} must be below learning_rate={spec.max_lr}")
    return _check_decay(replace(spec, min_lr=lr_end))


def _check_inverse_sqrt(spec: SchedulerSpec) -> SchedulerSpec:
    timescale = spec.kwargs["timescale"]
    if timescale is None:
        timescale = spec.warmup_steps or 10_000
    elif isinstance(timescale, bool) or not isinstance(timescale, int) or timescale < 1:
        raise SchedulerError(f"{_KW}.timescale={timescale!r} must be a positive integer")
    return replace(spec, kwargs={**spec.kwargs, "timescale": timescale})


def _check_min_lr(spec: SchedulerSpec) -> SchedulerSpec:
    kw = spec.kwargs
    if kw["min_lr"] is not None and kw["min_lr_rate"] is not None:
        raise SchedulerError(f"{_KW} sets both min_lr and min_lr_rate; valid: one of them")
    if kw["min_lr"] is None and kw["min_lr_rate"] is None:
        raise SchedulerError(f"{_TYPE}={spec.name!r} needs {_KW}.min_lr or {_KW}.min_lr_rate")
    if kw["min_lr"] is not None:
        rate = _number(spec, "min_lr", 0.0, spec.max_lr) / spec.max_lr if spec.max_lr else 0.0
    else:
        rate = _number(spec, "min_lr_rate", 0.0, 1.0)
    if kw.get("warmup_lr_rate") is not None:
        _number(spec, "warmup_lr_rate", 0.0, 1.0)
    return _check_decay(replace(spec, min_lr=rate * spec.max_lr, kwargs={**kw, "min_lr_rate": rate}))


def _check_wsd(spec: SchedulerSpec) -> SchedulerSpec:
    kw, total, warmup = spec.kwargs, spec.total_steps, spec.warmup_steps
    for key in ("warmup_type", "decay_type"):
        if kw[key] not in WSD_SHAPES:
            raise SchedulerError(f"{_KW}.{key}={kw[key]!r} is not known; valid: "
                                 + ", ".join(WSD_SHAPES))
    decay = kw["num_decay_steps"]
    room = total - warmup
    if isinstance(decay, bool) or not isinstance(decay, int) or not 0 <= decay <= room:
        raise SchedulerError(f"{_KW}.num_decay_steps={decay!r} must be an integer in "
                             f"0..{room} (the run's {total} steps after {warmup} of warmup)")
    stable = kw["num_stable_steps"]
    if stable is None:
        stable = room - decay  # transformers' rule when only the run length is known
    elif isinstance(stable, bool) or not isinstance(stable, int) or stable < 0:
        raise SchedulerError(f"{_KW}.num_stable_steps={stable!r} must be a non-negative integer")
    ratio = _number(spec, "min_lr_ratio", 0.0, 1.0)
    _number(spec, "num_cycles", 0.0)
    return replace(spec, min_lr=ratio * spec.max_lr, kwargs={**kw, "num_stable_steps": stable})


_CHECKS: dict[str, Callable[[SchedulerSpec], SchedulerSpec]] = {
    "polynomial": _check_polynomial, "inverse_sqrt": _check_inverse_sqrt,
    "cosine_with_min_lr": _check_min_lr, "cosine_warmup_with_min_lr": _check_min_lr,
    "warmup_stable_decay": _check_wsd,
}


# --- the factors (transformers' lambdas, restated) ---------------------------------------------


def _ramp(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _progress(spec: SchedulerSpec, step: int) -> float:
    return float(step - spec.warmup_steps) / float(max(1, spec.total_steps - spec.warmup_steps))


def _with_warmup(after: Callable[[SchedulerSpec, int], float]) -> Callable[[SchedulerSpec, int], float]:
    def factor(spec: SchedulerSpec, step: int) -> float:
        return _ramp(step, spec.warmup_steps) if step < spec.warmup_steps else after(spec, step)
    return factor


def _cosine(spec: SchedulerSpec, progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * float(spec.kwargs["num_cycles"]) * 2.0 * progress))


def _restarts(spec: SchedulerSpec, step: int) -> float:
    progress = _progress(spec, step)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (float(spec.kwargs["num_cycles"]) * progress % 1.0))))


def _polynomial(spec: SchedulerSpec, step: int) -> float:
    lr_end, peak = spec.kwargs["lr_end"], spec.max_lr
    if step >= spec.total_steps:  # also keeps a warmup of the whole run off a 0/0
        return lr_end / peak
    remaining = 1 - (step - spec.warmup_steps) / (spec.total_steps - spec.warmup_steps)
    return ((peak - lr_end) * remaining ** spec.kwargs["power"] + lr_end) / peak


def _inverse_sqrt(spec: SchedulerSpec, step: int) -> float:
    timescale = spec.kwargs["timescale"]
    return 1.0 / math.sqrt((step + timescale - spec.warmup_steps) / timescale)


def _cosine_min(spec: SchedulerSpec, step: int) -> float:
    rate = spec.kwargs["min_lr_rate"]
    return max(0.0, _cosine(spec, _progress(spec, step)) * (1 - rate) + rate)


def _cosine_warmup_min(spec: SchedulerSpec, step: int) -> float:
    """cosine_warmup_with_min_lr: the warmup ends at 1 on its last step, the decay counts from
    one step later than the other schedules."""
    s, w, total = float(step), float(spec.warmup_steps), float(spec.total_steps)
    start = spec.kwargs["warmup_lr_rate"]
    if s < w:
        if start is None:
            return (s + 1.0) / max(1.0, w)
        return start + (1.0 - start) * s / max(1, w - 1)
    progress = (s - w + 1.0) / max(1.0, total - w)
    rate = spec.kwargs["min_lr_rate"]
    return max(0.0, _cosine(spec, progress) * (1 - rate) + rate)


def _wsd_shape(kind: str, x: float, rising: bool) -> float:
    if kind == "linear":
        return x if rising else 1.0 - x
    if kind == "cosine":
        return 0.5 * (1.0 - math.cos(math.pi * x)) if rising else 0.5 * (1.0 + math.cos(math.pi * x))
    return 1.0 - math.sqrt(1.0 - x) if rising else 1.0 - math.sqrt(x)


def _wsd(spec: SchedulerSpec, step: int) -> float:
    kw, warmup = spec.kwargs, spec.warmup_steps
    ratio, stable, decay = kw["min_lr_ratio"], kw["num_stable_steps"], kw["num_decay_steps"]
    if step < warmup:
        shape = _wsd_shape(kw["warmup_type"], _ramp(step, warmup), rising=True)
    elif step < warmup + stable:
        return 1.0
    elif step < warmup + stable + decay:
        x = float(step - warmup - stable) / float(max(1, decay))
        shape = (_cosine(spec, x) if kw["decay_type"] == "cosine"
                 else _wsd_shape(kw["decay_type"], x, rising=False))
    else:
        return ratio
    return max(0.0, shape * (1.0 - ratio) + ratio)


_FACTORS: dict[str, Callable[[SchedulerSpec, int], float]] = {
    "constant": lambda spec, step: 1.0,
    "constant_with_warmup": _with_warmup(lambda spec, step: 1.0),
    "linear": _with_warmup(lambda spec, step: max(0.0, float(spec.total_steps - step) / float(
        max(1, spec.total_steps - spec.warmup_steps)))),
    "cosine": _with_warmup(lambda spec, step: max(0.0, _cosine(spec, _progress(spec, step)))),
    "cosine_with_restarts": _with_warmup(_restarts),
    "polynomial": _with_warmup(_polynomial),
    "inverse_sqrt": _with_warmup(_inverse_sqrt),
    "cosine_with_min_lr": _with_warmup(_cosine_min),
    "cosine_warmup_with_min_lr": _cosine_warmup_min,
    "warmup_stable_decay": _wsd,
}


# --- the Megatron scheduler ------------------------------------------------------------------


class ParamGroups(Protocol):
    """What the scheduler touches of an optimizer: a Megatron optimizer's or torch's groups."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


def build_lr_scheduler(spec: SchedulerSpec, optimizer: ParamGroups, weight_decay: float = 0.0) -> Any:
    """A :class:`MegatronLRScheduler` for ``spec`` on ``optimizer``.

    ``optimizer`` is a Megatron optimizer or anything with a ``param_groups`` list of dicts (all
    the scheduler touches). Weight decay stays constant: at construction and every step the
    scheduler sets each group's ``weight_decay`` to ``weight_decay`` × the group's ``wd_mult``
    (Megatron's key, 1 when absent), so a group that must not decay says so with ``wd_mult: 0``
    (a ``weight_decay`` of its own is overwritten).
    """
    # Megatron's own decay arguments only describe the run for its state dict and checks; the
    # rate itself comes from spec.factor (see MegatronLRScheduler.get_lr).
    return _scheduler_class()(
        optimizer, spec,
        init_lr=0.0, max_lr=spec.max_lr, min_lr=spec.min_lr,
        lr_warmup_steps=spec.warmup_steps, lr_decay_steps=spec.decay_steps,
        lr_decay_style="constant",
        start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=spec.decay_steps,
        wd_incr_style="constant",
    )


def get_megatron_lr_scheduler(training: TrainingArguments, num_training_steps: int,
                              optimizer: ParamGroups) -> Any:
    """The scheduler for a :class:`~hpc_mca.config.sections.TrainingArguments` (read by attribute:
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
        """OptimizerParamScheduler with transformers' rates (``get_lr``), HF's ``get_last_lr()``
        and ``step()`` defaulting to 1.

        A param group's ``max_lr`` (Megatron's per-group override) scales its curve; the
        group's ``min_lr`` is not used (HF's schedules define their own floor). ``state_dict``
        also records the HF name and kwargs. ``load_state_dict`` restores the step count only:
        the schedule itself (peak, warmup, length, kwargs, weight decay) is the one this run's
        config defines, so a run resumed with a new max_steps (an extended run) or learning
        rate follows the schedule defined for the new settings from the resumed step on. What
        differs from the checkpoint is kept in ``rederived`` ({name: (checkpoint's, now)}) for
        the resume line.
        """

        def __init__(self, optimizer: ParamGroups, spec: SchedulerSpec, **kwargs: float | str) -> None:
            self.spec = spec
            self.rederived: dict[str, tuple[Any, Any]] = {}
            super().__init__(optimizer, override_opt_param_scheduler=True,
                             use_checkpoint_opt_param_scheduler=False, **kwargs)

        def get_lr(self, param_group: dict) -> float:
            peak = param_group.get("max_lr", self.max_lr)
            assert peak is not None  # this class always passes max_lr to Megatron's __init__
            return float(peak) * self.spec.factor(self.num_steps)

        def step(self, increment: int = 1) -> None:
            super().step(increment)

        def get_last_lr(self) -> list[float]:
            return [float(group["lr"]) for group in self.optimizer.param_groups]

        def state_dict(self) -> dict:
            return {**super().state_dict(), "name": self.spec.name, "kwargs": dict(self.spec.kwargs)}

        def load_state_dict(self, state_dict: dict) -> None:
            saved = state_dict.get("name", self.spec.name)
            if ALIASES.get(saved, saved) != self.spec.name:
                raise SchedulerError(f"{_TYPE}={self.spec.name!r} but the checkpoint's "
                                     f"scheduler is {saved!r}; valid: {saved!r}")
            now = super().state_dict()
            self.rederived = {key: (state_dict[key], now[key]) for key in _SCHEDULE_KEYS
                              if key in state_dict and state_dict[key] != now[key]}
            old_kwargs = state_dict.get("kwargs") or {}
            self.rederived.update({key: (old_kwargs[key], value) for key, value in self.spec.kwargs.items()
                                   if key in old_kwargs and old_kwargs[key] != value})
            self.num_steps = 0
            super().load_state_dict(state_dict)  # overrides: keeps this run's schedule

    return MegatronLRScheduler


_SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "start_wd", "end_wd")
"""What a resumed run's config may change about the schedule (reported when it does)."""


def __getattr__(name: str) -> Any:
    if name == "MegatronLRScheduler":
        return _scheduler_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
