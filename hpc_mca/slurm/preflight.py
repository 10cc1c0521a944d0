"""The preflight's verdict on the batch node (``hpc-mca preflight --verdict``).

Every node of the job runs its checks (:mod:`hpc_mca.runtime.node_check`) and writes
``<run dir>/preflight/<node>.json``; beside the preflight's srun this waits for them
(:func:`wait_for_nodes`) until every node of the job (``HPC_MCA_JOB_NODES``, exported by the
batch shell) reported or was named absent by one that did, srun returned, or the preflight's
own deadline (:data:`~hpc_mca.runtime.preflight_records.DEADLINE_S`) passed: a node stopped in
its preflight holds the job no longer (the batch shell then ends the step). While it waits it
names the nodes that are behind, from their phase records, in the preflight's state record
that ``hpc-mca status`` and ``watch`` show. Then it decides:

* every node passed: one ``preflight: N nodes passed in X s`` line, exit 0 (train);
* some failed, or wrote no report (crashed, stopped, not writable): they go to
  :func:`hpc_mca.slurm.exclusion.decide_for_job` with a reason naming each node and its first
  failure, and the command exits 3: the batch shell requeues the job without them, or ends
  it with the verdict's end line when too few nodes would be left, or when none of them
  could be excluded (the budget is spent: the job would come back onto them).

Whom to blame when the all-reduce fails: a node that never joined it, or stopped answering in
it, is named by the ones that did, and only it is blamed (the others merely waited for it);
with no one named, the nodes that saw the all-reduce fail are. Pure Python: no torch.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_mca.rundir import JOB_NODES_ENV, PREFLIGHT_DIR, PREFLIGHT_ENDED_FILE, RUN_DIR_ENV
from hpc_mca.runtime.env import job_nodes_from
from hpc_mca.runtime.preflight_records import DEADLINE_S, PHASES, read_phases, write_state

from .errors import OpsError
from .exclusion import decide_for_job

EXIT_PASSED = 0
EXIT_EXCLUDE = 3
"""The batch shell's contract: failed nodes were handed to the exclusion (requeue_verdict)."""
_ALL_REDUCE = "all-reduce"
SILENT = "sent no report"
NEVER_JOINED = "never joined the all-reduce"
STOPPED = "stopped answering in the all-reduce"
POLL_S = 1.0


@dataclass(frozen=True)
class Verdict:
    passed: bool
    line: str
    """The one line for the job's log."""
    failed: dict[str, str]
    """Blamed node -> why (its first failure; or that it sent no report, never joined the
    all-reduce or stopped answering in it)."""
    seconds: float | None = None


def read_reports(run_dir: Path, restart: int | None = None) -> dict[str, dict]:
    """The nodes' reports by node name; one from another start (``restart`` given and
    different) or unreadable counts as none."""
    reports = {}
    for path in sorted((Path(run_dir) / PREFLIGHT_DIR).glob("*.json")):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(report, dict) or not isinstance(report.get("checks"), list):
            continue
        if restart is not None and report.get("restart") != restart:
            continue
        reports[str(report.get("node", path.stem))] = report
    return reports


def _first_failure(report: Mapping, *, skip_all_reduce: bool) -> str | None:
    for check in report["checks"]:
        if not isinstance(check, dict) or check.get("ok"):
            continue
        if skip_all_reduce and check.get("name") == _ALL_REDUCE:
            continue
        return str(check.get("detail") or check.get("name") or "failed")
    return None


def named_absent(nodes: list[str], reports: Mapping[str, Mapping]) -> dict[str, tuple[str, list[str]]]:
    """Each node of ``nodes`` that a report names -> why (it never joined the all-reduce, or
    stopped answering in it) and the nodes naming it."""
    named: dict[str, tuple[str, list[str]]] = {}
    for key, why in (("absent", NEVER_JOINED), ("stopped", STOPPED)):
        for reporter, report in reports.items():
            for node in report.get(key) or ():
                if node in nodes:
                    named.setdefault(node, (why, []))[1].append(reporter)
    return named


def judge(nodes: list[str], reports: Mapping[str, Mapping], silent: str = SILENT) -> Verdict:
    """The verdict for the job's ``nodes`` from their ``reports`` (pure); ``silent``: what a
    node that wrote no report and that no report names is blamed for."""
    failed: dict[str, str] = {}
    absent = named_absent(nodes, reports)
    for node in nodes:
        report = reports.get(node)
        local = _first_failure(report, skip_all_reduce=True) if report is not None else None
        if local is not None:
            failed[node] = local
        elif node in absent:
            failed[node] = absent[node][0]
        elif report is None:
            failed[node] = silent
    if not failed:  # an all-reduce that failed with everyone present: where it was seen
        for node in nodes:
            detail = _first_failure(reports[node], skip_all_reduce=False)
            if detail is not None:
                failed[node] = detail
    if failed:
        parts = [f"{node} {why}" if why.startswith((SILENT, NEVER_JOINED, STOPPED)) else f"{node} failed ({why})"
                 for node, why in failed.items()]
        return Verdict(False, f"preflight: {'; '.join(parts)}", failed)
    starts = [float(r["started"]) for r in reports.values() if "started" in r]
    ends = [float(r["started"]) + float(r["seconds"]) for r in reports.values()
            if "started" in r and "seconds" in r]
    seconds = max(ends) - min(starts) if starts and ends else 0.0
    return Verdict(True, f"preflight: {len(nodes)} node(s) passed in {seconds:.1f} s", {},
                   seconds)


@dataclass(frozen=True)
class Waiting:
    """Where the preflight stands while the batch node waits (:func:`waiting`)."""

    settled: bool
    """Every node reported or was named absent by one that did: nothing left to wait for."""
    line: str
    behind: tuple[str, ...] = ()
    """The nodes the others wait for: those that have not reported, in the earliest phase."""


def _clock(stamp: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(stamp))


def _doing(phase: tuple[str, float] | None) -> str:
    """What a node that has not reported is doing, by its phase record (times, not counters:
    the line changes only when a node moves on)."""
    if phase is None:
        return "no sign of its preflight yet"
    name, since = phase
    if name == "checks":
        return f"in its local checks since {_clock(since)}"
    if name == "all-reduce":
        return f"reached the all-reduce at {_clock(since)} and has not joined it"
    return f"in the all-reduce since {_clock(since)}"


def waiting(nodes: list[str], reports: Mapping[str, Mapping],
            phases: Mapping[str, tuple[str, float]], started: float,
            deadline_s: float = DEADLINE_S) -> Waiting:
    """Whom the preflight still waits for (pure): the nodes that neither reported nor were
    named absent; named first, those in the earliest phase (the others wait for them)."""
    absent = named_absent(nodes, reports)
    missing = [n for n in nodes if n not in reports and n not in absent]
    if not missing:
        return Waiting(True, "")
    order = {name: i for i, name in enumerate(PHASES)}
    rank = {n: order[phases[n][0]] if n in phases else -1 for n in missing}
    behind = [n for n in missing if rank[n] == min(rank.values())]
    who = ", ".join(f"{n} ({_doing(phases.get(n))})" for n in behind[:4])
    who += f" and {len(behind) - 4} more" if len(behind) > 4 else ""
    named = "".join(f"; {n} {why} (named by {','.join(by[:3])})" for n, (why, by) in absent.items()
                    if n not in reports)
    line = (f"preflight since {_clock(started)} (deadline {_clock(started + deadline_s)}): waiting "
            f"for {who}{named}; {len(reports)} of {len(nodes)} node(s) reported")
    return Waiting(False, line, tuple(behind))


def wait_for_nodes(run_dir: Path, nodes: list[str], restart: int, *, job: str = "",
                   deadline_s: float = DEADLINE_S, poll_s: float = POLL_S,
                   clock: Callable[[], float] = time.time,
                   sleep: Callable[[float], None] = time.sleep) -> tuple[dict[str, dict], str]:
    """Wait until every node reported or was named absent, srun returned (the batch shell's
    ``step_ended``) or ``deadline_s`` passed. Returns the reports and what a silent node is
    blamed for; the state record says whom it waits for meanwhile."""
    run_dir = Path(run_dir)
    ended = run_dir / PREFLIGHT_DIR / PREFLIGHT_ENDED_FILE
    started, shown = clock(), ""
    while True:
        gone = ended.exists()  # before the reports: those srun's nodes wrote are all there
        reports = read_reports(run_dir, restart)
        now = clock()
        state = waiting(nodes, reports, read_phases(run_dir, restart), started, deadline_s)
        if state.settled or gone:
            return reports, SILENT
        if now - started >= deadline_s:
            return reports, f"{SILENT} within the preflight's deadline ({deadline_s:.0f} s)"
        if state.line != shown:
            write_state(run_dir, job=job, restart=restart, started=started, line=state.line,
                        done=False)
            shown = state.line
        sleep(poll_s)


def job_nodes(env: Mapping[str, str]) -> list[str]:
    """The job's nodes: the batch shell's list, else Slurm's own (expanded here, as the node
    check does: both must name the same nodes)."""
    nodes = job_nodes_from(env)
    if not nodes:
        raise OpsError(f"{JOB_NODES_ENV} and SLURM_JOB_NODELIST are empty; valid: the job's "
                       "nodes (the batch script exports them)")
    return nodes


def verdict_for_job(env: Mapping[str, str] | None = None, *, wait: bool = False,
                    deadline_s: float = DEADLINE_S) -> tuple[Verdict, int]:
    """Judge this job's reports (``wait``: once :func:`wait_for_nodes` is done waiting for
    them); hand failed nodes to the exclusion. Returns the verdict and the exit code for the
    batch shell (0 train, 3 requeue_verdict written)."""
    env = os.environ if env is None else env
    run_dir = env.get(RUN_DIR_ENV)
    if not run_dir:
        raise OpsError(f"{RUN_DIR_ENV} is not set; valid: the run directory (the batch "
                       "script exports it)")
    restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    nodes, job, started = job_nodes(env), env.get("SLURM_JOB_ID", ""), time.time()
    if wait:
        reports, silent = wait_for_nodes(Path(run_dir), nodes, restart, job=job,
                                         deadline_s=deadline_s)
    else:
        reports, silent = read_reports(Path(run_dir), restart), SILENT
    verdict = judge(nodes, reports, silent)
    write_state(Path(run_dir), job=job, restart=restart, started=started, line=verdict.line,
                done=True, passed=verdict.passed)
    if verdict.passed:
        return verdict, EXIT_PASSED
    # A node that failed its checks fails them again: when none can be excluded (the budget
    # is spent) the job ends instead of coming back onto it once per requeue.
    decide_for_job(Path(run_dir), list(verdict.failed), verdict.line, env, end_over_budget=True)
    return verdict, EXIT_EXCLUDE
