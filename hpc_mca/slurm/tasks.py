"""Which node a job step's task (rank) runs on, from the variables Slurm gives the batch
script: ``SLURM_JOB_NODELIST`` (a hostlist, ``n[1-3,7]``) and ``SLURM_TASKS_PER_NODE``
(``4(x2),2``: counts in node order). srun's default block distribution places tasks
``0..c0-1`` on the first node, the next ``c1`` on the second, and so on. The hang watchdog
names a rank that never wrote a heartbeat by its node this way (it has no file to say where
it runs)."""

from __future__ import annotations

import re
import subprocess
from functools import cached_property

__all__ = ["TaskLayout", "expand_counts"]

UNKNOWN = "unknown node"


def expand_counts(tasks_per_node: str) -> list[int]:
    """``"4(x2),2"`` → ``[4, 4, 2]``; [] for text that is not in Slurm's form."""
    counts: list[int] = []
    for part in filter(None, tasks_per_node.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return []
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


class TaskLayout:
    """A step's block layout: :meth:`node_of` a task; hostnames expanded by ``scontrol``
    (Slurm's own hostlist syntax), once, when first needed."""

    def __init__(self, nodelist: str, tasks_per_node: str) -> None:
        self.nodelist, self.counts = nodelist, expand_counts(tasks_per_node)

    @cached_property
    def hosts(self) -> list[str]:
        if not self.nodelist:
            return []
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", self.nodelist], capture_output=True,
                                 text=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return out.split()

    def node_of(self, task: int) -> str:
        """The node of ``task``, or :data:`UNKNOWN` where the variables do not tell."""
        first = 0
        for host, count in zip(self.hosts, self.counts):
            if task < first + count:
                return host
            first += count
        return UNKNOWN
