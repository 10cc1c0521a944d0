"""The commit protocol both checkpoint formats share (Megatron's torch_dist files and the
standard backend's transformers files): how a finished ``iter_N.tmp`` becomes ``iter_N``.

Every rank has written its files into ``iter_N.tmp`` and the caller has proved that all of
them did (a collective) before rank 0 calls :func:`publish`: it writes ``checkpoint.json``
durably, renames the directory, fsyncs the parent, moves the ``latest`` tracker (atomic and
durable, :mod:`.store`) and prunes to the newest ``keep``. A crash at any point leaves
``latest`` naming the previous complete checkpoint, so a half-written save is never resumed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hpc_mca.rundir import fsync_dir, write_atomic

from .store import INFO_FILE, CheckpointInfo, prune, read_tracker, write_tracker

__all__ = ["publish", "tmp_dir"]


def tmp_dir(root: Path, name: str) -> Path:
    """Where the save of checkpoint ``name`` is written before it is published."""
    return root / f"{name}.tmp"


def publish(root: Path, name: str, info: CheckpointInfo, keep: int | None, *,
            fsync_files: bool = False) -> bool:
    """Publish ``root/name.tmp`` as ``root/name`` (rank 0 only, after every rank's files are
    in place). ``fsync_files``: flush the directory's files first, for writers that do not
    (transformers' ``save_pretrained`` and ``torch.save``; Megatron's writer fsyncs its own).
    False when a complete copy of this checkpoint is already the one ``latest`` names (nothing
    was published: the copy in ``.tmp`` is dropped)."""
    tmp, final = tmp_dir(root, name), root / name
    if fsync_files:
        for path in tmp.iterdir():
            if path.is_file():
                with path.open("rb") as handle:
                    os.fsync(handle.fileno())
    write_atomic(tmp / INFO_FILE, info.to_json(), durable=True)
    if final.exists():
        # A complete copy of this step from an earlier, interrupted run. The tracker names it
        # only when that run got as far as publishing it; otherwise it is replaced.
        if read_tracker(root) == name:
            shutil.rmtree(tmp)
            return False
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    write_tracker(root, name)
    prune(root, keep)
    return True
