"""``hpc-mca plot``: a run's training curves as one PNG.

Sources, both written by rank 0 (see :mod:`hpc_mca.loop.metrics`):

* ``steps.jsonl``: one object per optimizer step -- loss, lr, grad_norm, tokens (sft/pt) or
  pairs (dpo), input_tokens, seconds, and per objective ``mtp_loss_N`` or ``rewards/*`` and
  ``logps/*``. A requeued run writes the steps after its last checkpoint again: the later
  record of a step wins, as it is the one the surviving run took.
* TensorBoard event files under ``<run dir>/tensorboard``: the evaluation history
  (``eval/loss``, ``eval/accuracy``, ``eval/mtp_loss_N``, ``eval/rewards/...``), which
  progress.json holds only the latest of.

Panels appear only for metrics the run has. matplotlib runs on its Agg backend (no display
on a login node).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_mca.rundir import STEPS_FILE, TENSORBOARD_DIR, read_step_records

from .errors import OpsError
from .progress import read_progress

if TYPE_CHECKING:
    from matplotlib.axes import Axes  # imported lazily at run time (a slow import)

Series = dict[int, float]
"""step -> value"""


@dataclass
class Curves:
    """What a run logged, per metric name (``loss``, ``eval/loss``, ``rewards/chosen``...)."""

    steps: dict[str, Series] = field(default_factory=dict)
    evals: dict[str, Series] = field(default_factory=dict)

    def add(self, target: dict[str, Series], name: str, step: int, value: object) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            target.setdefault(name, {})[step] = float(value)


def read_steps(run_dir: Path, curves: Curves) -> int:
    """Fill ``curves.steps`` from steps.jsonl; returns the steps read (a torn last line, the
    trainer appending, is skipped; a step written again by a requeued job counts once)."""
    path = run_dir / STEPS_FILE
    if not path.is_file():
        raise OpsError(f"run directory {str(run_dir)!r} has no {STEPS_FILE}; valid: the run "
                       "directory (or job id) of a run that has trained at least one step")
    records = read_step_records(path)
    for step, record in records.items():
        for name, value in record.items():
            curves.add(curves.steps, name, step, value)
        seconds, inputs = record.get("seconds"), record.get("input_tokens")
        if isinstance(seconds, (int, float)) and seconds > 0 and isinstance(inputs, (int, float)):
            curves.add(curves.steps, "input_tokens_per_s", step, inputs / seconds)
    return len(records)


def read_events(run_dir: Path, curves: Curves) -> None:
    """Fill ``curves.evals`` with the ``eval/*`` scalars of every event file of the run."""
    root = run_dir / TENSORBOARD_DIR
    folders = sorted({p.parent for p in root.rglob("events.out.tfevents*")}) if root.is_dir() else []
    if not folders:
        return
    # Imported here: only plot needs it, and it takes ~0.4 s.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for folder in folders:  # one per run directory name; requeued jobs append files to it
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags().get("scalars", []):
            if tag.startswith("eval/"):
                for event in events.Scalars(tag):
                    curves.add(curves.evals, tag, event.step, event.value)


def read_curves(run_dir: Path) -> Curves:
    curves = Curves()
    read_steps(run_dir, curves)
    read_events(run_dir, curves)
    progress = read_progress(run_dir)
    # Without event files (tensorboard off), the latest eval from progress.json is one point.
    if "eval/loss" not in curves.evals and progress and progress.eval_loss is not None \
            and progress.step is not None:
        curves.add(curves.evals, "eval/loss", progress.step, progress.eval_loss)
    return curves


@dataclass(frozen=True)
class Panel:
    title: str
    lines: list[tuple[str, Series, bool]]
    """(label, series, is_eval): evaluation series are drawn with markers."""
    log_y: bool = False


def _matching(series: dict[str, Series], prefix: str) -> list[tuple[str, Series]]:
    return sorted((name, s) for name, s in series.items() if name.startswith(prefix))


def panels(curves: Curves) -> list[Panel]:
    """The panels the run has data for, in a fixed order."""
    steps, evals = curves.steps, curves.evals
    out = [Panel("loss", [("train loss", steps.get("loss", {}), False),
                          ("eval loss", evals.get("eval/loss", {}), True)])]
    accuracy = [(name.removeprefix("eval/"), s, True) for name, s in evals.items()
                if name.endswith("accuracy") or name.endswith("accuracies")]
    accuracy += [("train " + name, s, False) for name, s in _matching(steps, "rewards/accuracies")]
    out.append(Panel("accuracy", accuracy))
    out.append(Panel("learning rate", [("lr", steps.get("lr", {}), False)]))
    rate = steps.get("input_tokens_per_s", {})
    out.append(Panel("throughput (input tokens/s)", [("tokens/s", rate, False)]))
    out.append(Panel("grad norm", [("grad_norm", steps.get("grad_norm", {}), False)], log_y=True))
    out.append(Panel("MTP losses", [(f"train {n}", s, False) for n, s in _matching(steps, "mtp_loss_")]
                     + [(n.removeprefix("eval/"), s, True)
                        for n, s in _matching(evals, "eval/mtp_loss_")]))
    out.append(Panel("DPO rewards", [(n, s, False) for n, s in _matching(steps, "rewards/")
                                     if not n.endswith("accuracies")]))
    out.append(Panel("DPO log-probs", [(n, s, False) for n, s in _matching(steps, "logps/")]))
    return [p for p in out if any(series for _, series, _ in p.lines)]


def _draw(axis: Axes, panel: Panel) -> None:
    for label, series, is_eval in panel.lines:
        if not series:
            continue
        xs = sorted(series)
        axis.plot(xs, [series[x] for x in xs], label=label,
                  marker="o" if is_eval else None, markersize=4,
                  linewidth=1.2 if not is_eval else 1.0)
    if panel.log_y and all(v > 0 for _, s, _ in panel.lines for v in s.values()):
        axis.set_yscale("log")
    axis.set_title(panel.title)
    axis.set_xlabel("step")
    axis.grid(alpha=0.3)
    if sum(bool(s) for _, s, _ in panel.lines) > 1:
        axis.legend(fontsize="small")


def plot_run(run_dir: Path, output: Path, title: str | None = None,
             dpi: int = 100) -> list[str]:
    """Write the run's curves to ``output`` (PNG); returns the panel titles drawn."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a login node; must precede pyplot
    import matplotlib.pyplot as plt

    shown = panels(read_curves(run_dir))
    columns = 2
    rows = max(1, math.ceil(len(shown) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.4 * rows), squeeze=False)
    flat: Iterable[Axes] = axes.ravel()
    for axis, panel in zip(flat, shown + [None] * (rows * columns - len(shown))):
        if panel is None:
            axis.set_visible(False)
        else:
            _draw(axis, panel)
    fig.suptitle(title or run_dir.name)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=dpi, format="png")
    plt.close(fig)
    return [p.title for p in shown]
