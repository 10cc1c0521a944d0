"""Where am I? Rank, world and rendezvous address from Slurm, torchrun, or nothing.

Pure Python (no torch): the launcher chooses how ranks are started, this module reads the
answer from the environment in one place.

Precedence:
1. torchrun / torch.distributed.elastic (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set by
   the agent) — also when torchrun itself runs inside a Slurm allocation.
2. A Slurm job step started by ``srun`` (SLURM_STEP_ID is set): ranks from SLURM_PROCID /
   SLURM_NTASKS / SLURM_LOCALID, MASTER_ADDR = first host of the job's node list, MASTER_PORT
   derived from the job id so concurrent jobs sharing a node don't collide.
3. Otherwise a single process on localhost.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Mapping

# submitit's node-list parser (prefix[ranges],...), the one its own SlurmJobEnvironment uses.
from submitit.slurm.slurm import _parse_node_list

from hpc_mca.rundir import JOB_NODES_ENV

# The port window used for MASTER_PORT derived from a Slurm job id: above the well-known and
# registered ranges commonly used by daemons, below Linux's default ephemeral range (32768+)
# so the OS does not hand the port to an outgoing connection first.
_PORT_BASE = 15000
_PORT_SPAN = 17000


@dataclasses.dataclass(frozen=True)
class RankEnv:
    """The identity of this process in the job."""

    rank: int
    """Global rank, 0..world_size-1."""
    world_size: int
    """Number of processes in the job (all nodes)."""
    local_rank: int
    """Rank on this node: selects the GPU."""
    local_world_size: int
    """Processes on this node."""
    master_addr: str
    """Host of rank 0, used for the TCP rendezvous."""
    master_port: int
    """Port of the TCP rendezvous."""
    launcher: str
    """'torchrun', 'slurm' or 'single'."""
    job_id: str | None = None
    """Slurm job id when running under Slurm (also under torchrun inside an allocation)."""
    restart_count: int = 0
    """SLURM_RESTART_COUNT: how many times Slurm requeued this job."""

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def port_for_job(job_id: str) -> int:
    """A rendezvous port that is a pure function of the job id (every rank computes it alone).

    Array jobs ("123_4") hash the whole id so tasks of one array differ.
    """
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    return _PORT_BASE + int(digits) % _PORT_SPAN


def from_environ(environ: Mapping[str, str] | None = None) -> RankEnv:
    """Read the rank environment. ``environ`` defaults to ``os.environ`` (tests pass dicts)."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_ARRAY_JOB_ID") and f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '0')}"
    job_id = job_id or env.get("SLURM_JOB_ID")
    restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env, job_id, restarts)
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return _from_slurm_step(env, job_id or "0", restarts)
    return RankEnv(0, 1, 0, 1, "127.0.0.1", int(env.get("MASTER_PORT", 0)) or free_port(),
                   "single", job_id, restarts)


def _from_torchrun(env: Mapping[str, str], job_id: str | None, restarts: int) -> RankEnv:
    world = int(env["WORLD_SIZE"])
    return RankEnv(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        launcher="torchrun",
        job_id=job_id,
        restart_count=restarts,
    )


def _from_slurm_step(env: Mapping[str, str], job_id: str, restarts: int) -> RankEnv:
    # In a step, SLURM_STEP_NUM_TASKS is the step's size; SLURM_NTASKS may describe the whole
    # allocation when srun was asked for fewer tasks than the job holds.
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    hosts = parse_nodelist(nodelist) if nodelist else ["127.0.0.1"]
    # An explicit MASTER_PORT (e.g. exported by a site's sbatch wrapper) wins over the derived one.
    port = int(env.get("MASTER_PORT") or port_for_job(job_id))
    return RankEnv(
        rank=int(env["SLURM_PROCID"]),
        world_size=world,
        local_rank=int(env.get("SLURM_LOCALID", "0")),
        local_world_size=_tasks_on_this_node(env, world),
        master_addr=env.get("MASTER_ADDR") or hosts[0],
        master_port=port,
        launcher="slurm",
        job_id=job_id,
        restart_count=restarts,
    )


def _tasks_on_this_node(env: Mapping[str, str], world: int) -> int:
    # SLURM_STEP_TASKS_PER_NODE looks like "2(x3),1": counts per node in node order.
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return world
    counts: list[int] = []
    for part in spec.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else counts[-1]


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``"gpu[01-03,07],login1"``."""
    return list(_parse_node_list(nodelist))


def job_nodes_from(env: Mapping[str, str]) -> list[str]:
    """The job's nodes in Slurm's order: the batch script's expanded ``HPC_MCA_JOB_NODES``,
    else ``SLURM_JOB_NODELIST`` expanded here (empty outside a job)."""
    nodes = [n for n in env.get(JOB_NODES_ENV, "").split(",") if n]
    if not nodes and env.get("SLURM_JOB_NODELIST"):
        nodes = parse_nodelist(env["SLURM_JOB_NODELIST"])
    return nodes


def free_port() -> int:
    """A currently free TCP port on localhost (single-process runs only: no other rank needs it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
