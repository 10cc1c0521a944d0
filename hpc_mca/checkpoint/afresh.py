"""``training.overwrite_output_dir``: start a run afresh in a directory that holds an older one.

The older run is never deleted: global rank 0 renames the directory to a sibling
``<output_dir>.previous-<UTC time>`` before the process group comes up, and the new run
starts from step 1 (nothing is resumed).

Only the first start of a run may do that. A Slurm requeue runs the very same command again,
``hpc-mca resume`` runs the same config in a continuation job, and both must find the
checkpoints where they were. A launch is taken as a later start of the run already in the
directory when any of these holds (:func:`continued_by`):

* ``SLURM_RESTART_COUNT`` is above 0 (Slurm requeued this job), or torchrun's
  ``TORCHELASTIC_RESTART_COUNT`` (its agent restarted the ranks);
* this job id wrote the directory's progress.json or its latest checkpoint (a restart whose
  counter Slurm did not pass on);
* the directory's manifest.json lists this job id (a continuation job, or the job submitted
  for it: ``hpc-mca submit`` gives every job a fresh run directory).

Every rank decides alike from these files before rank 0 renames anything; a rank that looks
after the rename finds no run there, which leads to the same fresh start.

Pure Python (no torch).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from hpc_mca.rundir import FINISHED_FILE, MANIFEST_FILE, PROGRESS_FILE, STEPS_FILE

from .store import INFO_FILE, checkpoints_dir, read_tracker

__all__ = ["continued_by", "holds_run", "move_aside", "start_afresh"]

PREVIOUS = ".previous-"
"""What the renamed directory's name adds to the output_dir's name, before the UTC time."""


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run's results: checkpoints, progress or step records, or
    the finished marker (a resolved config alone, or a manifest, is no run yet)."""
    run_dir = Path(run_dir)
    ckpts = checkpoints_dir(run_dir)
    if ckpts.is_dir() and any(ckpts.iterdir()):
        return True
    return any((run_dir / name).exists() for name in (PROGRESS_FILE, STEPS_FILE, FINISHED_FILE))


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _writers(run_dir: Path) -> set[str]:
    """Job ids that wrote to ``run_dir``'s run: progress.json's and the latest checkpoint's."""
    found = {_json(run_dir / PROGRESS_FILE).get("job_id")}
    ckpts = checkpoints_dir(run_dir)
    name = read_tracker(ckpts)
    if name is not None:
        found.add(_json(ckpts / name / INFO_FILE).get("job_id"))
    return {str(job) for job in found if job not in (None, "")}


def continued_by(run_dir: Path, job_id: str | None, restart_count: int) -> str | None:
    """Why this launch is a later start of the run in ``run_dir`` (one phrase), or None when
    it is the first start of a run of its own."""
    if restart_count > 0:
        return f"restart {restart_count} of job {job_id or '(no Slurm job)'}"
    if not job_id:
        return None  # a launch outside Slurm: every launch is a start of its own
    if job_id in _writers(run_dir):
        return f"job {job_id} wrote it"
    if job_id in [str(j) for j in _json(run_dir / MANIFEST_FILE).get("job_ids") or []]:
        return f"job {job_id} is one of the run's jobs (manifest.json)"
    return None


def previous_name(run_dir: Path, now: datetime.datetime) -> Path:
    """A free sibling name for the older run: ``<name>.previous-<UTC time>[-N]``."""
    run_dir = Path(run_dir)
    stamp = now.astimezone(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = run_dir.with_name(f"{run_dir.name}{PREVIOUS}{stamp}")
    count = 1
    while target.exists():
        target = run_dir.with_name(f"{run_dir.name}{PREVIOUS}{stamp}-{count}")
        count += 1
    return target


def move_aside(run_dir: Path, now: datetime.datetime | None = None) -> Path:
    """Rename ``run_dir`` to :func:`previous_name` (same file system: one rename, nothing
    copied or deleted) and return the new path."""
    target = previous_name(run_dir, now or datetime.datetime.now(datetime.timezone.utc))
    os.rename(run_dir, target)
    return target


def start_afresh(run_dir: Path, *, job_id: str | None, restart_count: int,
                 is_main: bool) -> Path | None:
    """``overwrite_output_dir`` on one rank: when ``run_dir`` holds a run and this launch is
    not a later start of it, global rank 0 moves it aside and gets its new path, the other
    ranks get ``run_dir``; None on every rank when there is nothing to move or the run in it
    continues."""
    run_dir = Path(run_dir)
    if not holds_run(run_dir) or continued_by(run_dir, job_id, restart_count) is not None:
        return None
    return move_aside(run_dir) if is_main else run_dir
