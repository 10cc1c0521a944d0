"""``hpc-mca submit``: plan, render, submit held, write the run dir, release.

The job is submitted with ``--hold`` so that its run directory (named ``<job name>_<job id>``,
like its log) and manifest exist before it can start; then it is released. If anything fails
between the two, the held job is cancelled: nothing is left queued.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import hpc_mca
from hpc_mca.rundir import PLAN_OVERRIDES_ENV, RUN_DIR_ENV

from . import commands
from .errors import OpsError
from .index import record_job
from .jobplan import JobPlan, check_train_config, plan_summary
from .manifest import MANIFEST_FILE, write_manifest
from .quoting import filename_pattern
from .script import RUN_DIR_PATTERN, SbatchOptions, render_script
from .timelimit import signal_lead

REPO_ROOT = Path(hpc_mca.__file__).resolve().parents[1]
"""The checkout the CLI runs from (its bin/hpc-mca-rank starts the ranks)."""
SCRIPT_FILE = "job.sbatch"


@dataclass(frozen=True, kw_only=True)
class SubmitOptions:
    """Slurm-side options of ``plan --sbatch`` and ``submit``."""

    runs_root: Path
    job_name: str | None = None
    """Default: the config file's stem (e.g. sft_addition)."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = "01:00:00"
    cpus_per_task: int | None = None
    signal_lead_s: int | None = None
    """Seconds before the time limit for the lead-time signal; None: 120 s, scaled to a
    quarter of a short limit (:func:`hpc_mca.slurm.timelimit.signal_lead`)."""
    sbatch_args: tuple[str, ...] = ()
    rank_command: tuple[str, ...] = ("train",)
    """hpc-mca subcommand (and, for anything but train, its arguments) every rank runs."""
    home: Path = REPO_ROOT
    venv: str | None = sys.prefix if sys.prefix != sys.base_prefix else None
    preflight: bool = False
    """Set the knob HPC_MCA_PREFLIGHT=1: every node checks itself before training (train and
    run only; hpc_mca/slurm/preflight.py)."""


@dataclass(frozen=True)
class RenderedJob:
    script: str
    sbatch: SbatchOptions
    knobs: dict[str, str]
    rank_args: tuple[str, ...]
    """Arguments after the rank command (the train config, overrides)."""
    job_name: str
    runs_root: Path

    @property
    def rank_command(self) -> str:
        return self.knobs["HPC_MCA_RANK_CMD"]

    def run_dir(self, job_id: str) -> Path:
        return self.runs_root / f"{self.job_name}_{job_id}"

    def log(self, job_id: str) -> Path:
        return self.run_dir(job_id) / f"{self.job_name}_{job_id}.out"


def render_job(job: JobPlan, options: SubmitOptions) -> RenderedJob:
    """The batch script for ``job`` (pure: no file or Slurm is touched)."""
    if not options.rank_command:
        raise OpsError("rank command is empty; valid: train, or e.g. 'smoke --tp 2'")
    command, *command_args = options.rank_command
    if job.script is not None:
        command, rank_args = _script_rank_args(job.script, job.user_overrides, options)
    elif command == "train":
        if job.config_path is None:
            raise OpsError("the train rank command needs a run CONFIG (hpc-mca plan --sbatch "
                           "CONFIG.yaml ...)")
        rank_args = (str(job.config_path.absolute()), *command_args, *job.train_overrides)
    else:
        rank_args = tuple(command_args)
    source = job.script or job.config_path
    name = options.job_name or (source.stem if source else command)
    runs_root = options.runs_root.expanduser().absolute()
    req = job.plan.request
    gpu = not req.gpu_spec.name.startswith("CPU")
    sbatch = SbatchOptions(
        job_name=name, nodes=req.nodes, ntasks_per_node=req.node_size,
        gpus_per_node=req.node_size if gpu else None, cpus_per_task=options.cpus_per_task,
        time=options.time, partition=options.partition, account=options.account,
        qos=options.qos, signal_lead_s=signal_lead(options.signal_lead_s, options.time),
        output=f"{filename_pattern(str(runs_root), 'runs root')}/{RUN_DIR_PATTERN}/"
               f"{RUN_DIR_PATTERN}.out",
        extra=tuple(options.sbatch_args))
    knobs = {"HPC_MCA_HOME": str(options.home), "HPC_MCA_RANK_CMD": command,
             "HPC_MCA_RUNS_ROOT": str(runs_root)}
    if command == "train":  # its rank arguments carry the plan: the job must not replan
        knobs["HPC_MCA_PLAN"] = "given"
    if job.script is not None:  # the script's TrainingArguments read the plan from here
        knobs[PLAN_OVERRIDES_ENV] = " ".join(job.plan_overrides)
    if options.venv:
        knobs["HPC_MCA_VENV"] = options.venv
    if options.preflight:
        if command not in ("train", "run"):
            raise OpsError(f"--preflight with the rank command {command!r}; valid: train or a "
                           "script (the batch script checks the nodes only before training)")
        knobs["HPC_MCA_PREFLIGHT"] = "1"
    script = render_script(sbatch, knobs, rank_args)
    return RenderedJob(script, sbatch, knobs, rank_args, name, runs_root)


def _script_rank_args(script: Path, args: Sequence[str],
                      options: SubmitOptions) -> tuple[str, tuple[str, ...]]:
    """``run`` and its arguments for a job of a Python script: the script, then its own
    arguments (the plan goes through the environment, not its command line)."""
    if options.rank_command not in (("train",), ("run",)):
        raise OpsError(f"--rank-command {' '.join(options.rank_command)!r} with the script "
                       f"{script.name!r}; valid: leave --rank-command out (a script runs "
                       "with hpc-mca run)")
    return "run", (str(script.absolute()), *args)


@dataclass(frozen=True)
class Submitted:
    job_id: str
    run_dir: Path
    log: Path
    manifest: Path


def checked_job(job: JobPlan, options: SubmitOptions) -> RenderedJob:
    """``job``'s batch script, after its run config passed the checks the ranks would make
    first (:func:`~.jobplan.check_train_config`); ``plan`` and ``submit`` both stop here."""
    rendered = render_job(job, options)
    if rendered.rank_command == "train":
        check_train_config(job, str(rendered.run_dir("0")))
    return rendered


def submit(job: JobPlan, options: SubmitOptions, argv: Sequence[str]) -> Submitted:
    """Submit ``job``; returns where it lives. Raises OpsError with nothing left queued."""
    rendered = checked_job(job, options)
    rendered.runs_root.mkdir(parents=True, exist_ok=True)
    # The run dir and a script's layout are the job's own, never the submitting shell's.
    env = commands.sbatch_env(drop=[*rendered.knobs, RUN_DIR_ENV, PLAN_OVERRIDES_ENV])

    def record(job_id: str) -> None:
        run_dir = rendered.run_dir(job_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / SCRIPT_FILE).write_text(rendered.script)
        write_manifest(run_dir, _manifest(job, rendered, options, job_id, argv))
        record_job(job_id, run_dir)

    job_id = commands.submit_held(rendered.script, env, record)
    run_dir = rendered.run_dir(job_id)
    return Submitted(job_id, run_dir, rendered.log(job_id), run_dir / MANIFEST_FILE)


def _manifest(job: JobPlan, rendered: RenderedJob, options: SubmitOptions, job_id: str,
              argv: Sequence[str]) -> dict:
    run_dir = rendered.run_dir(job_id)
    rank = [rendered.rank_command, *rendered.rank_args]
    if rendered.rank_command == "train":
        rank.append(f"output_dir={run_dir}")
    return {
        "job_id": job_id, "job_name": rendered.job_name, "run_dir": str(run_dir),
        "runs_root": str(rendered.runs_root), "log": str(rendered.log(job_id)),
        "script": str(run_dir / SCRIPT_FILE),
        "config": str(job.config_path.absolute()) if job.config_path else None,
        "train_script": str(job.script.absolute()) if job.script else None,
        "model": job.model,
        "plan_overrides": list(job.plan_overrides),
        "overrides": list(job.user_overrides), "resolved_overrides": job.train_overrides,
        "rank_command": rank, "plan": plan_summary(job.plan),
        "sbatch": asdict(rendered.sbatch), "knobs": rendered.knobs,
        "signal_lead_s_given": options.signal_lead_s,
        "submit_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "submit_host": socket.gethostname(), "user": commands.current_user(), "cwd": os.getcwd(),
        "command": list(argv),
    }
