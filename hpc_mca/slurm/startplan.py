"""The layout of a raw-template job, planned by its batch script at every start.

``sbatch --nodes N sbatch/train.sbatch CONFIG.yaml [key=value ...]`` carries no plan (only
``hpc-mca submit`` / ``plan --sbatch`` / ``resume`` bake one into the script). So the template
(``HPC_MCA_PLAN=start``, its default) runs ``hpc-mca plan --at-job-start CONFIG [key=value ...]``
in the batch shell before ``srun``: this module sizes the job from the allocation Slurm gave
it, plans it with the planner ``hpc-mca plan`` uses (:func:`~.jobplan.make_job_plan`, same
precedence: the layout keys the config or the overrides set stay as given), records the plan in
``$HPC_MCA_RUN_DIR/job_plan.json`` and prints the trainer overrides for the rank command.

The allocation, from the batch shell's environment:

* nodes: ``SLURM_JOB_NUM_NODES``;
* ranks per node: ``SLURM_TASKS_PER_NODE`` (``2(x4)``; every node must run the same number,
  since the planner's groups are per node), else ``SLURM_NTASKS`` / nodes. The ranks are what
  the trainer's world is made of, so they, not the GPUs, size the plan;
* the device: ``HPC_MCA_GPU`` (a preset of ``hpc-mca plan --gpu``) when set, else ``CPU`` for
  an allocation without GPUs (``SLURM_GPUS_ON_NODE`` unset or 0) and ``H100-80GB`` with them.
  More ranks than GPUs on a node is refused (a Megatron rank needs its own device).

A start that resumes from a checkpoint (a requeue, or the template pointed at an old run
directory with ``HPC_MCA_RUN_DIR`` on another node count) plans with what the checkpoint fixes,
as ``hpc-mca resume`` does: its global batch and optimizer kind (the accumulation is derived
again). A start that will not resume (``resume_from_checkpoint: never``, or a first start with
``overwrite_output_dir``, which moves the old run aside) plans afresh.

Pure Python, no torch: it runs in the batch shell, on the job's critical path.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_mca.checkpoint.afresh import continued_by
from hpc_mca.checkpoint.store import CheckpointError, latest_checkpoint, read_info
from hpc_mca.rundir import RUN_DIR_ENV, record_bad_input, write_atomic

from .errors import OpsError
from .jobplan import (
    JobPlan,
    PlanOptions,
    check_train_config,
    load_train_config,
    make_job_plan,
    plan_summary,
)

PLAN_FILE = "job_plan.json"
"""In the run directory: the plan of the job's latest start (see :func:`record`)."""
DEFAULT_GPU = "H100-80GB"
"""The preset an allocation with GPUs is planned for when ``HPC_MCA_GPU`` does not say."""

_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclass(frozen=True)
class Allocation:
    """What Slurm gave this job."""

    nodes: int
    ranks_per_node: int
    gpus_on_node: int
    gpu: str
    """The planner's preset for the devices."""


def _positive(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise OpsError(f"{name}={value!r} is not a positive whole number; valid: what Slurm sets "
                       "in a batch job")
    return int(value)


def _tasks_per_node(env: Mapping[str, str], nodes: int) -> int:
    """Ranks on every node; OpsError when the nodes run different numbers of them."""
    spec = env.get("SLURM_TASKS_PER_NODE", "").strip()
    if spec:
        counts: list[int] = []
        for part in spec.split(","):
            match = _TASKS.fullmatch(part.strip())
            if match is None:
                raise OpsError(f"SLURM_TASKS_PER_NODE={spec!r} is not Slurm's N(xM),... form")
            counts += [int(match.group(1))] * int(match.group(2) or 1)
        if len(set(counts)) != 1:
            raise OpsError(f"SLURM_TASKS_PER_NODE={spec!r}: the nodes run different numbers of "
                           "ranks; valid: the same on every node (sbatch --ntasks-per-node N)")
        return counts[0]
    total = _positive(env, "SLURM_NTASKS") or nodes
    if total % nodes:
        raise OpsError(f"SLURM_NTASKS={total} ranks do not split evenly over {nodes} nodes; "
                       "valid: a multiple of the node count (sbatch --ntasks-per-node N)")
    return total // nodes


def allocation_from_env(env: Mapping[str, str]) -> Allocation:
    """The allocation of the batch job whose environment is ``env``."""
    nodes = _positive(env, "SLURM_JOB_NUM_NODES") or _positive(env, "SLURM_NNODES")
    if nodes is None:
        raise OpsError("SLURM_JOB_NUM_NODES is not set; valid: run the planner at job start "
                       "inside a batch job (hpc-mca plan --nodes N plans from the login node)")
    ranks = _tasks_per_node(env, nodes)
    raw_gpus = env.get("SLURM_GPUS_ON_NODE", "").strip()
    gpus = int(raw_gpus) if raw_gpus.isdigit() else 0
    if gpus and ranks > gpus:
        raise OpsError(f"{ranks} ranks per node but SLURM_GPUS_ON_NODE={gpus}; valid: at most "
                       "one rank per GPU (sbatch --ntasks-per-node equal to --gpus-per-node)")
    gpu = env.get("HPC_MCA_GPU", "").strip() or (DEFAULT_GPU if gpus else "CPU")
    return Allocation(nodes, ranks, gpus, gpu)


def checkpoint_pins(run_dir: Path | None, overrides: Sequence[str]) -> list[str]:
    """What a checkpoint in ``run_dir`` fixes for a start that resumes from it (the rules of
    ``hpc-mca resume``); none without one. A checkpoint that cannot be read pins nothing:
    the ranks report it in their own words when they load it."""
    if run_dir is None:
        return []
    try:
        path = latest_checkpoint(run_dir)
        info = read_info(path) if path is not None else None
    except CheckpointError:
        return []
    if info is None or "global_batch_size" not in info.training:
        return []
    pins = [f"global_batch_size={info.training['global_batch_size']}"]
    if "use_distributed_optimizer" in info.training:
        pins.append("use_distributed_optimizer="
                    f"{str(bool(info.training['use_distributed_optimizer'])).lower()}")
    # The global batch stays; how it is accumulated follows this allocation's size.
    if not any(o.split("=", 1)[0].rsplit(".", 1)[-1] == "gradient_accumulation_steps"
               for o in overrides):
        pins.append("gradient_accumulation_steps=null")
    return pins


def _resumes(config: Path, overrides: Sequence[str], run_dir: Path | None,
             env: Mapping[str, str]) -> bool:
    """Whether the ranks will continue from the run directory's latest checkpoint: the config
    says auto/latest and no fresh start (``overwrite_output_dir`` on a first start) moves the
    old run aside (the trainer's own rule: :func:`hpc_mca.checkpoint.afresh.continued_by`)."""
    if run_dir is None:
        return False
    training = load_train_config(config, overrides).training
    if training.resume_from_checkpoint not in ("auto", "latest"):
        return False
    restart = int(env.get("SLURM_RESTART_COUNT") or 0)
    return not training.overwrite_output_dir or continued_by(
        run_dir, env.get("SLURM_JOB_ID"), restart) is not None


@dataclass(frozen=True)
class StartPlan:
    """The plan of one job start."""

    allocation: Allocation
    job: JobPlan
    user_overrides: tuple[str, ...]
    pins: tuple[str, ...]

    @property
    def overrides(self) -> list[str]:
        """What the rank command gets after the user's overrides (before ``output_dir``)."""
        return [*self.pins, *self.job.plan_overrides]


def plan_start(config: Path, overrides: Sequence[str], env: Mapping[str, str]) -> StartPlan:
    """Plan this start of the job; OpsError (one line per problem) when it cannot run."""
    alloc = allocation_from_env(env)
    run_dir = Path(env[RUN_DIR_ENV]) if env.get(RUN_DIR_ENV) else None
    pins = checkpoint_pins(run_dir, overrides) if _resumes(config, overrides, run_dir, env) else []
    options = PlanOptions(nodes=alloc.nodes, gpus_per_node=alloc.ranks_per_node, gpu=alloc.gpu)
    job = make_job_plan(options, config, [*overrides, *pins])
    # The ranks' own first checks (config rules for this world size, data files present), so
    # a config that cannot run stops here, before N ranks import torch to find out.
    check_train_config(job, str(run_dir or Path(env.get("PWD", ".")) / "run"))
    return StartPlan(alloc, job, tuple(overrides), tuple(pins))


def record(start: StartPlan, run_dir: Path, env: Mapping[str, str]) -> Path:
    """Write ``job_plan.json``: the allocation, the user's config and overrides (what ``hpc-mca
    resume`` replans a raw-template run from), the checkpoint pins, the trainer overrides and
    the plan as ``hpc-mca plan --json`` shows it."""
    job, alloc = start.job, start.allocation
    data: dict[str, Any] = {
        "job_id": env.get("SLURM_JOB_ID"), "restart": int(env.get("SLURM_RESTART_COUNT") or 0),
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nodes": alloc.nodes, "ranks_per_node": alloc.ranks_per_node,
        "gpus_on_node": alloc.gpus_on_node, "gpu": alloc.gpu,
        "config": str(job.config_path.absolute()) if job.config_path else None,
        "overrides": list(start.user_overrides),
        "checkpoint_pins": list(start.pins), "plan_overrides": list(job.plan_overrides),
        "plan": plan_summary(job.plan)}
    return write_atomic(run_dir / PLAN_FILE, json.dumps(data, indent=1) + "\n")


def read_plan_record(run_dir: Path) -> dict[str, Any] | None:
    """``job_plan.json`` of ``run_dir``, or None (no raw-template start planned there)."""
    try:
        data = json.loads((Path(run_dir) / PLAN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def main(config: Path | None, overrides: Sequence[str],
         env: Mapping[str, str] = os.environ) -> int:
    """``hpc-mca plan --at-job-start``: print the plan's one-line description, then the
    overrides (one line, space-separated); on bad input print the reason, record it as the
    run's bad input and return 2 (the batch script then ends the job, never requeued)."""
    try:
        if config is None:
            raise OpsError("hpc-mca plan --at-job-start needs the run CONFIG.yaml [key=value ...]")
        start = plan_start(config, overrides, env)
        run_dir = Path(env[RUN_DIR_ENV]) if env.get(RUN_DIR_ENV) else None
        if run_dir is not None:
            record(start, run_dir, env)
    except OpsError as err:
        message = "; ".join(line for line in str(err).splitlines() if line.strip())
        print(f"hpc-mca: {message}", file=sys.stderr)
        record_bad_input(message)
        return 2
    alloc = start.allocation
    print(f"{start.job.plan.describe()} on {alloc.nodes} node(s) x {alloc.ranks_per_node} "
          f"rank(s) ({alloc.gpu})")
    print(" ".join(start.overrides))
    return 0
