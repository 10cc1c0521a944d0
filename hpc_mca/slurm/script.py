"""The batch script of an hpc-mca job, rendered by one pure function.

One source of truth: ``sbatch/train.sbatch`` is :func:`render_script` called with the
defaults (a test checks the file equals that output; regenerate it with
``python -m hpc_mca.slurm.script > sbatch/train.sbatch``), and ``hpc-mca submit`` / ``hpc-mca
plan --sbatch`` call the same function with their values. The two scripts differ only in

* the ``#SBATCH`` lines (from :class:`SbatchOptions`: data, each value quoted for sbatch's
  parser), and
* the knob defaults: the template's are shell expressions (``${SLURM_SUBMIT_DIR}/runs``), the
  CLI's are literal single-quoted strings (``'/scratch/me/runs'``); every knob stays
  ``NAME=${NAME:-default}``, so an exported variable still wins, and
* the rank arguments: the CLI bakes its config and overrides in (``set -- ...``, used when
  the script is submitted without arguments); the template takes them from ``sbatch ...
  train.sbatch CONFIG [key=value ...]``.

Everything else (checks, run directory, signal hook, banner, ``srun``, exit code) is the
constant body below, so a fix there reaches both.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .batch_shell import BODY, BODY_START, USAGE, USAGE_TAIL
from .errors import OpsError
from .quoting import directive_quote, shell_quote

TEMPLATE_PATH = "sbatch/train.sbatch"
"""Where the rendered default lives, relative to the repository root."""

RUN_DIR_PATTERN = "%x_%j"
"""Run directory name under the runs root: job name and job id (as in the log names)."""

SIGNAL = "USR1"
"""The lead-time signal Slurm sends the batch shell (``--signal=B:USR1@<lead>``)."""


@dataclass(frozen=True)
class Knob:
    """An environment variable the batch script reads, with its template default."""

    name: str
    default: str
    """Shell expression used when neither the environment nor the CLI sets the knob."""
    doc: str


KNOBS: tuple[Knob, ...] = (
    Knob("HPC_MCA_HOME", "${SLURM_SUBMIT_DIR:-$PWD}",
         "hpc-mca checkout whose bin/hpc-mca-rank starts each rank (module load sets it)"),
    Knob("HPC_MCA_RANK_CMD", "train",
         "hpc-mca subcommand every rank runs: train, or e.g. smoke for a quick cluster check"),
    Knob("HPC_MCA_RUNS_ROOT", "${SLURM_SUBMIT_DIR:-$PWD}/runs",
         "where run directories are created"),
    Knob("HPC_MCA_RUN_DIR", "${HPC_MCA_RUNS_ROOT}/${SLURM_JOB_NAME}_${SLURM_JOB_ID}",
         "this run's directory (train's output_dir; a continuation job passes the old one)"),
    Knob("HPC_MCA_PLAN_OVERRIDES", "",
         "run: the planned layout as space-separated key=value pairs (hpc-mca submit "
         "SCRIPT.py sets it); the script's TrainingArguments apply them to the fields it "
         "left at their defaults"),
    Knob("HPC_MCA_VENV", "",
         "virtual environment of the ranks (empty: $HPC_MCA_HOME/.venv; see bin/hpc-mca-rank)"),
    Knob("HPC_MCA_FORWARD_SIGNAL", "",
         "signal to send the ranks when the lead-time signal arrives, e.g. USR1 (empty: "
         "only record it in $HPC_MCA_RUN_DIR/signal_received)"),
    Knob("HPC_MCA_MAX_REQUEUES", "10",
         "train: how often the job may requeue itself (SLURM_RESTART_COUNT counts them)"),
    Knob("HPC_MCA_REQUEUE_ON_FAILURE", "1",
         "train: 1 = also requeue (within that budget) when the ranks fail with an exit code "
         "other than 2 (bad input); 0 = only on the lead-time signal"),
    Knob("HPC_MCA_MAX_EXCLUDED_NODES", "2",
         "train: how many nodes the run may exclude from its next starts in all: a node named "
         "by the hang watchdog or failing the preflight (hpc_mca/slurm/exclusion.py)"),
    Knob("HPC_MCA_PREFLIGHT", "0",
         "train: 1 = before training, every node checks its devices and joins an all-reduce "
         "across the job; a failing node is excluded and the job requeued (hpc-mca submit "
         "--preflight sets it)"),
    Knob("HPC_MCA_PLAN", "start",
         "train: start = plan the layout for this allocation at every start of the job, as "
         "hpc-mca plan would (the sizes the config or the overrides set stay as given), log it "
         "and record it in $HPC_MCA_RUN_DIR/job_plan.json (hpc_mca/slurm/startplan.py); given "
         "= run the arguments as they are (hpc-mca submit/resume scripts carry their plan)"),
    Knob("HPC_MCA_GPU", "",
         "train with HPC_MCA_PLAN=start: the GPU preset to plan for, as hpc-mca plan --gpu "
         "(empty: CPU when the allocation has no GPUs, else H100-80GB); the ranks per node are "
         "the allocation's tasks per node"),
)
KNOB_NAMES = tuple(k.name for k in KNOBS)

# Directives the renderer writes itself; --sbatch-arg may not repeat them.
_MANAGED = ("job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time",
            "partition", "account", "qos", "signal", "requeue", "no-requeue", "open-mode",
            "output", "error", "hold")
_EXTRA = re.compile(r"--([a-z][a-z0-9-]*)(?:=(.*))?", re.DOTALL)
_COMMAND = re.compile(r"[a-z][a-z0-9-]*")


@dataclass(frozen=True)
class SbatchOptions:
    """The ``#SBATCH`` lines; ``None`` leaves a directive out (the site default applies)."""

    job_name: str = "hpc-mca"
    nodes: int = 1
    ntasks_per_node: int = 1
    """Ranks per node: one per GPU."""
    gpus_per_node: int | None = None
    """GPUs to request per node (None on CPU-only partitions)."""
    cpus_per_task: int | None = None
    time: str | None = "01:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    signal_lead_s: int = 120
    """Seconds before the time limit at which the batch shell gets SIGUSR1 (Slurm checks
    every 30 s, so it may come up to ~60 s earlier)."""
    output: str = "%x_%j.out"
    """Log path as a Slurm filename pattern (stdout and stderr together, appended on requeue)."""
    extra: tuple[str, ...] = ()
    """Further directives, each ``--name`` or ``--name=value`` (e.g. ``--exclusive``)."""

    def directives(self) -> list[tuple[str, str | None]]:
        """``(name, value)`` pairs in script order; a None value is a bare flag."""
        pairs: list[tuple[str, str | None]] = [
            ("job-name", self.job_name), ("nodes", str(self.nodes)),
            ("ntasks-per-node", str(self.ntasks_per_node))]
        optional = (("gpus-per-node", self.gpus_per_node), ("cpus-per-task", self.cpus_per_task),
                    ("time", self.time), ("partition", self.partition),
                    ("account", self.account), ("qos", self.qos))
        pairs += [(name, str(value)) for name, value in optional if value is not None]
        pairs += [("signal", f"B:{SIGNAL}@{self.signal_lead_s}"), ("requeue", None),
                  ("open-mode", "append"), ("output", self.output)]
        return pairs + [_parse_extra(arg) for arg in self.extra]


def _parse_extra(arg: str) -> tuple[str, str | None]:
    match = _EXTRA.fullmatch(arg)
    if match is None:
        raise OpsError(f"sbatch argument {arg!r} is not --name or --name=value")
    name, value = match.group(1), match.group(2)
    if name in _MANAGED:
        raise OpsError(f"sbatch argument --{name} is set by hpc-mca itself; valid: its own "
                       "option (--job-name, --nodes, --time, --partition, ...) or another "
                       "sbatch option")
    return name, value


def _check(options: SbatchOptions) -> None:
    for name in ("nodes", "ntasks_per_node", "gpus_per_node", "cpus_per_task"):
        value = getattr(options, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise OpsError(f"{name}={value!r} must be a positive integer")
    if not isinstance(options.signal_lead_s, int) or options.signal_lead_s < 1:
        raise OpsError(f"signal_lead_s={options.signal_lead_s!r} must be a positive integer "
                       "number of seconds")
    if not options.job_name or "/" in options.job_name:
        raise OpsError(f"job_name={options.job_name!r} must be non-empty and without '/' "
                       "(it names the run directory)")


def render_script(options: SbatchOptions = SbatchOptions(),
                  knob_values: Mapping[str, str] | None = None,
                  rank_args: Sequence[str] | None = None) -> str:
    """The batch script for ``options``.

    ``knob_values`` replaces knob defaults with literal strings (quoted); ``rank_args`` are
    baked in as the arguments used when the script is submitted without any. Raises OpsError
    for values no script can carry (newlines in directives, unknown knobs, ...).
    """
    _check(options)
    values = dict(knob_values or {})
    unknown = sorted(set(values) - set(KNOB_NAMES))
    if unknown:
        raise OpsError(f"unknown knob(s) {', '.join(unknown)}; valid: {', '.join(KNOB_NAMES)}")
    command = values.get("HPC_MCA_RANK_CMD")
    if command is not None and not _COMMAND.fullmatch(command):
        raise OpsError(f"rank command {command!r} is not an hpc-mca subcommand name; "
                       "valid: e.g. train, smoke")
    literal = bool(values) or rank_args is not None
    parts = [_header(literal) + "\n", _sbatch_lines(options) + "\n", BODY_START, _knob_lines(values),
             _baked_args(rank_args), BODY]
    return "\n".join(part for part in parts if part)


def _header(literal: bool) -> str:
    lines = ["#!/bin/bash"]
    if literal:
        lines.append("# shellcheck disable=SC2016  # the values below are literal strings, "
                     "single-quoted on purpose")
    lines += USAGE.splitlines()
    width = max(len(k.name) for k in KNOBS)
    for knob in KNOBS:
        wrapped = textwrap.wrap(knob.doc, 96 - width - 6)
        lines.append(f"#   {knob.name:<{width}}  {wrapped[0]}")
        lines += [f"#   {'':<{width}}  {more}" for more in wrapped[1:]]
    lines += USAGE_TAIL.splitlines()
    return "\n".join(lines)


def _sbatch_lines(options: SbatchOptions) -> str:
    return "\n".join(
        f"#SBATCH --{name}" if value is None
        else f"#SBATCH --{name}={directive_quote(value, f'--{name}')}"
        for name, value in options.directives())


def _knob_lines(values: Mapping[str, str]) -> str:
    lines = ["# --- configuration (knobs: an exported variable wins over the default) ---------"]
    for knob in KNOBS:
        default = shell_quote(values[knob.name]) if knob.name in values else knob.default
        if default == "''":
            default = ""
        lines.append(f"{knob.name}=${{{knob.name}:-{default}}}")
    lines.append("export " + " ".join(KNOB_NAMES))
    return "\n".join(lines) + "\n"


def _baked_args(rank_args: Sequence[str] | None) -> str:
    if rank_args is None:
        return ""
    words = " ".join(shell_quote(arg) for arg in rank_args)
    return ("# Rank arguments from hpc-mca submit (used when the script gets none).\n"
            "if (($# == 0)); then\n"
            f"    set -- {words}\n"
            "fi\n")


def default_script() -> str:
    """The raw template: what ``sbatch/train.sbatch`` holds."""
    return render_script()


if __name__ == "__main__":
    print(default_script(), end="")
