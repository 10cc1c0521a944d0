"""Options shared by the login-node commands (plan, submit, status, logs, cancel, tensorboard).

Only click and the pure-Python lists of choices (stage registry, planner) are imported here;
the commands import ``hpc_mca.slurm`` inside their functions.
Errors from the library (:class:`hpc_mca.slurm.OpsError`) become ``click.ClickException``: a
one-line ``Error: ...`` per problem and exit status 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from hpc_mca.stages import STAGE_NAMES
from hpc_mca.topology.choices import PRECISIONS, RECOMPUTE
from hpc_mca.topology.hardware import GPU_PRESETS

if TYPE_CHECKING:
    from hpc_mca.slurm.jobplan import PlanOptions
    from hpc_mca.slurm.submit import SubmitOptions

F = TypeVar("F", bound=Callable[..., Any])


def _apply(decorators: list[Callable[[F], F]], func: F) -> F:
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


PLAN_FIELDS = ("nodes", "gpus_per_node", "gpu", "gpu_memory_gib", "model", "seq_length",
               "global_batch_size", "micro_batch_size", "stage", "precision", "lora", "tp", "pp",
               "vp", "cp", "ep", "etp", "sp", "recompute", "distributed_optimizer")
SLURM_FIELDS = ("job_name", "partition", "account", "qos", "time", "cpus_per_task",
                "signal_lead", "sbatch_arg", "runs_root", "rank_command")


def _either(choices: Iterable[str]) -> str:
    """``a, b or c``: the choices a help text lists, from the one tuple that defines them."""
    names = list(choices)
    return f"{', '.join(names[:-1])} or {names[-1]}"


def plan_options(func: F) -> F:
    """Planner inputs: the job's size, the hardware, the model and forced layout sizes."""
    layout = [click.option(f"--{flag}", type=int, default=None,
                           help=f"Force the {what} size (the sizes not given default to 1).")
              for flag, what in (("tp", "tensor-parallel"), ("pp", "pipeline-parallel"),
                                 ("vp", "virtual-pipeline"), ("cp", "context-parallel"),
                                 ("ep", "expert-parallel"), ("etp", "expert-tensor-parallel"))]
    return _apply([
        click.option("--nodes", type=int, default=1, show_default=True, envvar="HPC_MCA_NODES",
                     help="Nodes in the job."),
        click.option("--gpus-per-node", type=int, default=None, envvar="HPC_MCA_GPUS_PER_NODE",
                     help="Ranks (GPUs) per node; default: the preset's (8; CPU: 1)."),
        click.option("--gpu", default="H100-80GB", show_default=True, envvar="HPC_MCA_GPU",
                     help=f"GPU preset: {_either(GPU_PRESETS)}."),
        click.option("--gpu-memory-gib", type=float, default=None,
                     help="Override the preset's memory per device."),
        click.option("--model", default=None,
                     help="HF model directory or config.json; default: the config's model."),
        click.option("--seq-length", type=int, default=None,
                     help="Tokens per sequence; default: the config's (4096 without one)."),
        click.option("--global-batch-size", type=int, default=None,
                     help="Sequences per step; default: the config's (8 per GPU without one)."),
        click.option("--micro-batch-size", type=int, default=None,
                     help="Force the micro-batch size."),
        click.option("--stage", default=None,
                     help=f"{_either(STAGE_NAMES)}; default: the config's."),
        click.option("--precision", default=None,
                     help=f"{_either(PRECISIONS)}; default: the config's (bf16 without one)."),
        click.option("--lora/--no-lora", default=None, help="Train LoRA adapters."),
        *layout,
        click.option("--sp", type=int, default=None,
                     help="Force the Ulysses sequence-parallel size (standard backend, "
                          "training.use_mca=false, only; Megatron splits sequences with --cp)."),
        click.option("--recompute", default=None,
                     help=f"Force {_either(RECOMPUTE)} (block: full recompute of the fewest "
                          "layers of each pipeline chunk that fit; block:N forces N; "
                          "selective:A,B recomputes the layer parts named: core_attn, "
                          "layernorm, mlp or moe)."),
        click.option("--distributed-optimizer/--no-distributed-optimizer", default=None,
                     help="Force the distributed optimizer on or off."),
    ], func)


def runs_root_option(func: F) -> F:
    return click.option(
        "--runs-root", type=click.Path(file_okay=False, path_type=Path), default=None,
        help="Where run directories live; default: $HPC_MCA_RUNS_ROOT, else ./runs.")(func)


signal_lead_option = click.option(
    "--signal-lead", type=int, default=None,
    help="Seconds before the time limit the job gets SIGUSR1 to save and requeue; at most half "
         "the limit, and the lead plus Slurm's 30 s check interval must leave a quarter of the "
         "limit to train. Default: 120, or a quarter of a limit under 8 minutes. resume warns "
         "when the time left before the signal is less than the run's last start-up took.")


def slurm_options(func: F) -> F:
    """What the batch script needs besides the plan."""
    return _apply([
        click.option("--job-name", default=None,
                     help="Slurm job name (and run dir prefix); default: the config's stem."),
        click.option("--partition", default=None, envvar="HPC_MCA_PARTITION",
                     help="Slurm partition [$HPC_MCA_PARTITION]."),
        click.option("--account", default=None, envvar="HPC_MCA_ACCOUNT",
                     help="Slurm account [$HPC_MCA_ACCOUNT]."),
        click.option("--qos", default=None, envvar="HPC_MCA_QOS", help="Slurm QOS [$HPC_MCA_QOS]."),
        click.option("--time", default="01:00:00", show_default=True, envvar="HPC_MCA_TIME",
                     help="Time limit (Slurm format) [$HPC_MCA_TIME]."),
        click.option("--cpus-per-task", type=int, default=None, help="CPUs per rank."),
        signal_lead_option,
        click.option("--sbatch-arg", multiple=True,
                     help="Extra sbatch option, e.g. --sbatch-arg=--exclusive (repeatable)."),
        runs_root_option,
        click.option("--rank-command", default="train", show_default=True,
                     envvar="HPC_MCA_RANK_CMD",
                     help="What every rank runs: train (with CONFIG), or e.g. 'smoke --tp 2' "
                          "for a quick cluster check [$HPC_MCA_RANK_CMD]."),
    ], func)


def plan_options_from(kwargs: Mapping[str, Any]) -> PlanOptions:
    from hpc_mca.slurm.jobplan import PlanOptions

    return PlanOptions(**{name: kwargs[name] for name in PLAN_FIELDS})


def submit_options_from(kwargs: Mapping[str, Any]) -> SubmitOptions:
    import shlex

    from hpc_mca.slurm.manifest import default_runs_root
    from hpc_mca.slurm.submit import SubmitOptions

    try:
        rank_command = tuple(shlex.split(kwargs["rank_command"]))
    except ValueError as err:
        raise click.ClickException(f"--rank-command {kwargs['rank_command']!r}: {err}") from None
    return SubmitOptions(
        runs_root=kwargs["runs_root"] or default_runs_root(), job_name=kwargs["job_name"],
        partition=kwargs["partition"], account=kwargs["account"], qos=kwargs["qos"],
        time=kwargs["time"] or None, cpus_per_task=kwargs["cpus_per_task"],
        signal_lead_s=kwargs["signal_lead"], sbatch_args=tuple(kwargs["sbatch_arg"]),
        rank_command=rank_command)


def runs_root_from(value: Path | None) -> Path:
    from hpc_mca.slurm.manifest import default_runs_root

    return value.expanduser().absolute() if value is not None else default_runs_root()


@contextlib.contextmanager
def ops_errors() -> Iterator[None]:
    """Turn the library's OpsError into Click's one-line ``Error: ...``."""
    from hpc_mca.slurm.errors import OpsError

    try:
        yield
    except OpsError as err:
        raise click.ClickException(str(err)) from None
