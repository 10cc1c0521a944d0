"""The batch shell's own text, which :mod:`.script` renders around the ``#SBATCH`` lines and
the knobs: the header's usage notes (``USAGE``, ``USAGE_TAIL``), the start that must come
before any knob is read (``BODY_START``: the held USR1, the sbatch check) and the body
(``BODY``: rank arguments, the job-start plan, the banner, signal records, srun, the requeue
decision of :mod:`hpc_mca.checkpoint.requeue`'s contract). Kept apart from the renderer: it
is bash, checked by shellcheck on the rendered ``sbatch/train.sbatch`` and by the golden
renders in ``tests/golden/sbatch``.
"""

USAGE = """\
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

USAGE_TAIL = """\
# bin/hpc-mca-rank reads more on every node: HPC_MCA_PYTHON, HPC_MCA_MODULES and the
# container wrapper HPC_MCA_CONTAINER_RUNTIME (apptainer|singularity|enroot),
# HPC_MCA_CONTAINER_IMAGE, HPC_MCA_CONTAINER_MOUNTS.
#
# Rendered by hpc_mca/slurm/script.py (hpc-mca submit renders the same template)."""

BODY_START = """\
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

BODY = r"""if [[ ! "${HPC_MCA_MAX_REQUEUES}" =~ ^[0-9]+$ ]]; then  # it meets bash arithmetic below
    echo "hpc-mca: HPC_MCA_MAX_REQUEUES='${HPC_MCA_MAX_REQUEUES}' must be a whole number" >&2
    exit 2
fi
if [[ ! "${HPC_MCA_MAX_EXCLUDED_NODES}" =~ ^[0-9]+$ ]]; then
    echo "hpc-mca: HPC_MCA_MAX_EXCLUDED_NODES='${HPC_MCA_MAX_EXCLUDED_NODES}' must be a whole number" >&2
    exit 2
fi
if [[ ! "${HPC_MCA_PREFLIGHT}" =~ ^[01]$ ]]; then
    echo "hpc-mca: HPC_MCA_PREFLIGHT='${HPC_MCA_PREFLIGHT}' is not valid; valid: 0, 1" >&2
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
verdict_file="${HPC_MCA_RUN_DIR}/requeue_verdict"  # the watchdog's or the preflight's
ended_file="${HPC_MCA_RUN_DIR}/ranks_ended"  # srun returned: the watchdog stops
# A request, a rank's bad-input verdict, heartbeats and verdicts belong to the run that wrote them.
rm -f "${HPC_MCA_SIGNAL_FILE}" "${bad_input_file}" "${tasks_file}" "${verdict_file}" \
    "${ended_file}"
rm -rf "${HPC_MCA_RUN_DIR}/heartbeat" "${HPC_MCA_RUN_DIR}/preflight"
if ((trains)); then  # the ranks' heartbeats, for the hang watchdog (hpc_mca/slurm/watchdog.py)
    export HPC_MCA_HEARTBEAT_DIR="${HPC_MCA_RUN_DIR}/heartbeat"
fi
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
requeues_file="${HPC_MCA_RUN_DIR}/requeues"  # why each requeue: hpc-mca status and watch show it
record_requeue() {  # best effort: the requeue goes ahead whatever the file system says
    printf 'time=%s job=%s restart=%s why=%s\n' "$(date +%s)" "${SLURM_JOB_ID}" \
        "${SLURM_RESTART_COUNT:-0}" "${1//$'\n'/ }" >>"${requeues_file}" 2>/dev/null || true
}
cancel_file="${HPC_MCA_RUN_DIR}/cancel_requested"
cancel_asked() {  # hpc-mca cancel writes "job=<id> ..." here before it calls scancel
    grep -qs "^job=${SLURM_JOB_ID} " "${cancel_file}"
}

# For hpc_mca/slurm/exclusion.py, gathered here (squeue, sinfo and scontrol may be missing in
# a container): the partition's nodes that can run jobs, the job's ExcNodeList and its nodes,
# expanded (comma-separated names).
node_facts() {
    local usable="" excluded="" nodes=""
    usable=$(sinfo -h -N -p "${SLURM_JOB_PARTITION:-}" -o '%N %t' 2>/dev/null |
        awk '$2 !~ /(down|drain|drng|fail|maint|boot|futr|inval|\*)/ {print $1}' |
        sort -u | paste -sd, -) || true
    excluded=$(scontrol show job -o "${SLURM_JOB_ID}" 2>/dev/null |
        sed -n 's/.* ExcNodeList=\([^ ]*\).*/\1/p') || true
    if [[ -n "${excluded}" && "${excluded}" != "(null)" ]]; then
        excluded=$(scontrol show hostnames "${excluded}" 2>/dev/null | paste -sd, -) || excluded=""
    else
        excluded=""
    fi
    nodes=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | paste -sd, -) || true
    export HPC_MCA_USABLE_NODES="${usable}" HPC_MCA_JOB_EXCLUDED="${excluded}" HPC_MCA_JOB_NODES="${nodes}"
}
# shellcheck disable=SC2317  # invoked by on_hang (and after the preflight's verdict)
kill_ranks() {  # every job step but this shell's: SIGKILL reaches a stopped (frozen) rank too
    local step=""
    while read -r step; do
        [[ "${step}" == *.batch || "${step}" == *.extern ]] || scancel --signal=KILL "${step}" || true
    done < <(squeue -h -s -j "${SLURM_JOB_ID}" -o '%i' 2>/dev/null || true)
}
v_why=""
v_exclude=""
v_end=""
read_verdict() {  # requeue_verdict's why=, exclude= and end= lines
    local key="" value=""
    while IFS='=' read -r key value; do
        case "${key}" in
            why) v_why=${value} ;;
            exclude) v_exclude=${value} ;;
            end) v_end=${value} ;;
        esac
    done <"${verdict_file}"
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

((trains == 0)) || node_facts

# --- preflight (train, HPC_MCA_PREFLIGHT=1): every node checks itself before training ----------
rc=0
skip=0    # no training this start
judged=0  # the preflight's verdict excluded nodes
if ((trains)) && [[ "${HPC_MCA_PREFLIGHT}" == 1 ]]; then
    # One task per node; each bounds its own checks and the all-reduce. Beside it the verdict
    # waits until every node reported or was named absent by the others, srun returned, or the
    # preflight's deadline (hpc_mca/slurm/preflight.py): a node stopped in its preflight holds
    # the job no longer than that, its step is killed here (srun's --time is only a backstop).
    # A node that fails (or never reports) is excluded and the job requeued by the verdict.
    pre_ended="${HPC_MCA_RUN_DIR}/preflight/step_ended"  # srun returned: the verdict stops waiting
    (
        srun --unbuffered --ntasks-per-node=1 --ntasks="${SLURM_JOB_NUM_NODES:-1}" \
            --kill-on-bad-exit=0 --time=10 "${launcher}" preflight || true
        { mkdir -p "${pre_ended%/*}" && : >"${pre_ended}"; } || true
    ) &
    pre_pid=$!
    pre_rc=0
    "${launcher}" preflight --verdict || pre_rc=$?
    for i in {1..350}; do  # nodes that reported leave at once (5 s); after a kill, 30 s more
        [[ ! -e "${pre_ended}" ]] || break
        if ((i == 50)); then
            banner "preflight" "a node still runs its preflight: killing the step at $(date '+%H:%M:%S')"
            kill_ranks
        fi
        sleep 0.1
    done
    if [[ -e "${pre_ended}" ]]; then
        wait "${pre_pid}" || true
    else
        banner "preflight" "the preflight's srun did not end after SIGKILL: going on without it"
    fi
    if ((pre_rc == 3)); then  # failed nodes: ${verdict_file} says which and what to exclude
        skip=1
        judged=1
    elif ((pre_rc != 0)) && [[ -s "${HPC_MCA_SIGNAL_FILE}" ]]; then
        skip=1  # a TERM ended the verdict (scancel, a requeue, the time limit): Slurm's view decides
    elif ((pre_rc != 0)); then
        banner "end" "the preflight's verdict failed (exit code ${pre_rc}), not requeued"
        exit "${pre_rc}"
    fi
fi

# --- training -------------------------------------------------------------------------------
# srun runs in the background so the traps fire at once; wait again after each signal. The
# hang watchdog (train, run) reads the ranks' heartbeats beside it: after it left a verdict
# for a job that stopped making progress it exits 3, and its subshell (outside any container)
# tells this shell with USR2: the ranks are killed here. (wait -n PID needs bash 5.1.)
hung=0
# shellcheck disable=SC2317  # invoked by the trap below
on_hang() {
    interrupted=1
    ((hung == 0)) || return 0
    hung=1
    read_verdict
    banner "hang" "${v_why}; killing the ranks at $(date '+%H:%M:%S')"
    kill_ranks
}
if ((skip == 0)); then
    trap 'on_hang' USR2
    srun --unbuffered --kill-on-bad-exit=1 "${launcher}" "${rank_args[@]}" 2> >(srun_stderr) &
    srun_pid=$!
    watch_pid=""
    if ((trains)); then
        (
            watch_rc=0
            "${launcher}" watchdog || watch_rc=$?
            ((watch_rc != 3)) || kill -USR2 "$$"
        ) &
        watch_pid=$!
    fi
    while true; do
        interrupted=0
        rc=0
        wait "${srun_pid}" || rc=$?
        ((interrupted)) || break
    done
    if [[ -n "${watch_pid}" ]]; then  # the ranks ended: nothing left to watch
        # The file stops a watchdog that the TERM misses: on a loaded node ranks that end at
        # once can beat the subshell to starting it (hpc_mca.rundir.RANKS_ENDED_FILE).
        : >"${ended_file}"
        pkill -TERM -P "${watch_pid}" 2>/dev/null || true
        wait "${watch_pid}" 2>/dev/null || true
    fi
    trap - USR2
    for _ in {1..50}; do  # srun's last lines reach the log and ${tasks_file} (at most 5 s)
        ! grep -qsx end "${tasks_file}" || break
        sleep 0.1
    done
fi

# --- requeue (train, run; contract: hpc_mca/checkpoint/requeue.py) --------------------------
why=""
outcome=""
exclude=""
outside=0
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
        record_requeue "${outcome}"
        # The job comes back: this start did not fail (exit 75 would leave accounting a FAILED
        # batch step per outside requeue). srun's own code is in the line.
        ((rc == 0)) || outcome+=" after srun's exit code ${rc}"
        rc=0
        outside=1
    elif ((hung || judged)); then  # the watchdog's or the preflight's verdict
        read_verdict
        if [[ -n "${v_end}" ]]; then
            outcome="${v_why}: ${v_end}"
            rc=75
        else
            why=${v_why}
            exclude=${v_exclude}
        fi
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
        # The requeue TERMs every process of the job, this shell and its children included:
        # ignored from here (children inherit it), so that neither scontrol below dies
        # mid-call; Slurm's SIGKILL follows only KillWait later.
        trap '' TERM
        if ! scontrol requeue "${SLURM_JOB_ID}"; then
            banner "requeue" "scontrol requeue failed: not requeued"
        elif ! cancel_asked; then
            record_requeue "${why}"
            # Slurm takes an ExcNodeList only while the job is pending: now.
            if [[ -n "${exclude}" ]]; then
                if scontrol update job="${SLURM_JOB_ID}" ExcNodeList="${exclude}"; then
                    banner "exclude" "the next start runs without ${exclude}"
                else
                    banner "exclude" "scontrol update ExcNodeList=${exclude} failed: the next start may use them"
                fi
            fi
            exit 0
        else  # a cancel that raced the requeue (asked after the checks above) still wins
            scancel "${SLURM_JOB_ID}" || true
            outcome="cancelled while being requeued: the requeued job is cancelled"
        fi
    else
        banner "requeue" "${why}: not requeued, retry budget spent (${restarts} restarts)"
    fi
fi
if ((trains && !outside)) && [[ ! -f "${HPC_MCA_RUN_DIR}/finished" ]] && ((rc == 0)); then
    rc=75  # the ranks stopped early and the job is not coming back: not a success
fi
banner "end" "${outcome:+${outcome}; }exit code ${rc} after $((SECONDS - started)) s"
exit "${rc}"
"""
