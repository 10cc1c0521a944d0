"""Where each of a user's jobs keeps its run directory, so ``hpc-mca status/logs/cancel/resume
JOBID`` work from any directory and whatever the runs root.

A per-user index, ``runs.tsv`` in ``$HPC_MCA_STATE_DIR`` (default ``$XDG_STATE_HOME/hpc-mca``,
else ``~/.local/state/hpc-mca``): one ``<job id>\\t<run dir>\\t<unix time>`` line per job,
appended by ``hpc-mca submit`` and ``hpc-mca resume`` when they submit, and by the batch script
when a job first starts (which covers jobs of the raw template). Appends only; the newest line
of a job id wins, and a line whose run directory is gone, or whose manifest names other jobs
(Slurm reuses ids after a cluster is rebuilt), is ignored. Writing it is best effort: a home
directory that cannot be written never fails a submission.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

INDEX_NAME = "runs.tsv"


def state_dir() -> Path:
    """``$HPC_MCA_STATE_DIR``, else ``$XDG_STATE_HOME/hpc-mca``, else ``~/.local/state/hpc-mca``
    (the batch script computes the same default)."""
    if os.environ.get("HPC_MCA_STATE_DIR"):
        return Path(os.environ["HPC_MCA_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "hpc-mca"


def record_job(job_id: str, run_dir: Path) -> None:
    """Append ``job_id`` -> ``run_dir`` (ignored when the index cannot be written, or the path
    cannot be one line of it)."""
    text = str(run_dir.absolute())
    if "\t" in text or "\n" in text:
        return
    try:
        folder = state_dir()
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / INDEX_NAME).open("a", encoding="utf-8") as out:
            out.write(f"{job_id}\t{text}\t{int(time.time())}\n")
    except OSError:
        return


def indexed_run_dir(job_id: str) -> Path | None:
    """The run directory the newest index line gives ``job_id``, or None."""
    try:
        lines = (state_dir() / INDEX_NAME).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in reversed(lines):
        fields = line.split("\t")
        if len(fields) == 3 and fields[0] == job_id and Path(fields[1]).is_dir():
            return Path(fields[1])
    return None
