"""Process-group setup: the one place that brings up torch.distributed and Megatron-Core.

``init_distributed`` runs on every rank, in this order:

1. read the rank environment (Slurm step, torchrun, or single process) — ``runtime.env``;
2. validate the requested layout against the world size and the model, and raise
   ``LayoutError`` *before* any collective, so that every rank fails alone with the same
   one-line message instead of some ranks waiting forever in a rendezvous;
3. pick the device and backend: NCCL on CUDA (one GPU per local rank), gloo otherwise, in
   which case the CPU compatibility patches (``runtime.cpu_compat``) are activated (on a
   GPU without Transformer Engine, only the one that a missing TE needs);
4. ``torch.distributed.init_process_group`` over TCP at MASTER_ADDR:MASTER_PORT (a single
   local process uses an in-memory store instead), with the collective timeout the caller
   passes (``training.ddp_timeout``) unless HPC_MCA_DIST_TIMEOUT overrides it;
5. ``parallel_state.initialize_model_parallel`` for TP/PP/VP/CP/EP/expert-TP;
6. seeds: Python, NumPy, torch and Megatron's model-parallel RNG tracker.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
from typing import Callable, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from hpc_mca.errors import BadInputOnRankZero, UserError
from hpc_mca.runtime import cpu_compat
from hpc_mca.runtime.env import RankEnv, from_environ
from hpc_mca.runtime.host_memory import register_pinned_host_memory
from hpc_mca.topology import Layout, LayoutError, ModelShape, check_layout
from hpc_mca.topology.errors import raise_if

__all__ = ["RankContext", "collective_timeout_s", "describe_process_group", "init_distributed", "shutdown"]

_DEFAULT_TIMEOUT_S = 1800
"""transformers' ``ddp_timeout`` default, this config's ``training.ddp_timeout`` default too."""
TIMEOUT_ENV = "HPC_MCA_DIST_TIMEOUT"
"""Seconds; when set, it wins over the ``timeout_s`` a caller passes (the test suite and the
smoke scripts shorten every collective's wait so that a hang fails within minutes)."""


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What a rank knows after bootstrap."""

    env: RankEnv
    layout: Layout
    """The layout with ``dp`` resolved from the world size."""
    device: torch.device
    backend: str
    """'nccl' or 'gloo'."""
    seed: int

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def init_distributed(
    layout: Layout,
    *,
    model: ModelShape | None = None,
    seed: int = 1234,
    env: RankEnv | None = None,
    timeout_s: float | None = None,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
) -> RankContext:
    """Bring up torch.distributed and Megatron-Core model parallelism on this rank.

    Raises ``LayoutError`` (one violation per line) without touching the network when the
    layout cannot work for this world size or model.
    """
    env = env or from_environ()
    violations = check_layout(layout, env.world_size, model, global_batch_size=global_batch_size,
                              micro_batch_size=micro_batch_size)
    if violations:
        raise LayoutError(violations)
    layout = layout.resolved(env.world_size)

    device, backend = _select_device(env)
    timeout_s = float(os.environ.get(TIMEOUT_ENV) or timeout_s or _DEFAULT_TIMEOUT_S)
    if not dist.is_initialized():
        # A single local process has nobody to meet: an in-process store, no TCP port. (A port
        # found free can be taken by another process before the store binds it: EADDRINUSE,
        # seen in CI with two test lanes side by side.)
        rendezvous = ({"store": dist.HashStore()} if env.launcher == "single"
                      else {"init_method": env.init_method})
        dist.init_process_group(
            backend=backend,
            **rendezvous,
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    _init_model_parallel(layout)
    _seed_everything(seed)
    return RankContext(env=env, layout=layout, device=device, backend=backend, seed=seed)


def describe_process_group() -> str:
    """One line for the run log: the default group's backend, size and the timeout its
    collectives actually run with (read back from the group, not from the config)."""
    timeout = collective_timeout_s()
    seconds = "unknown" if timeout is None else f"{int(timeout)} s"
    return (f"process group: {dist.get_backend()}, {dist.get_world_size()} rank(s), "
            f"collective timeout {seconds}")


def collective_timeout_s() -> float | None:
    """The default group's collective timeout in seconds, read back from the group; None
    without a group or on a torch without these internals."""
    if not dist.is_initialized():
        return None
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    try:  # torch keeps the timeout on the backend object, not on the public group
        group = dist.distributed_c10d._get_default_group()
        return group._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


T = TypeVar("T")


def rank_zero_first(build: Callable[[], T], is_main: bool) -> T:
    """``build()`` on global rank 0, then on the other ranks (rank 0 fills a cache they read:
    tokenized data). A collective: every rank calls it. Bad input rank 0 finds reaches every
    rank: rank 0 raises its UserError, the others a :class:`~hpc_mca.errors.BadInputOnRankZero`
    with its message, so the whole job exits 2 together instead of the other ranks crashing in
    their next collective."""
    verdict: list[str | None] = [None]
    if is_main:
        try:
            result = build()
        except UserError as err:
            err.on_every_rank = True
            verdict[0] = str(err)
            dist.broadcast_object_list(verdict, src=0)
            raise
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise BadInputOnRankZero(verdict[0])
    return result if is_main else build()


def _select_device(env: RankEnv) -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        raise_if(ranks_per_gpu_violations(env.local_world_size, torch.cuda.device_count()))
        register_pinned_host_memory()  # before torch reads its allocator settings: host_memory.py
        local = env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(local)
        cpu_compat.activate()  # on a GPU: only what a missing Transformer Engine needs
        return torch.device("cuda", local), "nccl"
    cpu_compat.activate()
    return torch.device("cpu"), "gloo"


def ranks_per_gpu_violations(ranks_on_node: int, gpus_on_node: int) -> list[str]:
    """NCCL gives each rank its own GPU: two ranks on one device fail inside NCCL ("invalid
    usage") after the rendezvous. Said in one line before it instead."""
    if ranks_on_node <= gpus_on_node:
        return []
    return [f"{ranks_on_node} ranks on this node but {gpus_on_node} GPU(s) visible: NCCL needs "
            f"one GPU per rank; valid: at most {gpus_on_node} ranks per node "
            "(--ntasks-per-node / --nproc-per-node, or --gpus-per-node for hpc-mca submit)"]


def _init_model_parallel(layout: Layout) -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )


def _seed_everything(seed: int) -> None:
    """Same base seed on every rank; Megatron's tracker derives the per-TP-rank streams
    (dropout inside tensor-parallel regions) and the expert-parallel streams from it."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
