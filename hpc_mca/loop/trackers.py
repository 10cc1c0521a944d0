"""Experiment trackers: where a run's scalars go besides steps.jsonl and progress.json.

``training.report_to`` names any of ``tensorboard``, ``wandb`` and ``mlflow`` (or ``none``).
Every tracker gets the same scalar names (``train/loss``, ``eval/accuracy``, ``perf/tokens_per_s``,
...) at the same optimizer steps; only global rank 0 opens them. W&B and MLflow are optional
extras (``pip install 'hpc-mca[trackers]'``); asking for one that is not installed is refused
when the config is checked, before anything is allocated.

A requeued job continues the same tracker run, so one training run is one curve:

* **TensorBoard** appends to ``<run_dir>/tensorboard``.
* **W&B** gets a run id derived from the run directory's absolute path, with
  ``resume="allow"``. Its step axis is ``train/global_step``, logged with every call, so that
  the steps a resumed job repeats after its checkpoint do not hit W&B's rule that ``step``
  only grows. The mode (online, offline) is W&B's own setting (``WANDB_MODE``); the project is
  ``WANDB_PROJECT`` or ``hpc-mca``. Files go under ``<run_dir>/wandb``.
* **MLflow** logs to ``MLFLOW_TRACKING_URI`` or, when unset, the file store
  ``<run_dir>/mlruns`` (allowed with ``MLFLOW_ALLOW_FILE_STORE``, which MLflow 3 requires);
  the experiment is ``MLFLOW_EXPERIMENT_NAME`` or ``hpc-mca``. The run id is kept in
  ``<run_dir>/mlflow_run_id`` and reopened by later jobs.

W&B and MLflow runs carry the resolved config (flattened dotted keys) and the Slurm job id and
restart count, so a curve can be traced to the job that drew it.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import yaml

from hpc_mca.config.sections import TRACKER_PACKAGES
from hpc_mca.rundir import tensorboard_dir, write_atomic

if TYPE_CHECKING:
    from hpc_mca.runtime.env import RankEnv

__all__ = ["Tracker", "job_fields", "open_trackers", "skip_unused_tracker_imports"]

MLFLOW_RUN_FILE = "mlflow_run_id"


class Tracker(Protocol):
    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def open_trackers(report_to: list[str], resolved_yaml: str, run_dir: Path,
                  job: dict[str, Any]) -> list[Tracker]:
    """The trackers ``training.report_to`` asks for (call on global rank 0 only).
    ``resolved_yaml``: the resolved config (``TrainConfig.to_yaml``), which W&B and MLflow runs
    carry; ``job``: the Slurm job id and restart count, attached to them too."""
    opened: list[Tracker] = []
    for name in report_to:
        if name == "tensorboard":
            opened.append(_TensorBoard(run_dir))
        elif name == "wandb":
            opened.append(_Wandb(run_dir, _flat_config(resolved_yaml), job))
        elif name == "mlflow":
            opened.append(_Mlflow(run_dir, _flat_config(resolved_yaml), job))
    return opened


def skip_unused_tracker_imports(report_to: list[str]) -> list[str]:
    """Make W&B and MLflow unimportable in this process unless ``report_to`` names them;
    returns the packages it turned off. Call before megatron is imported.

    Why: ``megatron.core`` imports ``megatron.core.timers``, which tries ``import wandb`` at
    import time whether or not anything logs to it. With W&B installed (the ``trackers``
    extra) that is 0.5-1 s of CPU in every rank process of every job, for nothing. A
    ``None`` entry in ``sys.modules`` makes ``import wandb`` raise ImportError (Megatron then
    takes its no-W&B path) and ``importlib.util.find_spec`` answer None (transformers then
    sees no W&B either). A package already imported is left alone."""
    turned_off = []
    for name, package in TRACKER_PACKAGES.items():
        # TensorBoard stays: torch.utils.tensorboard is what Megatron's timers import anyway.
        if name != "tensorboard" and name not in report_to and package not in sys.modules:
            sys.modules[package] = None  # type: ignore[assignment]
            turned_off.append(package)
    return turned_off


def job_fields(env: RankEnv) -> dict[str, Any]:
    """What a tracker run records of the job (a RankEnv): Slurm job id and restart count."""
    return {"id": env.job_id, "restart_count": env.restart_count, "world_size": env.world_size}


def _finite(values: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}


def _flat_config(resolved_yaml: str) -> dict[str, Any]:
    """The resolved config as ``section.field`` -> value."""
    data = yaml.safe_load(resolved_yaml)
    return {f"{section}.{key}": value for section, fields in data.items()
            if isinstance(fields, dict) for key, value in fields.items()}


def _run_key(run_dir: Path) -> str:
    """A stable id for the run directory (the same for every job that continues it)."""
    path = str(Path(run_dir).resolve())
    return f"{Path(path).name[:40]}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"


class _TensorBoard:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(tensorboard_dir(run_dir)))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in _finite(values).items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, config: dict[str, Any], job: dict[str, Any]) -> None:
        import wandb

        # console="off": W&B would otherwise wrap stdout/stderr, which the batch script's log
        # and the progress line own.
        settings = wandb.Settings(console="off", silent=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "hpc-mca"),
                              id=_run_key(run_dir), name=Path(run_dir).name, resume="allow",
                              dir=str(run_dir), config={**config, **_job_fields(job)},
                              settings=settings)
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**_finite(values), "train/global_step": step})

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, run_dir: Path, config: dict[str, Any], job: dict[str, Any]) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (Path(run_dir) / "mlruns").resolve().as_uri()
            # MLflow 3 refuses its file store unless asked (it wants a database backend); a
            # directory in the run dir is what works on a cluster without a tracking server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "hpc-mca")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(name))
        id_file = Path(run_dir) / MLFLOW_RUN_FILE
        tags = [RunTag(f"hpc_mca.{k}", str(v)) for k, v in _job_fields(job).items()]
        if id_file.is_file():  # a requeued or resumed job continues the run
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.log_batch(self.run_id, tags=tags)
            return
        run = self.client.create_run(experiment_id, run_name=Path(run_dir).name)
        self.run_id = run.info.run_id
        write_atomic(id_file, self.run_id + "\n")
        # MLflow caps a parameter value at 6000 characters and a batch at 100 parameters.
        params = [Param(k, str(v)[:6000]) for k, v in sorted(config.items())]
        for start in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.client.log_batch(self.run_id, tags=tags)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in _finite(values).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _job_fields(job: dict[str, Any]) -> dict[str, Any]:
    return {f"job.{k}": v for k, v in job.items() if v is not None}
