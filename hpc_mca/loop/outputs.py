"""What a finished run leaves in its output_dir besides the model: the files a LLaMA-Factory
(transformers ``Trainer``) run leaves there, so the tools that read them (LLaMA-Factory's
``plot_loss``, scripts that read ``all_results.json``) work on hpc-mca runs.

* ``trainer_state.json``: transformers' ``TrainerState`` as ``Trainer.save_state`` writes it.
  Its ``log_history`` is rebuilt from the run's own records, so it covers every job of a
  requeued run: one entry per logging step (and the last step) from steps.jsonl with
  transformers' names (``loss``, ``grad_norm``, ``learning_rate``, ``epoch``, ``step``), one
  per evaluation from evals.jsonl (``eval_loss`` ...), and the train metrics last.
* ``train_results.json`` and ``all_results.json`` (``Trainer.save_metrics("train")``; the
  latter also holds the last evaluation's ``eval_*``, as LLaMA-Factory's evaluation after
  training adds them, and that evaluation is ``eval_results.json``).

The train metrics have transformers' meaning: they cover the steps this job trained (a job
resumed at step 40 of 100 reports 60 steps), ``train_runtime`` is this job's wall time from its
first step's start to the last step's end (saves and evaluations included), the rates divide
it, ``train_loss`` is the mean loss of those steps, ``epoch`` is where the run ended in epochs.
``total_flos`` is the model's FLOPs per token (the MFU figure's, :mod:`.metrics`) times the
input tokens of every step of the run. Rank 0 writes them, after the exports.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from transformers.trainer_callback import TrainerState

from hpc_mca.rundir import EVALS_FILE, STEPS_FILE, read_step_records, write_atomic

__all__ = ["JobSpan", "RunSummary", "write_run_outputs"]

TRAINER_STATE_FILE = "trainer_state.json"
TRAIN_RESULTS_FILE = "train_results.json"
EVAL_RESULTS_FILE = "eval_results.json"
ALL_RESULTS_FILE = "all_results.json"

_NAMES = {"lr": "learning_rate"}
"""steps.jsonl's names that transformers spells otherwise in ``log_history``."""
_LOGGED = ("loss", "grad_norm", "lr")


@dataclass(frozen=True)
class JobSpan:
    """What this job (this process) trained: from ``first_step`` (the step it resumed at, 0
    for a fresh run) to the run's end, in ``seconds`` of wall time."""

    first_step: int
    seconds: float


@dataclass(frozen=True)
class RunSummary:
    """The finished run, as the loop knows it at its end."""

    global_step: int
    max_steps: int
    steps_per_epoch: int
    """Optimizer steps in one epoch of the training data (the epoch figures divide by it)."""
    num_train_epochs: float
    logging_steps: int
    eval_steps: int | None
    save_steps: int | None
    train_batch_size: int
    """transformers' ``train_batch_size``: rows per device per micro-batch."""
    consumed_samples: int
    flops_per_token: float
    job: JobSpan


def write_run_outputs(run_dir: Path, summary: RunSummary) -> dict[str, float]:
    """Write trainer_state.json, train_results.json, all_results.json (and eval_results.json
    when the run evaluated) into ``run_dir``; returns the train metrics."""
    steps = {k: v for k, v in read_step_records(run_dir / STEPS_FILE).items() if k <= summary.global_step}
    evals = {k: v for k, v in read_step_records(run_dir / EVALS_FILE).items() if k <= summary.global_step}
    train = _train_metrics(summary, steps)
    history = [*_train_history(summary, steps), *_eval_history(summary, evals)]
    history.sort(key=lambda entry: (int(_number(entry["step"])), "loss" not in entry))
    history.append({**train, "step": summary.global_step})
    state = TrainerState(
        epoch=_epoch(summary, summary.global_step), global_step=summary.global_step,
        max_steps=summary.max_steps, logging_steps=summary.logging_steps,
        eval_steps=summary.eval_steps or 0, save_steps=summary.save_steps or 500,
        train_batch_size=summary.train_batch_size, num_train_epochs=math.ceil(summary.num_train_epochs),
        total_flos=train["total_flos"], log_history=history)
    _write(run_dir / TRAINER_STATE_FILE, dataclasses.asdict(state))
    _write(run_dir / TRAIN_RESULTS_FILE, train)
    results = dict(train)
    if evals:
        last = {k: _number(v) for k, v in evals[max(evals)].items() if k != "step" and _finite(v)}
        last["epoch"] = _epoch(summary, max(evals))
        _write(run_dir / EVAL_RESULTS_FILE, last)
        results.update(last)
        results["epoch"] = train["epoch"]
    _write(run_dir / ALL_RESULTS_FILE, results)
    return train


def _train_metrics(summary: RunSummary, steps: Mapping[int, Mapping[str, object]]) -> dict[str, float]:
    job = summary.job
    mine = [steps[k] for k in range(job.first_step + 1, summary.global_step + 1) if k in steps]
    losses = [_number(r["loss"]) for r in mine if _finite(r.get("loss"))]
    trained = summary.global_step - job.first_step
    seconds = max(job.seconds, 1e-9)
    samples = summary.consumed_samples * trained / max(summary.global_step, 1)
    tokens = sum(_number(r.get("input_tokens", 0)) for r in steps.values())
    return {
        "epoch": _epoch(summary, summary.global_step),
        "total_flos": float(summary.flops_per_token * tokens),
        **({"train_loss": sum(losses) / len(losses)} if losses else {}),  # none: resumed at its end
        "train_runtime": round(job.seconds, 4),
        "train_samples_per_second": round(samples / seconds, 3),
        "train_steps_per_second": round(trained / seconds, 3),
    }


def _train_history(summary: RunSummary, steps: Mapping[int, Mapping[str, object]]) -> Iterable[dict[str, float]]:
    every = max(summary.logging_steps, 1)
    for step in sorted(steps):
        if step % every and step != summary.global_step:
            continue
        record = steps[step]
        entry = {_NAMES.get(k, k): _number(record[k]) for k in _LOGGED if _finite(record.get(k))}
        yield {**entry, "epoch": _epoch(summary, step), "step": step}


def _eval_history(summary: RunSummary, evals: Mapping[int, Mapping[str, object]]) -> Iterable[dict[str, float]]:
    for step in sorted(evals):
        metrics = {k: _number(v) for k, v in evals[step].items() if k != "step" and _finite(v)}
        yield {**metrics, "epoch": _epoch(summary, step), "step": step}


def _epoch(summary: RunSummary, step: int) -> float:
    return step / max(summary.steps_per_epoch, 1)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _write(path: Path, data: Mapping[str, object]) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
