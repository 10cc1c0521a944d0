"""The run directory's files that decide a job's fate, and the exit codes around them.

A run directory (``<runs root>/<job name>_<job id>``, the trainer's ``output_dir``) is shared
by the login node (``hpc-mca submit/status/resume/cancel``), the batch script and the ranks.
The names below are the contract between them and :func:`write_atomic` is how every JSON or
text file of it is written; the batch script (rendered by :mod:`hpc_mca.slurm.script`) spells
the same names in bash, and a test keeps the two equal.
The requeue protocol that reads them is described in :mod:`hpc_mca.checkpoint.requeue`.

Pure Python, no torch: the login-node commands import it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

EXIT_BAD_INPUT = 2
"""A rank's exit status for input that cannot work (config, data, layout, model files, a
checkpoint that does not fit the disk): retrying cannot help, the job is never requeued."""
EXIT_STOPPED = 75
"""The batch script's exit status when the ranks stopped early (a signal) and the job is not
coming back (no requeue budget left, or only a TERM asked them to stop)."""

RUN_DIR_ENV = "HPC_MCA_RUN_DIR"
"""Exported by the batch script: the run directory of this job."""
PLAN_OVERRIDES_ENV = "HPC_MCA_PLAN_OVERRIDES"
"""A job of a Python script: the planned layout as ``key=value`` pairs, exported by its batch
script; the script's ``TrainingArguments`` apply them to the fields it leaves at their defaults."""

SIGNAL_FILE = "signal_received"
"""Batch shell: one line per USR1/TERM it received (removed at each start)."""
CANCEL_FILE = "cancel_requested"
"""``hpc-mca cancel``: one ``job=<id> time=<t> user=<u>`` line per cancel asked for."""
BAD_INPUT_FILE = "bad_input"
"""A rank that stops on bad input: the one-line reason, then ``job=<id> restart=<n>
rank=<r> time=<t>`` (removed by the batch shell at each start, by rank 0 when a run gets
going)."""
FINISHED_FILE = "finished"
"""Rank 0, after the last step's checkpoint: the run completed (see hpc_mca.checkpoint.store)."""
TENSORBOARD_DIR = "tensorboard"
PROGRESS_FILE = "progress.json"
"""Rank 0: step, loss, throughput, last checkpoint (format: hpc_mca.slurm.progress)."""
STEPS_FILE = "steps.jsonl"
"""Rank 0: one JSON line per optimizer step."""
EVALS_FILE = "evals.jsonl"
"""Rank 0: one JSON line per evaluation (``step`` and the ``eval_*`` metrics)."""
MANIFEST_FILE = "manifest.json"
"""``hpc-mca submit``/``resume``: how the run was submitted (hpc_mca.slurm.manifest)."""
RESOLVED_CONFIG_FILE = "resolved_config.yaml"
"""Rank 0: the run config as the ranks resolved it."""
HEARTBEAT_DIR = "heartbeat"
"""Under a batch script, one ``node-<node>.<id>.json`` per node holding its ranks' beats (each
rank's last finished step, what it is doing, its node), rewritten every few seconds by one
rank's thread (or, where a node has no local directory, ``rank-<5 digits>.json`` per rank);
read by the batch node's hang watchdog (hpc_mca.runtime.heartbeat, hpc_mca.runtime.node_beats,
hpc_mca.slurm.watchdog). Removed at each start."""
HEARTBEAT_ENV = "HPC_MCA_HEARTBEAT_DIR"
"""Exported by the batch script when its watchdog runs: where the ranks write heartbeats."""
HANGS_FILE = "hangs.jsonl"
"""The watchdog: one JSON line per hang it stopped (when, how long, the ranks and nodes it
named, what was excluded)."""
EXCLUDED_FILE = "excluded_nodes.json"
"""The nodes this run excluded from its next starts (hang or failed preflight), with why
(hpc_mca.slurm.exclusion); ``status`` shows them."""
RANKS_ENDED_FILE = "ranks_ended"
"""The batch shell, once srun has returned: its hang watchdog stops. The shell also TERMs the
watchdog, but on a loaded node ranks that end at once can beat the watchdog's own start, and
a watchdog with no rank ever beating would watch forever. Removed at each start."""
REQUEUE_VERDICT_FILE = "requeue_verdict"
"""The watchdog or the preflight, for the batch shell: ``why=``, ``exclude=`` (the job's whole
ExcNodeList to set once it is requeued) and ``end=`` (set when the job must not come back)
lines. Removed at each start."""
PREFLIGHT_DIR = "preflight"
"""The preflight (``HPC_MCA_PREFLIGHT=1``): ``<node>.json`` per node, its checks and their
times (hpc_mca.runtime.node_check), read by the verdict on the batch node
(hpc_mca.slurm.preflight). Removed at each start."""
PREFLIGHT_ENDED_FILE = "step_ended"
"""In PREFLIGHT_DIR: the batch shell, once the preflight's srun returned: the verdict stops
waiting for reports that can no longer come."""
REQUEUES_FILE = "requeues"
"""The batch shell: one ``time=<t> job=<id> restart=<n> why=<one line>`` line per requeue it
made or saw Slurm make (kept across starts); ``status`` and ``watch`` say why a pending job
went back to the queue."""
JOB_NODES_ENV = "HPC_MCA_JOB_NODES"
"""Exported by the batch script (train, run): the job's nodes, expanded, comma-separated, in
Slurm's order (``SLURM_NODEID`` indexes it)."""


def write_atomic(path: Path, text: str, *, durable: bool = False) -> Path:
    """Write ``text`` to ``path`` so that a reader sees the old or the new content, never a
    part of it (a temp file in the same directory, then a rename). ``durable`` also fsyncs the
    file and the directory, for what must survive a crash (checkpoint records, the tracker).
    Concurrent writers each leave a whole file (the temp name carries the pid)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(text)
        if durable:
            out.flush()
            os.fsync(out.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)
    return path


def fsync_dir(path: Path) -> None:
    """Make a rename/creation in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def tensorboard_dir(run_dir: Path) -> Path:
    """Where rank 0 writes TensorBoard event files: ``<run dir>/tensorboard/<run dir name>``,
    so that TensorBoard, pointed at ``<run dir>/tensorboard``, names the run after its job
    (``sft_addition_19``) rather than "tensorboard"."""
    return Path(run_dir) / TENSORBOARD_DIR / Path(run_dir).name


def run_dir_from_env() -> Path | None:
    """This job's run directory, as the batch script exported it (None outside one)."""
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None


def record_bad_input(message: str, run_dir: Path | None = None) -> Path | None:
    """Leave the reason this rank stops on bad input where the batch script looks before it
    decides on a requeue (srun may kill the other ranks, turning the job's exit code into 143
    or 1; this record still says "bad input"). Returns the file, or None when there is no
    run directory (no batch script to tell) or it cannot be written."""
    run_dir = run_dir or run_dir_from_env()
    if run_dir is None:
        return None
    reason = " ".join(message.split()) or "bad input"
    env = os.environ
    rank = env.get("RANK", env.get("SLURM_PROCID", "0"))
    detail = (f"job={env.get('SLURM_JOB_ID', '')} restart={env.get('SLURM_RESTART_COUNT', '0')} "
              f"rank={rank} time={time.time():.3f}")
    try:  # ranks failing together each leave a whole record
        return write_atomic(run_dir / BAD_INPUT_FILE, f"{reason}\n{detail}\n")
    except OSError:
        return None


def read_bad_input(run_dir: Path) -> str | None:
    """The bad-input reason recorded in ``run_dir``, or None."""
    try:
        lines = (Path(run_dir) / BAD_INPUT_FILE).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    return lines[0] if lines and lines[0].strip() else None


def clear_bad_input(run_dir: Path) -> None:
    """The run is going (its inputs worked this time): forget an older bad-input record."""
    (Path(run_dir) / BAD_INPUT_FILE).unlink(missing_ok=True)


def read_step_records(path: Path) -> dict[int, dict[str, object]]:
    """step -> record of a JSON-lines file of rank 0's (steps.jsonl, evals.jsonl): the later
    record of a step wins (a requeued job writes the steps after its checkpoint again); a torn
    last line (the trainer is appending) and foreign lines are skipped."""
    records: dict[int, dict[str, object]] = {}
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(record, dict):
            records[step] = record
    return records
