"""The checkpoint directory on disk: names, the ``latest`` tracker, info files, keep-last-K.

Pure Python (no torch): ``hpc-mca resume`` and ``hpc-mca status`` read this on a login node.

Layout of a run directory::

    <run_dir>/checkpoints/
        latest                  tracker: the name of the newest COMPLETE checkpoint, one line
        iter_0000100/           one checkpoint (megatron dist_checkpointing, torch_dist)
            checkpoint.json     what it holds: step, samples, layout, model, optimizer (below)
            .metadata  __*.distcp  metadata.json
        iter_0000200.tmp/       a save in progress (or one that died); never read
    <run_dir>/finished          written once the run completed; the job never requeues after

A save writes into ``iter_N.tmp``; only after every rank reported success does rank 0 rename
it to ``iter_N`` and then replace ``latest`` atomically (write a temp file, fsync, rename,
fsync the directory). A crash at any point leaves ``latest`` naming the previous complete
checkpoint, so a partial save is never loaded (:mod:`.commit`, for both checkpoint formats).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from hpc_mca.rundir import FINISHED_FILE, fsync_dir, write_atomic

CHECKPOINTS_DIR = "checkpoints"
TRACKER_FILE = "latest"
INFO_FILE = "checkpoint.json"
FORMAT = "hpc-mca/torch_dist/1"
"""Written into every checkpoint.json of the Megatron-Core backend (dist_checkpointing files);
a reader refuses formats it does not know."""
HF_FORMAT = "hpc-mca/hf/1"
"""The standard backend's checkpoints (transformers Trainer files: hpc_mca.standard)."""
FORMATS = (FORMAT, HF_FORMAT)
_ITER_RE = re.compile(r"iter_(\d{7,})")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found, read or used; the message is one line."""


def checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def step_of(name: str) -> int | None:
    match = _ITER_RE.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclass
class CheckpointInfo:
    """``checkpoint.json``: enough to decide, before loading anything, whether a run can
    continue from this checkpoint (see :mod:`hpc_mca.checkpoint.compat`)."""

    step: int
    consumed_samples: int
    skipped_iters: int = 0
    layout: dict[str, Any] = field(default_factory=dict)
    """tp, pp, vp, cp, ep, etp, dp, world_size of the job that saved it."""
    model: dict[str, Any] = field(default_factory=dict)
    """The model's shape (ModelShape fields without the name)."""
    training: dict[str, Any] = field(default_factory=dict)
    """What the data position and the optimizer state depend on: global_batch_size, seed,
    seq_length, optim, precision, use_distributed_optimizer, optimizer_format, finetuning_type,
    max_steps."""
    format: str = FORMAT
    saved_at: float = 0.0
    job_id: str | None = None
    restart_count: int = 0
    reason: str = ""
    """interval, end, signal or requested."""
    megatron_core: str = ""

    @classmethod
    def of_save(cls, counters: Mapping[str, int], records: Mapping[str, dict[str, Any]], *, reason: str,
                job_id: str | None, restart_count: int, format: str = FORMAT,
                megatron_core: str = "") -> CheckpointInfo:
        """checkpoint.json of a save made now: the run's counters as they are saved
        (:meth:`hpc_mca.loop.counters.RunCounters.state_dict`) and what a resume compares
        (:func:`hpc_mca.checkpoint.compat.records`: model, layout, training)."""
        return cls(step=counters["global_step"], consumed_samples=counters["consumed_samples"],
                   skipped_iters=counters["skipped_iters"], layout=records["layout"],
                   model=records["model"], training=records["training"], format=format,
                   saved_at=time.time(), job_id=job_id, restart_count=restart_count, reason=reason,
                   megatron_core=megatron_core)

    @property
    def counters(self) -> dict[str, int]:
        """The run's counters this checkpoint saved, by their names in the run
        (:meth:`hpc_mca.loop.counters.RunCounters.load_state_dict` takes them back)."""
        return {"global_step": self.step, "consumed_samples": self.consumed_samples,
                "skipped_iters": self.skipped_iters}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckpointInfo:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


class ResumePoint(NamedTuple):
    """A checkpoint a run resumes from: its directory and its ``checkpoint.json``."""

    path: Path
    info: CheckpointInfo


def read_tracker(root: Path) -> str | None:
    """The checkpoint name ``latest`` points at, or None when there is none yet."""
    try:
        name = (root / TRACKER_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    if step_of(name) is None:
        raise CheckpointError(f"{root / TRACKER_FILE}: {name!r} is not a checkpoint name "
                              "(iter_NNNNNNN)")
    return name


def write_tracker(root: Path, name: str) -> None:
    write_atomic(root / TRACKER_FILE, name + "\n", durable=True)


def read_info(ckpt_dir: Path) -> CheckpointInfo:
    try:
        data = json.loads((ckpt_dir / INFO_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir} is not a complete hpc-mca checkpoint (no {INFO_FILE})"
                              ) from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{ckpt_dir / INFO_FILE}: unreadable ({err})") from None
    info = CheckpointInfo.from_dict(data)
    if info.format not in FORMATS:
        raise CheckpointError(f"{ckpt_dir}: checkpoint format {info.format!r} is not known to "
                              f"this hpc-mca; valid: {', '.join(map(repr, FORMATS))}")
    return info


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of a run (what the tracker names), or None."""
    root = checkpoints_dir(run_dir)
    name = read_tracker(root)
    if name is None:
        return None
    path = root / name
    if not (path / INFO_FILE).is_file():
        raise CheckpointError(f"{root / TRACKER_FILE} names {name}, which is missing or "
                              f"incomplete")
    return path


def resolve_checkpoint(spec: str | os.PathLike[str]) -> Path:
    """A checkpoint given as its directory, a ``checkpoints`` directory or a run directory."""
    path = Path(spec)
    if (path / INFO_FILE).is_file():
        return path
    for root in (path, checkpoints_dir(path)):
        if (root / TRACKER_FILE).is_file():
            name = read_tracker(root)
            if name is not None and (root / name / INFO_FILE).is_file():
                return root / name
    raise CheckpointError(f"no checkpoint at {str(path)!r}; valid: a checkpoint directory "
                          f"(iter_NNNNNNN), its {CHECKPOINTS_DIR}/ directory or a run directory")


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every complete checkpoint under ``root``, oldest first."""
    found = []
    for child in root.glob("iter_*"):
        step = step_of(child.name)
        if step is not None and (child / INFO_FILE).is_file():
            found.append((step, child))
    return sorted(found)


def prune(root: Path, keep: int | None) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints and any stale ``.tmp`` save
    (rank 0, after a commit); the one ``latest`` names is always kept. Returns what went."""
    latest = read_tracker(root)
    removed = [child for child in root.glob("iter_*.tmp") if child.is_dir()]
    if keep is not None:
        complete = complete_checkpoints(root)
        removed += [path for _, path in complete[:max(0, len(complete) - keep)]
                    if path.name != latest]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def export_targets(run_dir: Path, hf_dir: str | None, merged_dir: str | None) -> list[tuple[Path, bool]]:
    """Where a finished run exports its model, and whether each export has the LoRA adapters
    merged: ``training.export_hf_dir`` and ``export_merged_dir`` (relative to the run
    directory unless absolute), those that are set."""
    return [(Path(target) if Path(target).is_absolute() else run_dir / target, merged)
            for target, merged in ((hf_dir, False), (merged_dir, True)) if target]


def mark_finished(run_dir: Path, step: int, steps_per_epoch: int | None = None) -> None:
    """Write the ``finished`` marker: the run completed at ``step`` (its max_steps). A later
    job may extend the run (a larger max_steps); :func:`clear_finished` then removes it."""
    record: dict[str, Any] = {"step": step, "time": time.time()}
    if steps_per_epoch is not None:
        record["steps_per_epoch"] = steps_per_epoch  # so a login node can size an extension
    write_atomic(run_dir / FINISHED_FILE, json.dumps(record) + "\n", durable=True)


def read_finished(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``finished`` marker (``step``, ``time``, maybe ``steps_per_epoch``), or None while
    the run has not finished."""
    try:
        record = json.loads((Path(run_dir) / FINISHED_FILE).read_text())
        record["step"] = int(record["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if isinstance(record, dict) else None


def finished_step(run_dir: str | os.PathLike[str]) -> int | None:
    """The step at which the run finished, or None while it has not."""
    record = read_finished(run_dir)
    return None if record is None else record["step"]


def reopen_finished(run_dir: str | os.PathLike[str], step: int, max_steps: int) -> str | None:
    """Before training from ``step`` to ``max_steps`` (rank 0): a run directory whose run had
    finished goes on (an extension to a larger max_steps, or a fresh start), so its
    ``finished`` marker goes, and the batch script requeues the run again when it is stopped
    early. The line that says so, or None when the run had not finished."""
    done = finished_step(run_dir)
    if done is None:
        return None
    clear_finished(run_dir)
    if step:
        return f"extending the run that finished at step {done} to {max_steps} steps"
    return f"starting afresh in a run directory whose run finished at step {done}"


def clear_finished(run_dir: str | os.PathLike[str]) -> None:
    """The run is going on (extended, or started afresh): remove its ``finished`` marker, so
    the batch script requeues it again when it is stopped early."""
    path = Path(run_dir) / FINISHED_FILE
    path.unlink(missing_ok=True)
    fsync_dir(path.parent)
