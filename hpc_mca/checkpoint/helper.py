"""Where the checkpoint writer sends its write results: an in-process queue for synchronous
saves, a helper process for async ones (started early, deaf to Slurm's signals, and dead with
the rank that started it).

``megatron.core.dist_checkpointing`` sends every save's write results through a queue served
by a spawned multiprocessing Manager (``filesystem_async.get_write_results_queue``, created
on first use), even when the shards are written by the rank itself. Only an async save needs
a process-safe queue (its writer is a forked process). For synchronous saves (the default)
:func:`keep_write_results_in_process` puts a plain ``queue.Queue`` where Megatron looks: no
helper process per rank (its spawn and torch import cost 2-3 s of CPU at every start, and the
first save waited for them), nothing to outlive a killed rank.

For async saves, spawning the Manager also starts multiprocessing's resource tracker. Two
things about those processes matter on a cluster:

* Slurm signals every process of the job step. At a preemption, ``scancel`` or an outside
  ``scontrol requeue`` a helper with the default TERM action would die while the ranks go on
  to save, and that save would fail (ConnectionRefusedError). So the helper is spawned with
  TERM and USR1 ignored (it inherits SIG_IGN).
* A rank that is SIGKILLed cannot stop its children, and the helper ignores TERM: it lived on
  for minutes, holding the step's output pipe, so slurmstepd waited 60 s ("Abandoning IO")
  before the requeue, and the restarted job was killed again. So the helper asks the kernel
  for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``, Linux); the resource tracker then
  sees its pipe close and exits too.

Megatron creates that Manager with ``ctx.Manager()`` and no initializer; :func:`start_writer_helper`
creates the same object first, with :func:`die_with_parent` as its initializer, and leaves it
where Megatron looks for it (``filesystem_async._results_queue``). Imports no torch at module
level (the helper process imports this module to run the initializer).
"""

from __future__ import annotations

import os
import queue
import signal
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_manager: Any = None
"""The helper's Manager, kept alive with the process (a collected Manager stops its server)."""


def die_with_parent(parent_pid: int) -> None:
    """Initializer of the helper process: the kernel SIGKILLs it when the thread that started
    it (the rank's main thread) ends; if that already happened, exit now. A no-op where
    prctl does not exist (not Linux)."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(0)


def keep_write_results_in_process() -> None:
    """Synchronous saves: the write results stay in this process (a ``queue.Queue`` where
    Megatron looks for its results queue; idempotent)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def start_writer_helper() -> None:
    """Start the write-results helper now (idempotent), deaf to TERM/USR1, dying with this
    process. Main thread only: signal.signal, and PR_SET_PDEATHSIG follows the creating
    thread. The window in which this rank's own TERM would be ignored is the spawn itself;
    the batch shell's record of the signal still reaches the ranks through the signal file."""
    global _manager
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _manager = manager
    filesystem_async._results_queue = manager.Queue()


def warm_writer_helper() -> None:
    """Make the helper import what it unpickles (torch, torch.distributed.checkpoint) while
    training runs: done lazily, that adds ~1 s to the first save, often the one a stop signal
    waits for."""
    import torch
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        get_write_results_queue,
    )
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    try:
        results = get_write_results_queue()
        results.put([torch.zeros(1), WriteResult(MetadataIndex("warm-up"), 0,
                                                 _StorageInfo("", 0, 0))])
        results.get()
    except (OSError, EOFError, RuntimeError):  # an optimisation only: the first save does it
        return
