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
    parts = [_header(literal) + "\n", _sbatch_lines(options) + "\n", _BODY_START, _knob_lines(values),
             _baked_args(rank_args), _BODY]
    return "\n".join(part for part in parts if part)


def _header(literal: bool) -> str:
    lines = ["#!/bin/bash"]
    if literal:
        lines.append("# shellcheck disable=SC2016  # the values below are literal strings, "
                     "single-quoted on purpose")
    lines += _USAGE.splitlines()
    width = max(len(k.name) for k in KNOBS)
    for knob in KNOBS:
        wrapped = textwrap.wrap(knob.doc, 96 - width - 6)
        lines.append(f"#   {knob.name:<{width}}  {wrapped[0]}")
        lines += [f"#   {'':<{width}}  {more}" for more in wrapped[1:]]
    lines += _USAGE_TAIL.splitlines()
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


_USAGE = """\
#
# hpc-mca training job: every task of the allocation runs one hpc-mca rank through
# bin/hpc-mca-rank (python -m hpc_mca $HPC_MCA_RANK_CMD ...). Ranks = SLURM_NTASKS and
# nodes = SLURM_JOB_NUM_NODES: set them on the sbatch line, never here.
#
# Usage (no hpc-mca CLI needed; sbatch options and SBATCH_* variables win over the lines below):
#   sbatch --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 sbatch/train.sbatch CONFIG.yaml [key=value ...]
#   HPC_MCA_RANK_CMD=smoke sbatch --nodes 2 --ntasks-per-node 2 sbatch/train.sbatch --tp 2
# Arguments go to the rank command: for train, the run config and key=value overrides, with
# output_dir=<run dir> appended; for run, the Python script and its arguments (the script's
# TrainingArguments read the run dir and the planned layout from the environment);
# any other command gets them as its own options.
# train plans its layout at every start of the job (HPC_MCA_PLAN=start): for the allocation
# (SLURM_JOB_NUM_NODES, its tasks per node as the ranks per node, the GPU preset HPC_MCA_GPU)
# and the config's model, with the planner of hpc-mca plan; the sizes the config or the
# overrides set stay as given. The plan is logged, recorded in $HPC_MCA_RUN_DIR/job_plan.json
# and passed to the ranks as key=value overrides; a model that fits no layout is bad input
# (exit 2, never requeued). Scripts from hpc-mca submit/resume carry their plan (given).
#
# The lead-time signal (--signal=B:USR1@lead) reaches only this shell: it appends a line to
# $HPC_MCA_RUN_DIR/signal_received (exported to the ranks as HPC_MCA_SIGNAL_FILE) and, if
# HPC_MCA_FORWARD_SIGNAL is set, sends that signal to the ranks (scancel --signal). TERM is
# recorded the same way. The job is --requeue'able; its log is appended to across requeues.
# For train, the ranks see the record at their next step boundary, save and exit; then this
# shell requeues the job (same id) unless the run finished or the retry budget is spent.
# The whole protocol: hpc_mca/checkpoint/requeue.py.
#
# Knobs (environment variables):"""

_USAGE_TAIL = """\
# bin/hpc-mca-rank reads more on every node: HPC_MCA_PYTHON, HPC_MCA_MODULES and the
# container wrapper HPC_MCA_CONTAINER_RUNTIME (apptainer|singularity|enroot),
# HPC_MCA_CONTAINER_IMAGE, HPC_MCA_CONTAINER_MOUNTS.
#
# Rendered by hpc_mca/slurm/script.py (hpc-mca submit renders the same template)."""

_BODY_START = """\
set -euo pipefail
# Slurm checks limits every 30 s, so the lead-time USR1 can come while this script is still
# starting (a job whose limit is under lead + 30 s gets it at once), where bash's default
# action would kill the job: hold it until its handler exists below.
held_usr1=0
trap 'held_usr1=1' USR1

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    echo "hpc-mca: run this script with sbatch (SLURM_JOB_ID is not set)" >&2
    exit 2
fi
"""

_BODY = r"""if [[ ! "${HPC_MCA_MAX_REQUEUES}" =~ ^[0-9]+$ ]]; then  # it meets bash arithmetic below
    echo "hpc-mca: HPC_MCA_MAX_REQUEUES='${HPC_MCA_MAX_REQUEUES}' must be a whole number" >&2
    exit 2
fi
if [[ ! "${HPC_MCA_PLAN}" =~ ^(start|given)$ ]]; then
    echo "hpc-mca: HPC_MCA_PLAN='${HPC_MCA_PLAN}' is not valid; valid: start, given" >&2
    exit 2
fi

# --- environment ------------------------------------------------------------------------
launcher="${HPC_MCA_HOME}/bin/hpc-mca-rank"
if [[ ! -x "${launcher}" ]]; then
    echo "hpc-mca: ${launcher} not found: set HPC_MCA_HOME to the hpc-mca checkout" \
        "(or: module load hpc-mca)" >&2
    exit 2
fi
rank_args=("${HPC_MCA_RANK_CMD}" "$@")
if [[ "${HPC_MCA_RANK_CMD}" == train ]]; then
    if (($# == 0)) || [[ ! -f "$1" ]]; then
        echo "hpc-mca: usage: sbatch [options] train.sbatch CONFIG.yaml [key=value ...]" \
            "(config file '${1:-}' not found)" >&2
        exit 2
    fi
    rank_args+=("output_dir=${HPC_MCA_RUN_DIR}")
elif [[ "${HPC_MCA_RANK_CMD}" == run ]] && { (($# == 0)) || [[ ! -f "$1" ]]; }; then
    echo "hpc-mca: usage: HPC_MCA_RANK_CMD=run sbatch [options] train.sbatch SCRIPT.py [ARGS ...]" \
        "(script '${1:-}' not found)" >&2
    exit 2
fi
# train and run (a script through hpc-mca's API) keep the requeue contract below.
trains=0
[[ "${HPC_MCA_RANK_CMD}" != train && "${HPC_MCA_RANK_CMD}" != run ]] || trains=1
mkdir -p "${HPC_MCA_RUN_DIR}"
export HPC_MCA_SIGNAL_FILE="${HPC_MCA_RUN_DIR}/signal_received"
bad_input_file="${HPC_MCA_RUN_DIR}/bad_input"
tasks_file="${HPC_MCA_RUN_DIR}/srun_task_errors"  # srun's lines on tasks that failed
# A request, or a rank's bad-input verdict, belongs to the run that wrote it.
rm -f "${HPC_MCA_SIGNAL_FILE}" "${bad_input_file}" "${tasks_file}"
# The user's job index (hpc_mca/slurm/index.py), so hpc-mca status JOBID finds this run from
# anywhere; best effort.
state_dir=${HPC_MCA_STATE_DIR:-${XDG_STATE_HOME:-${HOME:-/nonexistent}/.local/state}/hpc-mca}
if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]] && mkdir -p "${state_dir}" 2>/dev/null; then
    printf '%s\t%s\t%s\n' "${SLURM_JOB_ID}" "${HPC_MCA_RUN_DIR}" "$(date +%s)" \
        >>"${state_dir}/runs.tsv" 2>/dev/null || true
fi

# --- banner -------------------------------------------------------------------------------
started=${SECONDS}
banner() { printf 'hpc-mca | %-14s %s\n' "$1" "$2"; }
banner "job" "${SLURM_JOB_ID} (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0}"
banner "nodes" "${SLURM_JOB_NUM_NODES:-?}: ${SLURM_JOB_NODELIST:-?}"
banner "ranks" "${SLURM_NTASKS:-?} (${SLURM_NTASKS_PER_NODE:-?} per node)"
banner "run dir" "${HPC_MCA_RUN_DIR}"
banner "hpc-mca home" "${HPC_MCA_HOME}"
banner "container" "${HPC_MCA_CONTAINER_RUNTIME:-none} ${HPC_MCA_CONTAINER_IMAGE:-}"

# --- layout (train from the raw template: planned for this allocation at every start) -------
if [[ "${HPC_MCA_RANK_CMD}" == train && "${HPC_MCA_PLAN}" == start ]]; then
    plan_rc=0
    plan_out=$("${launcher}" plan --at-job-start "$@") || plan_rc=$?
    if ((plan_rc != 0)); then  # the planner printed why; bad input is recorded (exit code 2)
        reason="the job-start planner failed, not requeued"
        [[ ! -s "${bad_input_file}" ]] || reason="bad input, not requeued: $(head -n 1 "${bad_input_file}")"
        banner "end" "${reason}; exit code ${plan_rc} after $((SECONDS - started)) s"
        exit "${plan_rc}"
    fi
    plan_text=""
    plan_args=()
    { read -r plan_text && read -r -a plan_args; } <<<"${plan_out}" || true
    banner "plan" "${plan_text}; recorded in ${HPC_MCA_RUN_DIR}/job_plan.json"
    # The plan's keys go after the user's overrides and before output_dir (the last argument).
    rank_args=("${rank_args[@]:0:${#rank_args[@]}-1}" "${plan_args[@]}" "${rank_args[-1]}")
fi
banner "rank command" "$(printf '%q ' "${rank_args[@]}")"
banner "start" "$(date '+%Y-%m-%d %H:%M:%S %Z') on $(hostname)"

# --- execution ----------------------------------------------------------------------------
# Slurm's view of why this job is ending (the controller's record, through squeue): requeued
# (an outside `scontrol requeue`, or a preemption that requeues: Slurm brings the job back
# itself), timelimit, preempted, cancelled (scancel, hpc-mca cancel), running (nothing is
# ending it: e.g. `scancel --signal=TERM` only signals) or unknown (slurmctld did not answer).
slurm_verdict() {
    local state="" reason="" restarts=""
    IFS='|' read -r state reason restarts _ < <(squeue -h -j "${SLURM_JOB_ID}" \
        -O 'State:|,Reason:|,RestartCnt:|' 2>/dev/null || true) || true
    if [[ -z "${state}" ]]; then
        echo unknown
    elif [[ "${restarts}" =~ ^[0-9]+$ ]] && ((restarts > ${SLURM_RESTART_COUNT:-0})); then
        echo requeued
    elif [[ "${reason}" == TimeLimit || "${state}" == TIMEOUT ]]; then
        echo timelimit
    elif [[ "${state}" == PREEMPTED || "${reason}" == Preempt* ]]; then
        echo preempted
    elif [[ "${state}" == RUNNING ]]; then
        echo running
    else
        echo cancelled
    fi
}
# The lead this script asks for (its #SBATCH line: sbatch's command line is not visible here)
# and the time left at a USR1 tell Slurm's lead-time signal (it checks every 30 s: up to ~60 s
# before lead) from a manual `scancel --signal=USR1`.
signal_lead=$(sed -n 's/^#SBATCH --signal=B:USR1@\([0-9][0-9]*\)$/\1/p' "$0" 2>/dev/null) || true
signal_lead=${signal_lead%%$'\n'*}
time_left() {  # seconds until the job's time limit (squeue's EndTime); empty if Slurm does not say
    local end=""
    end=$(squeue -h -j "${SLURM_JOB_ID}" -O 'EndTime' 2>/dev/null || true)
    end=${end//[[:space:]]/}
    [[ "${end}" =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:]+$ ]] || return 0
    end=$(date -d "${end}" +%s 2>/dev/null) || return 0
    echo $((end - $(date +%s)))
}
usr1_reason() {  # why the recorded USR1 came, as the requeue banner says it
    local left=""
    left=$(sed -n 's/^USR1 [^ ]* left=\(-\{0,1\}[0-9][0-9]*\) .*$/\1/p' \
        "${HPC_MCA_SIGNAL_FILE}" 2>/dev/null) || true
    left=${left%%$'\n'*}
    if [[ -z "${left}" ]]; then
        echo "SIGUSR1 (Slurm did not say when the job ends: the time limit's or a manual one)"
    elif [[ "${signal_lead}" =~ ^[0-9]+$ ]] && ((left > signal_lead + 60)); then
        echo "SIGUSR1 ${left} s before the time limit, not the lead-time signal" \
            "(lead ${signal_lead} s): sent by hand (scancel --signal=USR1)"
    else
        echo "time limit ahead (SIGUSR1 ${left} s before the limit)"
    fi
}
# srun's stderr (the ranks' too) goes on to the log; srun's own lines on failed tasks
# ("srun: error: n1: task 0: Killed") are kept to name the rank and how it ended: srun's exit
# code alone says 143 for a rank SIGKILLed while it terminated the others.
srun_stderr() {
    local line=""
    while IFS= read -r line || [[ -n "${line}" ]]; do
        printf '%s\n' "${line}" >&2
        [[ ! "${line}" =~ ^srun:\ error:\ [^:]+:\ tasks?\ [0-9,-]+:\  ]] ||
            printf '%s\n' "${line}" >>"${tasks_file}"
    done
    echo "end" >>"${tasks_file}"
}
ranks_failure() {  # the first failed task as srun saw it, and srun's exit code
    local first="" node="" task="" how="" code=""
    first=$(grep -m 1 '^srun: error: ' "${tasks_file}" 2>/dev/null) || true
    if [[ -z "${first}" ]]; then
        ((rc <= 128)) || code=" (SIG$(kill -l "$((rc - 128))" 2>/dev/null || echo "?"))"
        echo "ranks failed with exit code ${rc}${code}"
        return 0
    fi
    first=${first#srun: error: }
    node=${first%%: *}
    first=${first#*: }
    task=${first%%: *}
    how=${first#*: }
    case "${how}" in
        Killed*) how="killed by SIGKILL" ;;
        Terminated*) how="terminated by SIGTERM" ;;
        "Exited with exit code "*) how="exit code ${how#Exited with exit code }" ;;
    esac
    echo "${task} on ${node} failed: ${how} (srun exit code ${rc})"
}
cancel_file="${HPC_MCA_RUN_DIR}/cancel_requested"
cancel_asked() {  # hpc-mca cancel writes "job=<id> ..." here before it calls scancel
    grep -qs "^job=${SLURM_JOB_ID} " "${cancel_file}"
}

interrupted=0
# shellcheck disable=SC2317  # invoked by the traps below
on_signal() {  # the hook for a requeue protocol: record the request, optionally forward it
    local cause="" left="" note=""
    interrupted=1
    [[ "$1" != TERM ]] || cause=" cause=$(slurm_verdict)"
    if [[ "$1" == USR1 ]]; then  # left= seconds to the time limit (empty: Slurm did not say)
        left=$(time_left)
        note=" (${left:-?} s before the time limit)"
        left=" left=${left}"
    fi
    printf '%s %s%s job=%s restart=%s%s\n' "$1" "$(date +%s.%N)" "${left}" "${SLURM_JOB_ID}" \
        "${SLURM_RESTART_COUNT:-0}" "${cause}" >>"${HPC_MCA_SIGNAL_FILE}"
    banner "signal" "SIG$1${cause:+ (${cause# })}${note} at $(date '+%H:%M:%S'); recorded in ${HPC_MCA_SIGNAL_FILE}"
    if [[ "$1" == USR1 && -n "${HPC_MCA_FORWARD_SIGNAL}" ]]; then
        scancel --signal="${HPC_MCA_FORWARD_SIGNAL}" "${SLURM_JOB_ID}" || true
    fi
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM
((held_usr1 == 0)) || on_signal USR1  # it came before the handler

# srun runs in the background so the traps fire at once; wait again after each signal.
srun --unbuffered --kill-on-bad-exit=1 "${launcher}" "${rank_args[@]}" 2> >(srun_stderr) &
srun_pid=$!
while true; do
    interrupted=0
    rc=0
    wait "${srun_pid}" || rc=$?
    ((interrupted)) || break
done
for _ in {1..50}; do  # srun's last lines reach the log and ${tasks_file} (at most 5 s)
    ! grep -qsx end "${tasks_file}" || break
    sleep 0.1
done

# --- requeue (train, run; contract: hpc_mca/checkpoint/requeue.py) --------------------------
why=""
outcome=""
if ((trains)); then
    verdict=$(slurm_verdict)
    ! cancel_asked || verdict=cancelled
    if [[ -f "${HPC_MCA_RUN_DIR}/finished" ]]; then
        :  # a completed run is never requeued, whatever came late
    elif [[ -s "${bad_input_file}" ]]; then  # whatever srun made of the ranks' exit codes
        outcome="bad input, not requeued: $(head -n 1 "${bad_input_file}")"
        rc=2
    elif [[ "$(df -Pk "${HPC_MCA_RUN_DIR}" | awk 'NR == 2 {print $4}')" == 0 ]]; then
        outcome="the file system of ${HPC_MCA_RUN_DIR} is full: not requeued"
    elif [[ "${verdict}" == cancelled ]]; then
        outcome="cancelled: not requeued"
    elif [[ "${verdict}" == requeued ]]; then
        outcome="requeued by Slurm (scontrol requeue or preemption)"
    elif [[ "${verdict}" == timelimit ]]; then
        why="time limit reached (SIGTERM)"
    elif [[ "${verdict}" == preempted ]]; then
        why="preempted (SIGTERM)"
    elif grep -qs '^USR1 ' "${HPC_MCA_SIGNAL_FILE}"; then
        why=$(usr1_reason)
        # The ranks save and exit 0 (a script's run: 75, stopped) on a USR1: another exit code
        # is a failure, named first.
        first=$(grep -m 1 '^srun: error: ' "${tasks_file}" 2>/dev/null) || true
        ((rc == 0 || rc == 75)) || [[ "${first}" == *": Exited with exit code 75" ]] ||
            why="$(ranks_failure), after ${why}"
    elif ((rc != 0 && rc != 2)) && [[ "${HPC_MCA_REQUEUE_ON_FAILURE}" == 1 ]] &&
        [[ ! -s "${HPC_MCA_SIGNAL_FILE}" ]]; then
        why=$(ranks_failure)  # after a TERM, Slurm or the user decided
    fi
fi
if [[ -n "${why}" ]]; then
    restarts=${SLURM_RESTART_COUNT:-0}
    if ((restarts < HPC_MCA_MAX_REQUEUES)); then
        banner "requeue" "${why}: restart $((restarts + 1)) of at most ${HPC_MCA_MAX_REQUEUES}"
        if ! scontrol requeue "${SLURM_JOB_ID}"; then
            banner "requeue" "scontrol requeue failed: not requeued"
        elif ! cancel_asked; then
            exit 0
        else  # a cancel that raced the requeue (asked after the checks above) still wins
            scancel "${SLURM_JOB_ID}" || true
            outcome="cancelled while being requeued: the requeued job is cancelled"
        fi
    else
        banner "requeue" "${why}: not requeued, retry budget spent (${restarts} restarts)"
    fi
fi
if ((trains)) && [[ ! -f "${HPC_MCA_RUN_DIR}/finished" ]] && ((rc == 0)); then
    rc=75  # the ranks stopped early and the job is not coming back: not a success
fi
banner "end" "${outcome:+${outcome}; }exit code ${rc} after $((SECONDS - started)) s"
exit "${rc}"
"""


def default_script() -> str:
    """The raw template: what ``sbatch/train.sbatch`` holds."""
    return render_script()


if __name__ == "__main__":
    print(default_script(), end="")
