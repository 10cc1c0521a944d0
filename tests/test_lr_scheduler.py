"""Schedules by transformers' names on Megatron's OptimizerParamScheduler, against
transformers' own ``get_scheduler`` at every step."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import get_scheduler

from hpc_mca.config.schedule import (
    ALIASES,
    SCHEDULER_NAMES,
    SchedulerError,
    build_lr_scheduler,
    get_megatron_lr_scheduler,
    scheduler_spec,
)

LR, T, W = 1e-3, 100, 10

CASES = [
    ("linear", {}),
    ("cosine", {}),
    ("cosine", {"num_cycles": 1.5}),
    ("cosine_with_restarts", {}),
    ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {}),
    ("polynomial", {"lr_end": 1e-5, "power": 2.0}),
    ("constant", {}),
    ("constant_with_warmup", {}),
    ("inverse_sqrt", {}),
    ("inverse_sqrt", {"timescale": 7}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_with_min_lr", {"min_lr": 1e-5, "num_cycles": 0.4}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", {"min_lr": 1e-5, "warmup_lr_rate": 0.05}),
    ("warmup_stable_decay", {"num_decay_steps": 30}),
    ("warmup_stable_decay", {"num_decay_steps": 20, "warmup_type": "cosine",
                             "decay_type": "1-sqrt", "min_lr_ratio": 0.1}),
    ("warmup_stable_decay", {"num_decay_steps": 25, "num_stable_steps": 40,
                             "warmup_type": "1-sqrt", "decay_type": "linear", "num_cycles": 0.3}),
]


def _optimizer(groups: int = 2, lr: float = 0.0) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(groups)]
    return torch.optim.SGD([{"params": [p]} for p in params], lr=lr)


def _scheduler(name: str, kwargs: dict, optimizer=None, warmup: int = W, total: int = T):
    training = SimpleNamespace(lr_scheduler_type=name, lr_scheduler_kwargs=kwargs,
                               learning_rate=LR, warmup_steps=warmup, warmup_ratio=0.0,
                               weight_decay=0.01)
    return get_megatron_lr_scheduler(training, total, optimizer or _optimizer())


def _hf_rates(name: str, kwargs: dict, warmup: int, total: int) -> list[float]:
    """transformers' rate at steps 0..total (after construction, then after each step)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # wsd with both lengths given; lr_scheduler.step order
        hf = get_scheduler(name, _optimizer(1, lr=LR), num_warmup_steps=warmup,
                           num_training_steps=total, scheduler_specific_kwargs=dict(kwargs))
        rates = [hf.get_last_lr()[0]]
        for _ in range(total):
            hf.step()
            rates.append(hf.get_last_lr()[0])
    return rates


def test_every_name_is_covered():
    assert {name for name, _ in CASES} == set(SCHEDULER_NAMES)


@pytest.mark.parametrize("warmup", [0, W])
@pytest.mark.parametrize("name, kwargs", CASES)
def test_every_step_equals_transformers_get_scheduler(name: str, kwargs: dict, warmup: int):
    optimizer = _optimizer()
    scheduler = _scheduler(name, kwargs, optimizer, warmup=warmup)
    ours = [scheduler.get_last_lr()[0]]
    for _ in range(T):
        scheduler.step()
        ours.append(scheduler.get_last_lr()[0])
        assert optimizer.param_groups[1]["lr"] == ours[-1]
        assert optimizer.param_groups[1]["weight_decay"] == pytest.approx(0.01)
    assert ours == pytest.approx(_hf_rates(name, kwargs, warmup, T), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("alias, name", sorted(ALIASES.items()))
def test_megatron_names_are_aliases(alias: str, name: str):
    kwargs = {"num_decay_steps": 30} if name == "warmup_stable_decay" else {}
    ours, theirs = _scheduler(alias, kwargs), _scheduler(name, kwargs)
    for _ in range(T):
        ours.step()
        theirs.step()
        assert ours.get_last_lr() == theirs.get_last_lr()


@pytest.mark.parametrize("name, kwargs, warmup", [
    ("linear", {}, T), ("linear", {}, T + 20), ("cosine", {}, T), ("cosine", {}, T + 20),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}, T), ("polynomial", {}, T + 20),
    # (polynomial with a warmup of exactly T: transformers divides 0 by 0 after the last step)
])
def test_a_warmup_as_long_as_the_run_is_run_as_transformers_runs_it(name: str, kwargs: dict,
                                                                     warmup: int):
    # transformers accepts it (the whole run is warmup); so does this scheduler
    scheduler = _scheduler(name, kwargs, warmup=warmup)
    ours = [scheduler.get_last_lr()[0]]
    for _ in range(T):
        scheduler.step()
        ours.append(scheduler.get_last_lr()[0])
    assert ours == pytest.approx(_hf_rates(name, kwargs, warmup, T), rel=1e-12, abs=1e-15)
    assert max(ours[:T]) < LR  # the steps of the run are all warmup


def test_warmup_ratio_uses_hf_rounding():
    training = SimpleNamespace(lr_scheduler_type="linear", lr_scheduler_kwargs={},
                               learning_rate=LR, warmup_steps=0, warmup_ratio=0.051,
                               weight_decay=0.0)
    scheduler = get_megatron_lr_scheduler(training, T, _optimizer(1))
    assert scheduler.spec.warmup_steps == 6  # ceil(5.1)
    scheduler.step(6)
    assert scheduler.get_last_lr() == [pytest.approx(LR)]


@pytest.mark.parametrize("name, kwargs", [("cosine_with_min_lr", {"min_lr": 1e-5}),
                                          ("warmup_stable_decay", {"num_decay_steps": 30})])
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


@pytest.mark.parametrize("name, kwargs", [("cosine_with_min_lr", {"min_lr": 1e-5}), ("linear", {}),
                                          ("warmup_stable_decay", {"num_decay_steps": 30})])
def test_a_longer_run_resumed_follows_the_schedule_of_its_new_total(name: str, kwargs: dict):
    """An extended run (max_steps T -> 2T, resumed at step T) takes the rate transformers'
    schedule for 2T steps gives each later step, and reports what it re-derived."""
    first = _scheduler(name, kwargs)
    first.step(T)
    extended = _scheduler(name, kwargs, total=2 * T)
    extended.load_state_dict(first.state_dict())
    assert extended.rederived["lr_decay_steps"] == (T, 2 * T)
    if name == "warmup_stable_decay":
        assert extended.rederived["num_stable_steps"] == (T - W - 30, 2 * T - W - 30)
    got = []
    for _ in range(T):
        extended.step()
        got.append(extended.get_last_lr()[0])
    assert got == pytest.approx(_hf_rates(name, kwargs, W, 2 * T)[T + 1:], rel=1e-12, abs=1e-15)


def test_loading_another_schedulers_state_fails():
    state = _scheduler("cosine", {}).state_dict()
    with pytest.raises(SchedulerError, match="checkpoint's scheduler is 'cosine'"):
        _scheduler("linear", {}).load_state_dict(state)


def test_param_group_max_lr_scales_its_curve():
    optimizer = _optimizer(2)
    optimizer.param_groups[1]["max_lr"] = 2 * LR
    scheduler = _scheduler("cosine", {}, optimizer)
    scheduler.step(W + 30)
    low, high = scheduler.get_last_lr()
    assert high == pytest.approx(2 * low, rel=1e-12) and 0 < low < LR


def test_megatron_scheduler_class_is_exported():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from hpc_mca.config import schedule as lr_scheduler

    scheduler = build_lr_scheduler(scheduler_spec("linear", {}, LR, 0, 10), _optimizer(1))
    assert isinstance(scheduler, lr_scheduler.MegatronLRScheduler)
    assert isinstance(scheduler, OptimizerParamScheduler)


@pytest.mark.parametrize("name, kwargs, warmup, message", [
    ("cosine_annealing", {}, 0, "training.lr_scheduler_type='cosine_annealing' is not a known "
                                "scheduler; valid: linear, cosine, cosine_with_restarts, "
                                "polynomial, constant, "),
    ("reduce_lr_on_plateau", {}, 0, "sets the rate from a metric at every step"),
    ("greedy", {}, 0, "sets the rate from a metric at every step"),
    ("cosine", {"min_lr": 1e-5}, 0, "training.lr_scheduler_kwargs.min_lr is not a kwarg of "
                                    "training.lr_scheduler_type='cosine'; valid: num_cycles"),
    ("linear", {"min_lr_rate": 0.1}, 0, "valid: none"),
    ("cosine_with_min_lr", {}, 0, "needs training.lr_scheduler_kwargs.min_lr or"),
    ("cosine_with_min_lr", {"min_lr": 1.0}, 0, "training.lr_scheduler_kwargs.min_lr=1.0 must be "
                                               "a number in [0.0, 0.001]"),
    ("warmup_stable_decay", {}, 0, "needs training.lr_scheduler_kwargs.num_decay_steps"),
    ("wsd", {"num_decay_steps": 95}, 10, "num_decay_steps=95 must be an integer in 0..90"),
    ("wsd", {"num_decay_steps": 9, "decay_type": "step"}, 0,
     "decay_type='step' is not known; valid: linear, cosine, 1-sqrt"),
    ("polynomial", {"lr_end": 0.01}, 0, "lr_end=0.01 must be below learning_rate=0.001"),
    ("inverse_sqrt", {"timescale": 0}, 0, "timescale=0 must be a positive integer"),
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
