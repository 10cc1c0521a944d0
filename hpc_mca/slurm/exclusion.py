"""Which nodes a job keeps away from when it comes back: the decision after a hang (the
watchdog, :mod:`.watchdog`) or a failed preflight (:mod:`.preflight`), and its record.

A requeued job keeps its id and its options; ``scontrol update job=<id> ExcNodeList=...`` is
the one way to steer its next start off a node, and Slurm accepts it only while the job is
pending. So the batch shell requeues first and then sets the list this module decided (it
traps TERM, so the requeue's own kill leaves it the time to). The decision is made on the
batch node from facts the shell gathered outside any container (squeue, sinfo and scontrol
may be missing inside one), passed in the environment:

* ``HPC_MCA_USABLE_NODES``: the partition's nodes that are not down, drained or failing;
* ``HPC_MCA_JOB_EXCLUDED``: the job's ExcNodeList as it stands (the user's ``--exclude`` and
  earlier exclusions), one name per entry;
* ``HPC_MCA_MAX_EXCLUDED_NODES``: how many nodes the run may exclude in all (its budget).

Named nodes beyond the budget are not excluded (said so); when what is left of the partition
has fewer nodes than the job, the job ends with a line saying so instead of coming back.
Pure Python: no torch.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpc_mca.rundir import EXCLUDED_FILE, REQUEUE_VERDICT_FILE, write_atomic

USABLE_ENV = "HPC_MCA_USABLE_NODES"
JOB_EXCLUDED_ENV = "HPC_MCA_JOB_EXCLUDED"
BUDGET_ENV = "HPC_MCA_MAX_EXCLUDED_NODES"
DEFAULT_BUDGET = 2


@dataclass(frozen=True)
class Exclusion:
    """What the next start keeps away from, and what the batch shell says about it."""

    exclude: tuple[str, ...]
    """The job's whole ExcNodeList after this decision (what it had, plus ``added``)."""
    added: tuple[str, ...] = ()
    """Nodes excluded now."""
    over_budget: tuple[str, ...] = ()
    """Nodes named but not excluded: the run's budget is spent."""
    end: str | None = None
    """Set when the job must not come back: the line it ends with."""
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One clause for the requeue banner."""
        parts = []
        if self.added:
            parts.append(f"excluding {','.join(self.added)} from the next start")
        if self.over_budget:
            parts.append(f"{','.join(self.over_budget)} not excluded: the budget of excluded "
                         f"nodes ({BUDGET_ENV}) is spent")
        return "; ".join(parts) or "no node to exclude"


def _names(value: str | None) -> list[str]:
    return [n for n in (value or "").replace(" ", ",").split(",") if n]


def decide(named: Iterable[str], *, usable: Iterable[str], job_excluded: Iterable[str],
           already: Iterable[str], budget: int, job_nodes: int, job_id: str,
           end_over_budget: bool = False) -> Exclusion:
    """The exclusion for ``named`` nodes (pure). ``already``: the nodes this run excluded
    before (they count against ``budget``); ``job_excluded``: the job's ExcNodeList now.
    ``end_over_budget``: when none of the named nodes can be excluded for the budget, the job
    ends rather than coming back onto them (a failed preflight fails the same way again; a
    hang may not)."""
    named = list(dict.fromkeys(named))
    current = list(dict.fromkeys(job_excluded))
    spent = set(already)
    added: list[str] = []
    over: list[str] = []
    for node in named:
        if node in current or node in added:
            continue
        if len(spent) + len(added) >= budget:
            over.append(node)
        else:
            added.append(node)
    exclude = tuple(current + added)
    left = sorted(set(usable) - set(exclude))
    end = None
    if added and len(left) < job_nodes:
        end = (f"excluding {','.join(added)} would leave {len(left)} usable node(s) "
               f"({','.join(left) or 'none'}) for a {job_nodes}-node job: not requeued; "
               f"continue on fewer nodes with: hpc-mca resume {job_id} --nodes {max(len(left), 1)}")
    elif end_over_budget and over and not added:
        end = (f"not requeued onto {','.join(over)} (the budget of excluded nodes, "
               f"{BUDGET_ENV}={budget}, is spent)")
    return Exclusion(exclude=exclude, added=tuple(added), over_budget=tuple(over), end=end)


def budget_from_env(env: Mapping[str, str] = os.environ) -> int:
    """``HPC_MCA_MAX_EXCLUDED_NODES`` (the batch shell checks it is a whole number)."""
    value = env.get(BUDGET_ENV, "")
    return int(value) if value.isdigit() else DEFAULT_BUDGET


def read_excluded(run_dir: Path) -> list[dict]:
    """The run's exclusion records: ``{"node", "reason", "job", "restart", "time"}`` each."""
    try:
        data = json.loads((Path(run_dir) / EXCLUDED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [r for r in data.get("nodes", []) if isinstance(r, dict) and "node" in r]


def decide_for_job(run_dir: Path, named: Iterable[str], reason: str,
                   env: Mapping[str, str] = os.environ, *, end_over_budget: bool = False) -> Exclusion:
    """:func:`decide` with this job's facts (module docstring), recorded: the new exclusions
    go to ``excluded_nodes.json`` and the verdict for the batch shell to ``requeue_verdict``."""
    run_dir = Path(run_dir)
    records = read_excluded(run_dir)
    job_id = env.get("SLURM_JOB_ID", "")
    exclusion = decide(named, usable=_names(env.get(USABLE_ENV)),
                       job_excluded=_names(env.get(JOB_EXCLUDED_ENV)),
                       already=[r["node"] for r in records], budget=budget_from_env(env),
                       job_nodes=int(env.get("SLURM_JOB_NUM_NODES", "1") or 1), job_id=job_id,
                       end_over_budget=end_over_budget)
    restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    if exclusion.added and exclusion.end is None:
        records += [{"node": node, "reason": reason, "job": job_id, "restart": restart,
                     "time": round(time.time(), 3)} for node in exclusion.added]
        write_atomic(run_dir / EXCLUDED_FILE, json.dumps({"nodes": records}, indent=1) + "\n")
    write_verdict(run_dir, f"{reason}; {exclusion.summary()}",
                  exclude=exclusion.exclude if exclusion.added else (), end=exclusion.end)
    return exclusion


def write_verdict(run_dir: Path, why: str, *, exclude: Iterable[str] = (),
                  end: str | None = None) -> Path:
    """The batch shell's ``requeue_verdict``: one ``key=value`` line each (values on one line)."""
    lines = [f"why={' '.join(why.split())}", f"exclude={','.join(exclude)}",
             f"end={' '.join((end or '').split())}"]
    return write_atomic(Path(run_dir) / REQUEUE_VERDICT_FILE, "\n".join(lines) + "\n")
