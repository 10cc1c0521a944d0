"""The preflight's verdict on the batch node (``hpc-mca preflight --verdict``).

Every node of the job ran its checks (:mod:`hpc_mca.runtime.node_check`) and wrote
``<run dir>/preflight/<node>.json``; this reads them against the job's nodes
(``HPC_MCA_JOB_NODES``, exported by the batch shell) and decides:

* every node passed: one ``preflight: N nodes passed in X s`` line, exit 0 (train);
* some failed, or wrote no report (crashed, hung past srun's limit, not writable): they go to
  :func:`hpc_mca.slurm.exclusion.decide_for_job` with a reason naming each node and its first
  failure, and the command exits 3: the batch shell requeues the job without them, or ends
  it with the verdict's end line when too few nodes would be left, or when none of them
  could be excluded (the budget is spent: the job would come back onto them).

Whom to blame when the all-reduce fails: a node that never joined it is named by the ones
that did, and only it is blamed (the others merely waited for it); with no one named, the
nodes that saw the all-reduce fail are. Pure Python: no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_mca.rundir import JOB_NODES_ENV, PREFLIGHT_DIR, RUN_DIR_ENV
from hpc_mca.runtime.env import job_nodes_from

from .errors import OpsError
from .exclusion import decide_for_job

EXIT_PASSED = 0
EXIT_EXCLUDE = 3
"""The batch shell's contract: failed nodes were handed to the exclusion (requeue_verdict)."""
_ALL_REDUCE = "all-reduce"


@dataclass(frozen=True)
class Verdict:
    passed: bool
    line: str
    """The one line for the job's log."""
    failed: dict[str, str]
    """Blamed node -> why (its first failure, or that it sent no report)."""
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


def judge(nodes: list[str], reports: Mapping[str, Mapping]) -> Verdict:
    """The verdict for the job's ``nodes`` from their ``reports`` (pure)."""
    failed: dict[str, str] = {}
    absent = {n for r in reports.values() for n in r.get("absent") or () if n in nodes}
    for node in nodes:
        report = reports.get(node)
        if report is None:
            failed[node] = "sent no report"
            continue
        local = _first_failure(report, skip_all_reduce=True)
        if local is not None:
            failed[node] = local
        elif node in absent:
            failed[node] = "never joined the all-reduce"
    if not failed:  # an all-reduce that failed with everyone present: where it was seen
        for node in nodes:
            detail = _first_failure(reports[node], skip_all_reduce=False)
            if detail is not None:
                failed[node] = detail
    if failed:
        parts = [f"{node} failed ({why})" if why != "sent no report" else f"{node} sent no report"
                 for node, why in failed.items()]
        return Verdict(False, f"preflight: {'; '.join(parts)}", failed)
    starts = [float(r["started"]) for r in reports.values() if "started" in r]
    ends = [float(r["started"]) + float(r["seconds"]) for r in reports.values()
            if "started" in r and "seconds" in r]
    seconds = max(ends) - min(starts) if starts and ends else 0.0
    return Verdict(True, f"preflight: {len(nodes)} node(s) passed in {seconds:.1f} s", {},
                   seconds)


def job_nodes(env: Mapping[str, str]) -> list[str]:
    """The job's nodes: the batch shell's list, else Slurm's own (expanded here, as the node
    check does: both must name the same nodes)."""
    nodes = job_nodes_from(env)
    if not nodes:
        raise OpsError(f"{JOB_NODES_ENV} and SLURM_JOB_NODELIST are empty; valid: the job's "
                       "nodes (the batch script exports them)")
    return nodes


def verdict_for_job(env: Mapping[str, str] | None = None) -> tuple[Verdict, int]:
    """Judge this job's reports; hand failed nodes to the exclusion. Returns the verdict and
    the exit code for the batch shell (0 train, 3 requeue_verdict written)."""
    env = os.environ if env is None else env
    run_dir = env.get(RUN_DIR_ENV)
    if not run_dir:
        raise OpsError(f"{RUN_DIR_ENV} is not set; valid: the run directory (the batch "
                       "script exports it)")
    restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    verdict = judge(job_nodes(env), read_reports(Path(run_dir), restart))
    if verdict.passed:
        return verdict, EXIT_PASSED
    # A node that failed its checks fails them again: when none can be excluded (the budget
    # is spent) the job ends instead of coming back onto it once per requeue.
    decide_for_job(Path(run_dir), list(verdict.failed), verdict.line, env, end_over_budget=True)
    return verdict, EXIT_EXCLUDE
