"""HF-named schedules on Megatron's OptimizerParamScheduler against closed-form formulas."""

import math
from types import SimpleNamespace

import pytest
import torch

from hpc_mca.trainer.lr_scheduler import (
    SCHEDULER_NAMES,
    SchedulerError,
    build_lr_scheduler,
    get_megatron_lr_scheduler,
    scheduler_spec,
)

LR, T, W = 1e-3, 100, 10


def closed_form(name: str, step: int, kwargs: dict) -> float:
    """The documented formulas, written out independently of Megatron's code."""
    floor = kwargs.get("min_lr", kwargs.get("min_lr_rate", 0.0) * LR)
    warmup = 0 if name == "constant" else W
    if step <= warmup and warmup > 0:
        return LR * step / warmup
    if name in ("constant", "constant_with_warmup"):
        return LR
    progress = (step - W) / (T - W)
    if name == "linear":
        return floor + (LR - floor) * (1 - progress)
    if name in ("cosine", "cosine_with_min_lr"):
        return floor + (LR - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if name == "inverse_sqrt":
        return max(floor, LR * math.sqrt(W / step))
    decay = kwargs.get("num_decay_steps") or round(kwargs.get("decay_ratio", 0.1) * T)
    if step <= T - decay:
        return LR
    x = (step - (T - decay)) / decay
    shape = {"linear": 1 - x, "cosine": 0.5 * (1 + math.cos(math.pi * x)),
             "exponential": 2 * 0.5**x - 1, "minus_sqrt": 1 - math.sqrt(x)}
    return floor + (LR - floor) * shape[kwargs.get("wsd_decay_style", "linear")]


CASES = [
    ("constant", {}),
    ("constant_with_warmup", {}),
    ("linear", {}),
    ("cosine", {}),
    ("cosine", {"min_lr": 1e-5}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("inverse_sqrt", {}),
    ("wsd", {}),
    ("wsd", {"num_decay_steps": 30, "wsd_decay_style": "cosine", "min_lr": 1e-5}),
    ("wsd", {"decay_ratio": 0.2, "wsd_decay_style": "exponential"}),
    ("wsd", {"num_decay_steps": 25, "wsd_decay_style": "minus_sqrt", "min_lr_rate": 0.05}),
]


def _optimizer(groups: int = 2) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(groups)]
    return torch.optim.SGD([{"params": [p]} for p in params], lr=0.0)


def _scheduler(name: str, kwargs: dict, optimizer=None, warmup: int = W):
    training = SimpleNamespace(lr_scheduler_type=name, lr_scheduler_kwargs=kwargs,
                               learning_rate=LR, warmup_steps=warmup, warmup_ratio=0.0,
                               weight_decay=0.01)
    return get_megatron_lr_scheduler(training, T, optimizer or _optimizer())


def test_every_name_is_covered():
    assert {name for name, _ in CASES} == set(SCHEDULER_NAMES)


@pytest.mark.parametrize("name, kwargs", CASES)
def test_warmup_mid_and_end_match_closed_form(name: str, kwargs: dict):
    optimizer = _optimizer()
    scheduler = _scheduler(name, kwargs, optimizer)
    checked = {0, 1, W // 2, W, W + 1, T // 2, 75, 85, T - 1, T}
    for step in range(T + 1):
        if step in checked:
            expected = closed_form(name, step, kwargs)
            assert scheduler.get_last_lr() == pytest.approx([expected] * 2, rel=1e-12, abs=1e-15)
            assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, abs=1e-15)
            assert optimizer.param_groups[1]["weight_decay"] == pytest.approx(0.01)
        scheduler.step()


def test_warmup_ratio_uses_hf_rounding():
    training = SimpleNamespace(lr_scheduler_type="linear", lr_scheduler_kwargs={},
                               learning_rate=LR, warmup_steps=0, warmup_ratio=0.051,
                               weight_decay=0.0)
    scheduler = get_megatron_lr_scheduler(training, T, _optimizer(1))
    assert scheduler.spec.warmup_steps == 6  # ceil(5.1)
    scheduler.step(6)
    assert scheduler.get_last_lr() == [pytest.approx(LR)]


@pytest.mark.parametrize("name, kwargs", [("cosine", {"min_lr": 1e-5}),
                                          ("wsd", {"num_decay_steps": 30})])
def test_state_dict_round_trip_continues_the_curve(name: str, kwargs: dict):
    reference = _scheduler(name, kwargs)
    expected = []
    for _ in range(T):
        reference.step()
        expected.append(reference.get_last_lr()[0])

    first = _scheduler(name, kwargs)
    for _ in range(37):
        first.step()
    state = first.state_dict()
    assert state["name"] == name and state["num_steps"] == 37

    resumed = _scheduler(name, kwargs)
    resumed.step(5)  # loading must set the step, not add to it
    resumed.load_state_dict(state)
    got = [resumed.get_last_lr()[0]]
    for _ in range(T - 38):
        resumed.step()
        got.append(resumed.get_last_lr()[0])
    assert got == pytest.approx(expected[36:T - 1], rel=1e-12)


@pytest.mark.parametrize("name, kwargs", [("cosine", {"min_lr": 1e-5}), ("linear", {}),
                                          ("wsd", {"num_decay_steps": 30})])
def test_a_longer_run_resumed_follows_the_schedule_of_its_new_total(name: str, kwargs: dict):
    """An extended run (max_steps T -> 2T, resumed at step T) takes the rate the schedule
    defined for 2T steps gives each later step, checked against transformers' own schedule
    (cosine, linear) or the closed form (wsd), and reports what it re-derived."""
    from transformers import get_scheduler

    first = _scheduler(name, kwargs)
    first.step(T)
    training = SimpleNamespace(lr_scheduler_type=name, lr_scheduler_kwargs=kwargs,
                               learning_rate=LR, warmup_steps=W, warmup_ratio=0.0,
                               weight_decay=0.01)
    extended = get_megatron_lr_scheduler(training, 2 * T, _optimizer())
    extended.load_state_dict(first.state_dict())
    assert extended.rederived["lr_decay_steps"] == (T, 2 * T)
    got = []
    for _ in range(T):
        extended.step()
        got.append(extended.get_last_lr()[0])
    if name == "wsd":
        stable_until = 2 * T - kwargs["num_decay_steps"]
        want = [LR if s <= stable_until else LR * (1 - (s - stable_until) / 30)
                for s in range(T + 1, 2 * T + 1)]
    else:
        # transformers' schedules decay to 0: compare the shape above the floor.
        floor = kwargs.get("min_lr", 0.0)
        hf = get_scheduler(name, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                           num_warmup_steps=W, num_training_steps=2 * T)
        hf_rates = []
        for _ in range(2 * T):
            hf.step()
            hf_rates.append(hf.get_last_lr()[0])
        want = [floor + (LR - floor) * rate for rate in hf_rates[T:]]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_loading_another_schedulers_state_fails():
    state = _scheduler("cosine", {}).state_dict()
    with pytest.raises(SchedulerError, match="checkpoint's scheduler is 'cosine'"):
        _scheduler("linear", {}).load_state_dict(state)


def test_param_group_overrides_are_honoured():
    optimizer = _optimizer(2)
    optimizer.param_groups[1]["max_lr"] = 2 * LR
    scheduler = _scheduler("constant_with_warmup", {}, optimizer)
    scheduler.step(W)
    assert scheduler.get_last_lr() == pytest.approx([LR, 2 * LR])


def test_megatron_scheduler_class_is_exported():
    from hpc_mca.trainer import lr_scheduler

    scheduler = build_lr_scheduler(scheduler_spec("linear", {}, LR, 0, 10), _optimizer(1))
    assert isinstance(scheduler, lr_scheduler.MegatronLRScheduler)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    assert isinstance(scheduler, OptimizerParamScheduler)


@pytest.mark.parametrize("name, kwargs, warmup, message", [
    ("cosine_annealing", {}, 0, "training.lr_scheduler_type='cosine_annealing' is not a known "
                                "scheduler; valid: constant, constant_with_warmup, linear, "
                                "cosine, cosine_with_min_lr, inverse_sqrt, wsd"),
    ("cosine", {"num_cycles": 2}, 0, "training.lr_scheduler_kwargs.num_cycles is not used by "
                                     "training.lr_scheduler_type='cosine'; valid: min_lr, "
                                     "min_lr_rate"),
    ("cosine_with_min_lr", {}, 0, "needs training.lr_scheduler_kwargs.min_lr or"),
    ("linear", {"min_lr": 1.0}, 0, "training.lr_scheduler_kwargs.min_lr=1.0 must be in [0, "),
    ("wsd", {"num_decay_steps": 95}, 10, "wsd decays over 95 steps but the run has 90 steps"),
    ("wsd", {"wsd_decay_style": "step"}, 0, "wsd_decay_style='step' is not known; valid: linear"),
    ("linear", {}, 100, "warmup of 100 steps leaves no decay"),
])
def test_bad_input_is_one_line(name: str, kwargs: dict, warmup: int, message: str):
    with pytest.raises(SchedulerError) as err:
        scheduler_spec(name, kwargs, LR, warmup, T)
    assert "\n" not in str(err.value)
    assert message in str(err.value)


def test_constant_ignores_warmup_like_hf():
    spec = scheduler_spec("constant", {}, LR, 10, T)
    assert spec.warmup_steps == 0
    spec = scheduler_spec("constant_with_warmup", {}, LR, T, T)  # warmup may fill the run
    assert spec.decay_steps == T + 1
