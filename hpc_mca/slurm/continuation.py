"""``hpc-mca resume``: continue a run from its latest checkpoint in a new job, maybe on another
number of nodes or another layout.

Pure Python (no torch): it runs on the login node. It reuses the operator code of
:mod:`hpc_mca.slurm` — the run lookup (manifest, else Slurm's record), the planner and the
trainer overrides (:func:`~hpc_mca.slurm.jobplan.make_job_plan`), the batch script renderer
(:func:`~hpc_mca.slurm.submit.render_job`, :func:`~hpc_mca.slurm.script.render_script`) — and
only changes what makes the job a continuation: ``HPC_MCA_RUN_DIR`` is the old run directory
(so the trainer's ``resume_from_checkpoint=auto`` finds the checkpoint) and the log goes next
to the old ones as ``<job name>_<new id>.out``; the new id is appended to the manifest's
``job_ids``.

Everything is checked before anything is submitted, each problem as one line: an unknown job,
a job of the run still queued or running, a run without a checkpoint, a finished run the new
settings do not make longer (max_steps, num_train_epochs; a longer one is extended), a
layout the planner or the trainer's config rules refuse, and a layout or config the checkpoint
cannot be loaded into (:func:`hpc_mca.checkpoint.compat.resume_check`, the same check the
ranks make). Nothing is ever deleted.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_mca.checkpoint import compat
from hpc_mca.checkpoint.store import (
    CheckpointError,
    CheckpointInfo,
    finished_step,
    latest_checkpoint,
    read_info,
)
from hpc_mca.config.sections import TrainConfig, TrainingArguments

from . import commands
from .errors import OpsError
from .exclusion import read_excluded
from .index import record_job
from .jobplan import JobPlan, PlanOptions, load_train_config, make_job_plan, make_script_plan
from .manifest import Run, find_run, read_manifest, write_manifest
from .quoting import filename_pattern
from .script import RUN_DIR_PATTERN, render_script
from .startplan import read_plan_record
from .submit import SubmitOptions, render_job

_LAYOUT_FLAGS = ("tp", "pp", "vp", "cp", "ep", "etp")


@dataclass(frozen=True)
class Continuation:
    """A checked continuation job, ready to submit."""

    run: Run
    checkpoint: Path
    info: CheckpointInfo
    job: JobPlan
    script: str
    knobs: dict[str, str]
    world_size: int
    job_name: str
    signal_lead_given: int | None
    """The lead-time signal's lead the user chose (kept by later continuations), or None."""

    def log(self, job_id: str) -> Path:
        return self.run.run_dir / f"{self.job_name}_{job_id}.out"

    def describe(self) -> str:
        req = self.job.plan.request
        return (f"run {self.run.run_dir} from {self.checkpoint.name} (step {self.info.step}, "
                f"{self.info.consumed_samples} samples) on {req.nodes} node(s) × {req.node_size} "
                f"{req.gpu_spec.name}, {self.job.plan.describe()}")


def plan_continuation(job_id: str, runs_root: Path, *, nodes: int | None = None,
                      overrides: Sequence[str] = (), plan_changes: dict[str, Any] | None = None,
                      slurm_changes: dict[str, Any] | None = None) -> Continuation:
    """Find the run of ``job_id`` and plan its continuation; OpsError (one line) if it cannot
    continue. ``plan_changes`` are PlanOptions fields (gpus_per_node, tp, ...), and
    ``slurm_changes`` SubmitOptions fields (time, partition, ...), given on the command line."""
    run = find_run(job_id, runs_root)
    _check_idle(run)
    checkpoint, info = _checkpoint(run.run_dir)
    # What the checkpoint fixes (the planner would otherwise re-derive them for the new size),
    # and resuming itself, whatever the config says.
    pins = [f"global_batch_size={info.training['global_batch_size']}",
            f"use_distributed_optimizer={str(info.training['use_distributed_optimizer']).lower()}",
            "resume_from_checkpoint=auto"]
    # The global batch stays; how it is accumulated follows the new size (an explicit value
    # in the config was for the old one), unless given for this continuation.
    if not _given(overrides, "gradient_accumulation_steps"):
        pins.append("gradient_accumulation_steps=null")
    options = _plan_options(run, nodes, plan_changes or {})
    script = (run.manifest or {}).get("train_script")
    if script:
        job = _script_job(run, options, Path(script), pins, overrides)
    else:
        config_path, user_overrides = _config_of(run)
        job = make_job_plan(options, config_path, [*user_overrides, *pins, *overrides])
        config = _check_loadable(job, config_path, run.run_dir, job.world_size)
        _check_extends(run, config.training, overrides)
    world = job.world_size
    submit_options = _submit_options(run, runs_root, slurm_changes or {})
    rendered = render_job(job, submit_options)
    knobs = {**rendered.knobs, "HPC_MCA_RUN_DIR": str(run.run_dir)}
    sbatch = dataclasses.replace(
        rendered.sbatch, job_name=_job_name(run),
        output=f"{filename_pattern(str(run.run_dir), 'run dir')}/{RUN_DIR_PATTERN}.out")
    script = render_script(sbatch, knobs, rendered.rank_args)
    return Continuation(run, checkpoint, info, job, script, knobs, world, _job_name(run),
                        submit_options.signal_lead_s)


def submit_continuation(cont: Continuation) -> str:
    """Submit held, record the job in the run's manifest, release; returns the job id. If
    anything fails in between, the held job is cancelled (nothing stays queued)."""
    def record(job_id: str) -> None:
        (cont.run.run_dir / f"job_{job_id}.sbatch").write_text(cont.script)
        _record(cont, job_id)
        record_job(job_id, cont.run.run_dir)

    return commands.submit_held(cont.script, commands.sbatch_env(drop=[*cont.knobs]), record)


# ---- checks ---------------------------------------------------------------------------------


def _script_job(run: Run, options: PlanOptions, script: Path, pins: Sequence[str],
                overrides: Sequence[str]) -> JobPlan:
    """The continuation of a job that ran a Python script (``hpc-mca submit SCRIPT.py``): the
    script again, with its first arguments and ``overrides`` after them, in the old run
    directory; the plan for the new size and the checkpoint's pins reach its
    ``TrainingArguments`` through ``HPC_MCA_PLAN_OVERRIDES`` (fields it leaves at their
    defaults). Its config lives in the script, so the ranks make the checkpoint check (a
    layout the checkpoint cannot load stops every rank with exit 2, nothing trained)."""
    manifest = run.manifest or {}
    if not manifest.get("model"):
        raise OpsError(f"run {run.run_dir} ran the script {script} but its manifest names no "
                       "model to plan for (a job of an older hpc-mca); valid: hpc-mca submit "
                       "--model DIR of the script again")
    _check_extends(run, None, overrides)
    # The stage, precision and LoRA are the script's: the first plan's were the planner's
    # defaults, which would reach the script's fields left at theirs.
    options = dataclasses.replace(options, model=str(manifest["model"]), stage=None, precision=None, lora=None)
    job = make_script_plan(options, script,
                           [*(manifest.get("overrides") or []), *overrides])
    return dataclasses.replace(job, plan_overrides=(*job.plan_overrides, *pins))


def _job_ids(run: Run) -> list[str]:
    manifest = run.manifest or {}
    ids = [str(manifest.get("job_id") or run.job_id or "")]
    ids += [str(i) for i in manifest.get("job_ids") or []]
    return [i for i in dict.fromkeys(ids) if i]


def _check_idle(run: Run) -> None:
    """Two jobs must never write one run directory."""
    for job_id in _job_ids(run):
        state = commands.job_state(job_id)
        if state is not None and not state.finished:
            raise OpsError(f"job {job_id} of run {run.run_dir} is still {state.state}; valid: "
                           f"resume after it ended (hpc-mca cancel {job_id})")


def _checkpoint(run_dir: Path) -> tuple[Path, CheckpointInfo]:
    try:
        path = latest_checkpoint(run_dir)
    except CheckpointError as err:
        raise OpsError(str(err)) from None
    if path is None:
        raise OpsError(f"run {run_dir} has no checkpoint to resume from (no checkpoints/latest); "
                       "nothing submitted")
    try:
        return path, read_info(path)
    except CheckpointError as err:
        raise OpsError(str(err)) from None


def _given(overrides: Sequence[str], key: str) -> bool:
    """Whether ``key`` (flat or dotted, e.g. training.max_steps) is among the overrides."""
    return any(o.split("=", 1)[0].rsplit(".", 1)[-1] == key for o in overrides)


def _config_of(run: Run) -> tuple[Path, list[str]]:
    """The run config and the user's overrides: from the manifest, else (a job of the raw
    template) the resolved config the trainer wrote into the run directory."""
    manifest = run.manifest or {}
    if manifest.get("config"):
        return Path(manifest["config"]), [str(o) for o in manifest.get("overrides") or []]
    # A raw-template job that planned at its start recorded what it planned from: replan the
    # same way for the new size (its old sizes were the planner's, not the user's).
    started = read_plan_record(run.run_dir) or {}
    if started.get("config"):
        return Path(started["config"]), [str(o) for o in started.get("overrides") or []]
    resolved = run.run_dir / "resolved_config.yaml"
    if not resolved.is_file():
        raise OpsError(f"run {run.run_dir} has neither a manifest naming its config nor a "
                       "resolved_config.yaml; nothing submitted")
    # Derived for the old world size; the new one derives them again. (Its parallel sizes
    # stay, as forced ones, unless --tp/--pp/... say otherwise.)
    return resolved, ["data_parallel_size=null", "gradient_accumulation_steps=null"]


def _plan_options(run: Run, nodes: int | None, changes: dict[str, Any]) -> PlanOptions:
    """The first job's planner inputs (hardware, stage, precision, LoRA) with the new size;
    the layout is planned anew unless --tp/--pp/... force it."""
    recorded = (run.manifest or {}).get("plan") or (read_plan_record(run.run_dir) or {}).get("plan")
    request = (recorded or {}).get("request") or {}
    gpu, memory = _gpu(str(request.get("gpu") or "H100-80GB"))
    fields: dict[str, Any] = {
        "nodes": nodes or request.get("nodes") or 1, "gpus_per_node": request.get("gpus_per_node"),
        "gpu": gpu, "gpu_memory_gib": memory, "stage": request.get("stage"),
        "precision": request.get("precision"), "lora": request.get("lora")}
    fields.update({k: v for k, v in changes.items() if v is not None})
    try:
        return PlanOptions(**fields)
    except TypeError as err:
        raise OpsError(str(err)) from None


def _gpu(name: str) -> tuple[str, float | None]:
    """``"H100-80GB (60 GiB)"`` (a preset with its memory overridden) -> preset, memory."""
    match = re.fullmatch(r"(\S+)(?: \(([\d.]+) GiB\))?", name)
    if match is None:
        return name, None
    return match.group(1), float(match.group(2)) if match.group(2) else None


def _check_loadable(job: JobPlan, config_path: Path, run_dir: Path, world: int) -> TrainConfig:
    """Resolve the trainer config as the new ranks will and run their checkpoint check;
    returns the resolved config."""
    from hpc_mca.config.sections import ConfigError
    from hpc_mca.topology import LayoutError, ModelShape

    config = load_train_config(config_path, [*job.train_overrides, f"output_dir={run_dir}"])
    try:
        config = config.resolve(world)
        shape = ModelShape.from_hf_config(config.model.model_name_or_path)
        compat.resume_check(config, world, shape)
    except (ConfigError, LayoutError) as err:
        raise OpsError("; ".join(str(err).splitlines())) from None
    return config


def _check_extends(run: Run, training: TrainingArguments | None, overrides: Sequence[str]) -> None:
    """A finished run continues only when the new settings make it longer (the LR schedule
    is then re-derived for the new total; see hpc_mca.config.schedule). ``training``: the
    new config's (None for a script's run: its ranks find a length that adds nothing)."""
    done = finished_step(run.run_dir)
    if done is None:
        return
    if not (_given(overrides, "max_steps") or _given(overrides, "num_train_epochs")):
        raise OpsError(f"run {run.run_dir} finished at step {done}; nothing to resume; valid: "
                       f"extend it with max_steps=N (N > {done}) or num_train_epochs=E, e.g. "
                       f"hpc-mca resume {run.job_id or 'JOBID'} max_steps={2 * done}")
    idle = compat.nothing_to_train(training) if training is not None else None
    if idle is not None:
        raise OpsError(idle)


def _submit_options(run: Run, runs_root: Path, changes: dict[str, Any]) -> SubmitOptions:
    """The first job's Slurm options (partition, time, ...), changed where asked."""
    manifest = run.manifest or {}
    sbatch = manifest.get("sbatch") or {}
    # A lead the user chose is kept (and checked against the new time limit); a default
    # one is derived again for the new limit. (Older manifests did not say: keep theirs.)
    lead = manifest["signal_lead_s_given"] if "signal_lead_s_given" in manifest \
        else sbatch.get("signal_lead_s")
    fields: dict[str, Any] = {
        "runs_root": runs_root, "job_name": _job_name(run),
        "partition": sbatch.get("partition"), "account": sbatch.get("account"),
        "qos": sbatch.get("qos"), "time": sbatch.get("time") or "01:00:00",
        "cpus_per_task": sbatch.get("cpus_per_task"),
        "signal_lead_s": lead,
        "sbatch_args": tuple(_extra_args(sbatch.get("extra") or (), run.run_dir)),
        # A run submitted with --preflight keeps checking its nodes at every start.
        "preflight": (manifest.get("knobs") or {}).get("HPC_MCA_PREFLIGHT") == "1"}
    fields.update({k: v for k, v in changes.items() if v is not None})
    return SubmitOptions(**fields)


def _extra_args(extra: Sequence[Any], run_dir: Path) -> list[str]:
    """SbatchOptions.extra as given to submit ("--name[=value]" strings), with the nodes the
    run excluded after a hang or a failed preflight added to its ``--exclude``: a
    continuation keeps away from them too."""
    args = [str(arg) for arg in extra]
    excluded = [record["node"] for record in read_excluded(run_dir)]
    if not excluded:
        return args
    given = [a.split("=", 1)[1] for a in args if a.startswith("--exclude=")]
    nodes = list(dict.fromkeys([n for value in given for n in value.split(",") if n] + excluded))
    return [a for a in args if not a.startswith("--exclude=")] + [f"--exclude={','.join(nodes)}"]


def _job_name(run: Run) -> str:
    name = (run.manifest or {}).get("job_name")
    if name:
        return str(name)
    suffix = f"_{run.job_id}" if run.job_id else ""
    return run.run_dir.name.removesuffix(suffix) or run.run_dir.name


def _record(cont: Continuation, job_id: str) -> None:
    """Append the continuation to the run's manifest (created for a raw-template run)."""
    run_dir = cont.run.run_dir
    manifest = read_manifest(run_dir) or {"job_id": cont.run.job_id, "run_dir": str(run_dir),
                                          "job_name": _job_name(cont.run)}
    manifest.pop("version", None)
    manifest["job_ids"] = [*(manifest.get("job_ids") or []), job_id]
    manifest.setdefault("log", str(run_dir / f"{_job_name(cont.run)}_{manifest['job_id']}.out"))
    manifest["signal_lead_s_given"] = cont.signal_lead_given
    manifest["continuations"] = [*(manifest.get("continuations") or []), {
        "job_id": job_id, "from_checkpoint": str(cont.checkpoint), "step": cont.info.step,
        "nodes": cont.job.plan.request.nodes, "world_size": cont.world_size,
        "layout": dataclasses.asdict(cont.job.plan.layout),
        "submit_time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}]
    write_manifest(run_dir, manifest)
