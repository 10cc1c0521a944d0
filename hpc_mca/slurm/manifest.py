"""The run manifest, and finding a run (its directory and log) from a job id.

``hpc-mca submit`` writes ``<run_dir>/manifest.json`` before the job is released::

    {
      "version": 1,
      "job_id": "123", "job_name": "sft_addition",
      "run_dir": "/abs/runs/sft_addition_123", "runs_root": "/abs/runs",
      "log": "/abs/runs/sft_addition_123/sft_addition_123.out",
      "script": "/abs/runs/sft_addition_123/job.sbatch",
      "config": "/abs/sft_addition.yaml",         # null for a Python script's job, which has
      "train_script": null,                        # "/abs/train.py" (hpc-mca run); its args
                                                   # are "overrides", its layout "plan_overrides"
      "overrides": ["learning_rate=1e-4"],          # as given on the command line
      "resolved_overrides": [...],                  # given + stage + plan, what train gets
      "rank_command": ["train", "/abs/sft_addition.yaml", ..., "output_dir=/abs/runs/..."],
      "plan": {...},                                # layout, batch, memory, reason
      "sbatch": {...},                              # the #SBATCH options
      "submit_time": "2025-01-01T12:00:00+00:00", "submit_host": "login1", "user": "me",
      "cwd": "/home/me", "command": ["hpc-mca", "submit", ...]
    }

A later job continuing the same run (issue 5's ``hpc-mca resume``) appends its id to
``"job_ids"``. :func:`find_run` looks for a manifest naming the job id under the runs root,
and, for jobs submitted with plain ``sbatch sbatch/train.sbatch``, falls back to what Slurm
knows (the job's name and working directory: the template's run dir is
``<WorkDir>/runs/<name>_<id>`` and its log ``<WorkDir>/<name>_<id>.out``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_mca.rundir import MANIFEST_FILE, write_atomic

from . import commands
from .errors import OpsError
from .index import indexed_run_dir

VERSION = 1


def default_runs_root() -> Path:
    """``$HPC_MCA_RUNS_ROOT``, else ``./runs``, as an absolute path."""
    return Path(os.environ.get("HPC_MCA_RUNS_ROOT") or "runs").expanduser().absolute()


def write_manifest(run_dir: Path, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as the run's manifest, atomically; returns its path."""
    return write_atomic(run_dir / MANIFEST_FILE,
                        json.dumps({"version": VERSION, **data}, indent=1) + "\n")


def read_manifest(run_dir: Path) -> dict[str, Any] | None:
    """The manifest of ``run_dir``, or None when absent or unreadable."""
    try:
        data = json.loads((run_dir / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _job_ids(manifest: Mapping[str, Any]) -> list[str]:
    ids = [str(manifest.get("job_id", ""))]
    extra = manifest.get("job_ids")
    if isinstance(extra, list):
        ids += [str(i) for i in extra]
    return ids


def current_job_id(manifest: Mapping[str, Any]) -> str | None:
    """The newest job of a run: its last continuation (``hpc-mca resume``), else its first."""
    ids = [i for i in _job_ids(manifest) if i]
    return ids[-1] if ids else None


@dataclass(frozen=True)
class Run:
    """A run directory and what is known about it."""

    run_dir: Path
    job_id: str | None
    log: Path | None
    manifest: dict[str, Any] | None = field(default=None, compare=False)
    how: str = "manifest"
    """How it was found: manifest, index (the user's job index), slurm (job name + work dir)
    or path (given directly)."""

    @property
    def name(self) -> str:
        return self.run_dir.name


def iter_manifests(runs_root: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """``(run_dir, manifest)`` for every run directly under ``runs_root``."""
    try:
        children = sorted(p for p in runs_root.iterdir() if p.is_dir())
    except OSError:
        return
    for run_dir in children:
        manifest = read_manifest(run_dir)
        if manifest is not None:
            yield run_dir, manifest


def run_from_manifest(run_dir: Path, manifest: dict[str, Any], job_id: str | None = None) -> Run:
    log = manifest.get("log")
    jid = job_id or (str(manifest["job_id"]) if manifest.get("job_id") else None)
    # The newest job's log: the submit manifest names the first one; later jobs of the same
    # run (continuations) log next to it under their own id.
    if jid and isinstance(log, str) and manifest.get("job_id") and str(manifest["job_id"]) != jid:
        log = log.replace(f"_{manifest['job_id']}.out", f"_{jid}.out")
    return Run(run_dir, jid, Path(log) if isinstance(log, str) else None, manifest)


def find_run(job_id: str, runs_root: Path | None = None) -> Run:
    """The run of ``job_id``: by manifest under ``runs_root``, else from Slurm's record."""
    job_id = commands.check_job_id(job_id)
    root = runs_root or default_runs_root()
    # Fast path: the directory is named <job name>_<job id>.
    for run_dir in sorted(root.glob(f"*_{job_id}")):
        manifest = read_manifest(run_dir)
        if manifest is not None and job_id in _job_ids(manifest):
            return run_from_manifest(run_dir, manifest, job_id)
    for run_dir, manifest in iter_manifests(root):
        if job_id in _job_ids(manifest):
            return run_from_manifest(run_dir, manifest, job_id)
    run = _run_from_index(job_id)
    if run is not None:
        return run
    run = _run_from_slurm(job_id, root)
    if run is None:
        raise OpsError(f"no run found for job {job_id}: no manifest under {root} names it and "
                       "Slurm does not know the job; valid: a job id from hpc-mca status, or "
                       "--runs-root pointing at the right runs directory")
    return run


def _run_from_index(job_id: str) -> Run | None:
    """A job submitted from elsewhere (another runs root or directory): the user's index."""
    run_dir = indexed_run_dir(job_id)
    if run_dir is None:
        return None
    manifest = read_manifest(run_dir)
    if manifest is not None:
        # Slurm reuses job ids after a cluster is rebuilt: the manifest must name this one.
        return run_from_manifest(run_dir, manifest, job_id) if job_id in _job_ids(manifest) else None
    return Run(run_dir, job_id, commands.job_log(job_id), None, how="index")


def _run_from_slurm(job_id: str, root: Path) -> Run | None:
    """A job submitted with the raw template: guess its run dir and log from Slurm."""
    state = commands.job_state(job_id)
    info = commands.scontrol_job(job_id)
    if state is None and not info:
        return None
    name = info.get("JobName") or (state.name if state else "")
    work_dir = Path(info.get("WorkDir") or (state.work_dir if state else "") or ".")
    base = f"{name}_{job_id}"
    candidates = [root / base, work_dir / "runs" / base]
    run_dir = next((c for c in candidates if c.is_dir()), candidates[-1])
    log = commands.job_log(job_id) or work_dir / f"{base}.out"
    manifest = read_manifest(run_dir)
    return Run(run_dir, job_id, log, manifest, how="slurm")


def run_from_path(path: Path) -> Run:
    """A run given as its directory."""
    if not path.is_dir():
        raise OpsError(f"run directory {str(path)!r} does not exist; valid: a job id or an "
                       "existing run directory")
    manifest = read_manifest(path)
    if manifest is not None:
        return run_from_manifest(path.absolute(), manifest)
    return Run(path.absolute(), None, None, None, how="path")


def resolve_runs(specs: list[str], runs_root: Path | None = None) -> list[Run]:
    """Runs named by job ids or run directories (``hpc-mca tensorboard`` arguments)."""
    runs = []
    for spec in specs:
        if commands.JOB_ID_RE.fullmatch(spec) and not Path(spec).is_dir():
            runs.append(find_run(spec, runs_root))
        else:
            runs.append(run_from_path(Path(spec).expanduser()))
    return runs
