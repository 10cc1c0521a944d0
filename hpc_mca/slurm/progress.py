"""The progress file: how a running trainer tells ``hpc-mca status`` where it is.

Format -- ``<run_dir>/progress.json``, one JSON object, rewritten atomically (write a temporary
file in the same directory, then rename) by global rank 0 at every logging step (the trainer's
``hpc_mca.loop.metrics.MetricsWriter`` does; :func:`write_progress` is a dependency-free
writer for anything else). Every field is optional; readers ignore unknown ones, so fields can
be added without a version bump::

    {
      "step": 120,                  # optimizer steps done (global step)
      "max_steps": 1000,            # steps the run will take
      "loss": 1.2345,               # training loss of step "step" (null when unknown)
      "lr": 0.0003,                 # its learning rate
      "grad_norm": 0.87,
      "tokens_per_s": 15234.5,      # throughput over the steps up to "step" since the last
                                    # logging step, whole job
      "eta_s": 750.0,               # seconds left at that speed, as of "updated"
      "eval_loss": 1.1,             # last evaluation, when there is one
      "updated": 1732190000.5,      # unix time of this write
      "job_id": "123",              # SLURM_JOB_ID / SLURM_RESTART_COUNT of the writer
      "restart_count": 0,
      "last_checkpoint": {          # newest checkpoint that is durable (tracker advanced)
        "step": 100, "path": "/runs/x_123/checkpoints/iter_0000100", "time": 1732189900.0
      },
      "finished": false,            # true once the last step (and its checkpoint) is done
      "startup_s": 41.5             # the writer's start to its first step's end (last start)
    }

``total_steps`` and ``time`` are read as aliases of ``max_steps`` and ``updated``; without
``eta_s``, a ``step_time_s`` (seconds per step) gives the ETA. :func:`read_progress` is
tolerant: a missing, partial or malformed file gives None, a field of the wrong type reads as
None, and nothing raises.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_mca.rundir import PROGRESS_FILE, write_atomic


@dataclass(frozen=True)
class Checkpoint:
    """The last durable checkpoint named by the progress file."""

    step: int | None
    path: str | None
    time: float | None


@dataclass(frozen=True)
class Progress:
    """What could be read from a progress file (None where a field is missing or malformed)."""

    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    eval_loss: float | None = None
    updated: float | None = None
    job_id: str | None = None
    restart_count: int | None = None
    last_checkpoint: Checkpoint | None = None
    finished: bool = False
    startup_s: float | None = None
    """How long the last start of the run took to its first step's end."""

    @property
    def fraction(self) -> float | None:
        if self.step is None or not self.max_steps:
            return None
        return min(1.0, self.step / self.max_steps)


def write_progress(run_dir: str | os.PathLike[str], **fields: object) -> Path:
    """Write ``fields`` (see the module doc) as the run's progress file, atomically.

    ``updated`` is filled in unless given. Returns the file's path.
    """
    data = {"updated": time.time(), **fields}
    return write_atomic(Path(run_dir) / PROGRESS_FILE,
                        json.dumps(data, indent=1, allow_nan=False) + "\n")


def read_progress(run_dir: str | os.PathLike[str]) -> Progress | None:
    """The run's progress, or None when there is no readable progress file (yet)."""
    try:
        data = json.loads((Path(run_dir) / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, Mapping):
        return None
    step, max_steps = _int(data.get("step")), _int(_first(data, "max_steps", "total_steps"))
    eta = _float(data.get("eta_s"))
    step_time = _float(data.get("step_time_s"))
    if eta is None and None not in (step, max_steps, step_time):
        eta = max(0, max_steps - step) * step_time  # type: ignore[operator]
    finished = data.get("finished") is True
    return Progress(
        step=step, max_steps=max_steps, loss=_float(data.get("loss")),
        lr=_float(data.get("lr")), grad_norm=_float(data.get("grad_norm")),
        tokens_per_s=_float(data.get("tokens_per_s")), eta_s=0.0 if finished else eta,
        eval_loss=_float(data.get("eval_loss")),
        updated=_float(_first(data, "updated", "time")),
        job_id=None if data.get("job_id") is None else str(data.get("job_id")),
        restart_count=_int(data.get("restart_count")),
        last_checkpoint=_checkpoint(data.get("last_checkpoint")),
        finished=finished, startup_s=_float(data.get("startup_s")))


def _first(data: Mapping[str, Any], *names: str) -> Any:
    return next((data[n] for n in names if data.get(n) is not None), None)


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _checkpoint(value: object) -> Checkpoint | None:
    if not isinstance(value, Mapping):
        return None
    path = value.get("path")
    return Checkpoint(step=_int(value.get("step")),
                      path=path if isinstance(path, str) else None,
                      time=_float(value.get("time")))
