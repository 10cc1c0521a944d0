"""From a run config and command-line options to a plan, and from the plan to the trainer's
overrides (which slurm/overrides.py writes).

Precedence for every planner input: a command-line option, else what the config states
explicitly (its YAML or a ``key=value`` override), else the planner's choice. A parallel size
set on the command line or in the config is a *forced* layout (the other sizes default to 1);
the planner then checks it instead of searching. What the planner chose is handed to the
trainer as ``key=value`` overrides for exactly the keys the user left open, so the trainer
runs the planned layout and nothing the user wrote is silently replaced.

The config's ``training.use_mca`` picks the backend. With ``false`` (the standard backend: a
whole model per GPU) a Megatron-only size or option given on the command line or in the config
is refused here, in the user's own words (``--tp 2``, ``parallel.tensor_model_parallel_size=2``),
and the overrides carry only batch keys and ``parallel.sequence_parallel_size``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_mca.stages import RESERVED_STAGES, STAGE_NAMES, reference_runs
from hpc_mca.topology import Layout, LayoutError, Plan, PlanRequest, plan
from hpc_mca.topology.model import check_buildable
from hpc_mca.topology.standard import megatron_only_line, sp_with_megatron_line

from .errors import OpsError
from .overrides import LAYOUT_KEYS, config_recompute, plan_overrides

if TYPE_CHECKING:  # the config module is imported where a config is read
    from hpc_mca.config.sections import ParallelArguments, TrainConfig

# Defaults used for planning when there is no config (``hpc-mca plan --model ...``).
DEFAULT_SEQ_LENGTH = 4096
DEFAULT_SEQUENCES_PER_GPU = 8


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What ``hpc-mca plan``/``submit`` take on the command line; None = not given."""

    nodes: int = 1
    gpus_per_node: int | None = None
    gpu: str = "H100-80GB"
    gpu_memory_gib: float | None = None
    model: str | None = None
    seq_length: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    stage: str | None = None
    precision: str | None = None
    lora: bool | None = None
    tp: int | None = None
    pp: int | None = None
    vp: int | None = None
    cp: int | None = None
    ep: int | None = None
    etp: int | None = None
    recompute: str | None = None
    distributed_optimizer: bool | None = None
    sp: int | None = None
    """Ulysses sequence-parallel size (standard backend only)."""


@dataclass(frozen=True)
class JobPlan:
    """A plan plus what the trainer needs to run it."""

    plan: Plan
    config_path: Path | None
    user_overrides: tuple[str, ...]
    """``key=value`` pairs as given."""
    plan_overrides: tuple[str, ...]
    """What the plan and the CLI options add (stage, precision, layout, batch)."""
    script: Path | None = None
    """A Python training script the ranks run (``hpc-mca run``) instead of a config; then
    ``user_overrides`` are its arguments and ``plan_overrides`` reach it through the
    environment (:func:`make_script_plan`)."""
    model: str | None = None
    """With ``script``: the model directory the plan was made for (``--model``; the manifest
    keeps it, so that ``hpc-mca resume`` can plan again)."""

    @property
    def world_size(self) -> int:
        return self.plan.request.world_size

    @property
    def train_overrides(self) -> list[str]:
        """Everything ``hpc-mca train`` gets after the config (the run dir is added later)."""
        return [*self.user_overrides, *self.plan_overrides]


def _config_keys(config_path: Path | None, overrides: Iterable[str]) -> set[str]:
    """Flat names of the config keys the YAML file or the overrides set explicitly."""
    import yaml

    keys: set[str] = set()
    if config_path is not None:
        try:
            data = yaml.safe_load(config_path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            data = {}  # load_config reports the problem with its own message
        for key, value in (data.items() if isinstance(data, dict) else ()):
            if isinstance(value, dict) and key in ("model", "data", "finetuning", "training",
                                                   "parallel"):
                keys.update(str(sub) for sub in value)
            else:
                keys.add(str(key).split(".")[-1])
    for item in overrides:
        key = item.partition("=")[0].strip()
        parts = key.split(".")
        keys.add(parts[1] if len(parts) > 1 and parts[0] in (
            "model", "data", "finetuning", "training", "parallel") else parts[0])
    return keys


def load_train_config(config_path: Path, overrides: Iterable[str]) -> TrainConfig:
    """The trainer's config object, with its errors as OpsError."""
    from hpc_mca.config.loading import load_config
    from hpc_mca.config.sections import ConfigError

    if not config_path.is_file():
        raise OpsError(f"config file {str(config_path)!r} does not exist; valid: a run config "
                       "YAML (e.g. hpc_mca/assets/demo/sft_addition.yaml)")
    try:
        return load_config(config_path, list(overrides))
    except ConfigError as err:
        raise OpsError(str(err)) from None


def make_job_plan(options: PlanOptions, config_path: Path | None = None,
                  overrides: Iterable[str] = ()) -> JobPlan:
    """Plan the job; raise OpsError (one line per problem) for anything wrong."""
    overrides = tuple(overrides)
    config = load_train_config(config_path, overrides) if config_path is not None else None
    explicit = _config_keys(config_path, overrides) if config is not None else set()
    request = _request(options, config, explicit)
    try:
        result = plan(request)
    except LayoutError as err:
        raise OpsError(str(err)) from None
    extra = plan_overrides(result, options, explicit) if config is not None else ()
    return JobPlan(result, config_path, overrides, tuple(extra))


SCRIPT_BATCH_KEYS = frozenset({"per_device_train_batch_size", "global_batch_size"})
"""Left to a script unless given on the command line: the planner cannot see its batch."""


def make_script_plan(options: PlanOptions, script: Path, args: Iterable[str] = ()) -> JobPlan:
    """Plan a job whose ranks run the Python ``script`` with ``args``: the planner reads the
    model from ``--model`` (there is no config to read it from) and the plan's layout goes
    to the script as overrides of the fields it leaves at their defaults (the
    ``HPC_MCA_PLAN_OVERRIDES`` the batch script exports), batch sizes only when given here."""
    if not script.is_file():
        raise OpsError(f"script {str(script)!r} does not exist; valid: a Python training script "
                       "(e.g. hpc_mca/assets/demo/api_sft.py) or a run CONFIG YAML")
    if not options.model:
        raise OpsError(f"the script {script.name!r} needs --model HF_DIR (the model it trains: "
                       "the planner has no config to read it from); valid: --model DIR|config.json")
    request = _request(options, None, set())
    try:
        result = plan(request)
    except LayoutError as err:
        raise OpsError(str(err)) from None
    extra = plan_overrides(result, options, set(SCRIPT_BATCH_KEYS))
    return JobPlan(result, None, tuple(args), tuple(extra), script=script, model=options.model)


def _request(options: PlanOptions, config: TrainConfig | None,
             explicit: set[str]) -> PlanRequest:
    fields: dict[str, Any] = {
        "nodes": options.nodes, "gpus_per_node": options.gpus_per_node, "gpu": options.gpu,
        "gpu_memory_gib": options.gpu_memory_gib}
    if config is not None:
        fields.update(_from_config(config, explicit, options))
    fields["model"] = options.model or fields.get("model")
    if not fields["model"]:
        raise OpsError("no model: give --model DIR|config.json or a run CONFIG whose "
                       "model_name_or_path has a config.json")
    if isinstance(fields["model"], str):
        fields["model"] = Path(fields["model"]).expanduser()
    if isinstance(fields["model"], Path):
        try:  # the trainer could not build it: no plan (nor job) for it
            check_buildable(fields["model"])
        except LayoutError as err:
            raise OpsError(str(err)) from None
    for name in ("seq_length", "global_batch_size", "micro_batch_size", "stage", "precision",
                 "lora", "recompute"):
        if getattr(options, name) is not None:
            fields[name] = getattr(options, name)
    if options.distributed_optimizer is not None:
        fields["use_distributed_optimizer"] = options.distributed_optimizer
    fields.setdefault("seq_length", DEFAULT_SEQ_LENGTH)
    standard = config is not None and not config.training.use_mca
    par = config.parallel if config is not None else None
    _refuse_for_backend(options, par, explicit, standard)
    fields["backend"] = "standard" if standard else "megatron"
    sp = _given_sp(options, par, explicit)
    if sp is not None:
        fields["sequence_parallel_size"] = sp[0]
    # The standard backend's sizes are all 1 once refused above; they force nothing.
    layout = None if standard else _forced_layout(options, par, explicit)
    if layout is not None:
        fields["layout"] = layout
    if "global_batch_size" not in fields:
        world = options.nodes * (options.gpus_per_node or _preset_node_size(options))
        fields["global_batch_size"] = DEFAULT_SEQUENCES_PER_GPU * max(world, 1)
    _refuse_unbuilt(fields)
    try:
        return PlanRequest(**fields)
    except LayoutError as err:
        message = str(err)
        if sp is not None:  # the planner's SP line, in the words the user gave the size
            message = message.replace(f"sequence_parallel_size={sp[0]} ", f"{sp[1]} ")
        raise OpsError(message) from None
    except TypeError as err:  # a non-numeric value from a hand-made PlanOptions
        raise OpsError(str(err)) from None


def _refuse_unbuilt(fields: dict[str, Any]) -> None:
    """What the planner can size but the trainer cannot run yet is refused, one line each."""
    lines, stage = [], fields.get("stage")
    if stage is not None and stage not in STAGE_NAMES:
        why = "is not yet supported by the trainer" if stage in RESERVED_STAGES else "is not valid"
        lines.append(f"stage={stage!r} {why}; valid: {', '.join(STAGE_NAMES)}")
    if lines:
        raise OpsError("\n".join(lines))


def _given_sp(options: PlanOptions, par: ParallelArguments | None,
              explicit: set[str]) -> tuple[int, str] | None:
    """(Ulysses size, how the user wrote it) from --sp or the config; None when left open."""
    if options.sp is not None:
        return options.sp, f"--sp {options.sp}"
    if par is not None and "sequence_parallel_size" in explicit:
        value = par.sequence_parallel_size
        return value, f"parallel.sequence_parallel_size={value}"
    return None


def _refuse_for_backend(options: PlanOptions, par: ParallelArguments | None,
                        explicit: set[str], standard: bool) -> None:
    """What the chosen backend cannot run, one line each in the user's words: Ulysses SP with
    Megatron; Megatron's layout sizes, distributed optimizer and recompute with standard."""
    sp = _given_sp(options, par, explicit)
    if not standard:
        if sp is not None and sp[0] != 1:
            raise OpsError(sp_with_megatron_line(sp[1], cp="--cp"))
        return
    lines = [megatron_only_line(given, "1") for given in _megatron_sizes(options, par, explicit)]
    optimizer, recompute = _megatron_options(options, par, explicit)
    if optimizer is not None:
        lines.append(megatron_only_line(optimizer, "--no-distributed-optimizer",
                                        "the distributed optimizer is Megatron-Core's (the "
                                        "standard backend keeps Adam's state whole on every GPU)"))
    if recompute is not None:
        lines.append(megatron_only_line(recompute, "none", "the planner sizes the standard "
                                        "backend without activation recompute (its gradient "
                                        "checkpointing of every layer is the config's "
                                        "gradient_checkpointing=true)"))
    if lines:
        raise OpsError("\n".join(lines))


def _megatron_sizes(options: PlanOptions, par: ParallelArguments | None,
                    explicit: set[str]) -> list[str]:
    """Layout sizes above 1 from the command line (``--tp 2``) or the config (its key)."""
    given = []
    for flag, key in LAYOUT_KEYS.items():
        value, text = getattr(options, flag), f"--{flag} {getattr(options, flag)}"
        if value is None and par is not None and key in explicit:
            value = getattr(par, key)
            text = f"parallel.{key}={value}"
        if isinstance(value, int) and value > 1:
            given.append(text)
    return given


def _megatron_options(options: PlanOptions, par: ParallelArguments | None,
                      explicit: set[str]) -> tuple[str | None, str | None]:
    """(distributed optimizer, recompute) as the user turned them on, else None each."""
    optimizer = recompute = None
    if options.distributed_optimizer:
        optimizer = "--distributed-optimizer"
    elif (options.distributed_optimizer is None and par is not None
          and "use_distributed_optimizer" in explicit and par.use_distributed_optimizer):
        optimizer = "parallel.use_distributed_optimizer=true"
    # The config's recompute is not refused here: the standard backend runs full recompute
    # of every layer (gradient checkpointing) and the config's rules refuse any other.
    if options.recompute not in (None, "none"):
        recompute = f"--recompute {options.recompute}"
    return optimizer, recompute


def _from_config(config: TrainConfig, explicit: set[str],
                 options: PlanOptions) -> dict[str, Any]:
    """Planner inputs the config states (the caller lets CLI options win)."""
    from hpc_mca.models.converters import frozen_sizing, trains_adapters_only

    tr, par, data, ft = config.training, config.parallel, config.data, config.finetuning
    fields: dict[str, Any] = {
        "model": config.model.model_name_or_path or None,
        "seq_length": data.seq_length or data.cutoff_len,
        "stage": ft.stage,
        "precision": "bf16" if tr.bf16 else "fp16" if tr.fp16 else "fp32",
        "lora": trains_adapters_only(ft),
        "lora_rank": ft.lora_rank,
        "freeze": frozen_sizing(ft, config.model.model_name_or_path),
        "reference": reference_runs(ft.stage, ft.pref_loss, ft.use_ref_model)
        if ft.stage in STAGE_NAMES else True,
        "separate_reference": ft.ref_model is not None,
        "sequence_packing": data.sequence_packing,
        "image_max_pixels": data.image_max_pixels,
        # What of the vision side trains: the config rules accept unfrozen parts under full
        # fine-tuning only, so these two settings say it for every finetuning type.
        "vision_trains": frozenset(
            part for part, frozen in (("tower", ft.freeze_vision_tower),
                                      ("projector", ft.freeze_multi_modal_projector))
            if not frozen),
    }
    if "per_device_train_batch_size" in explicit:
        fields["micro_batch_size"] = tr.per_device_train_batch_size
    if tr.global_batch_size is not None:
        fields["global_batch_size"] = tr.global_batch_size
    elif options.global_batch_size is None:
        # Without a global batch in the config: micro x accumulation x every GPU as a DP rank
        # (it is then passed to the trainer explicitly, so a model-parallel plan keeps it).
        world = options.nodes * (options.gpus_per_node or _preset_node_size(options))
        fields["global_batch_size"] = (tr.per_device_train_batch_size
                                       * (tr.gradient_accumulation_steps or 1) * max(world, 1))
    if "recompute_granularity" in explicit:
        fields["recompute"] = config_recompute(par)
    if "use_distributed_optimizer" in explicit:
        fields["use_distributed_optimizer"] = par.use_distributed_optimizer
    if "overlap_grad_reduce" in explicit:
        fields["overlap_grad_reduce"] = par.overlap_grad_reduce
    fields["overlap_param_gather"] = par.overlap_param_gather
    fields["cp_comm_type"] = par.cp_comm_type  # what the trainer will run under CP
    fields["mtp_num_layers"] = config.model.mtp_num_layers
    return fields


def _preset_node_size(options: PlanOptions) -> int:
    from hpc_mca.topology import get_gpu

    try:
        return get_gpu(options.gpu).gpus_per_node
    except LayoutError as err:
        raise OpsError(str(err)) from None


def _forced_layout(options: PlanOptions, par: ParallelArguments | None,
                   explicit: set[str]) -> Layout | None:
    sizes: dict[str, Any] = {}
    for flag, key in LAYOUT_KEYS.items():
        if getattr(options, flag) is not None:
            sizes[flag] = getattr(options, flag)
        elif par is not None and key in explicit and getattr(par, key) is not None:
            sizes[flag] = getattr(par, key)
    if not sizes:
        return None
    if par is not None and "pipeline_layout" in explicit and par.pipeline_layout:
        sizes["pipeline_layout"] = tuple(par.pipeline_layout)
    try:
        return Layout(**sizes)
    except LayoutError as err:
        raise OpsError(str(err)) from None


def check_train_config(job: JobPlan, run_dir: str) -> None:
    """Resolve the trainer's config as the ranks will (same overrides, same world size) and
    look for its dataset files, so a bad config stops ``plan`` and ``submit`` instead of the
    job. Data is only looked for, not read (tokenizing is the ranks' work); the paths are
    checked as this machine sees them, which for a cluster's shared file system is what the
    ranks see."""
    from hpc_mca.config.sections import ConfigError
    from hpc_mca.data.errors import DataError
    from hpc_mca.data.sources import check_sources

    if job.config_path is None:
        return
    config = load_train_config(job.config_path, [*job.train_overrides, f"output_dir={run_dir}"])
    try:
        config.resolve(job.world_size)
        check_sources(config.data)
    except (ConfigError, DataError) as err:
        raise OpsError(str(err)) from None


def plan_summary(result: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data (for the manifest)."""
    req, lay, mem = result.request, result.layout, result.memory
    layout = dataclasses.asdict(lay)
    return {
        "backend": result.backend, "sequence_parallel_size": result.sequence_parallel_size,
        "layout": layout, "describe": result.describe(), "forced": result.forced,
        "micro_batch_size": result.micro_batch_size, "num_microbatches": result.num_microbatches,
        "recompute": result.recompute,
        "use_distributed_optimizer": result.use_distributed_optimizer,
        "sequence_parallel": result.sequence_parallel,
        "memory_bytes": {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
                         "activations": mem.activations, "total": mem.total,
                         "vision_activations": mem.vision_activations,
                         "usable": result.usable_bytes},
        "step_time_s": {"total": result.step_time.total,
                        **dataclasses.asdict(result.step_time)},
        "tokens_per_second_per_gpu": result.tokens_per_second_per_gpu,
        "reason": result.reason,
        "request": {"nodes": req.nodes, "gpus_per_node": req.node_size, "gpu": req.gpu_spec.name,
                    "world_size": req.world_size, "model": req.shape.name,
                    "seq_length": req.seq_length, "global_batch_size": req.global_batch_size,
                    "stage": req.stage, "precision": req.precision, "lora": req.lora,
                    "sequence_packing": req.sequence_packing},
    }
