"""Local ranks forked from one process that imported the training stack once.

Usage: ``python -m hpc_mca.cli.forkrun --nproc-per-node N train CONFIG [key=value ...]``
(any ``hpc-mca`` command after the launcher's own option, or a Python script ``SCRIPT.py ARGS``
as torchrun runs one).

A rank's imports — torch, Megatron-Core (which pulls in torch.compile's machinery) and
transformers' trainer utilities — cost ~11 s of CPU on the 2-core VM, more than a short run
trains. torchrun starts every rank as a fresh interpreter that pays them again; this launcher
pays them once, then forks the ranks (``torch.multiprocessing.start_processes`` with the fork
start method), each with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, and OMP_NUM_THREADS=1 unless set; like torchrun's agent,
the launcher hosts the rendezvous store and the ranks join it), so the ranks run
exactly the code they run under torchrun or srun. Forking is safe here because importing
starts no Python thread and touches no accelerator (checked before forking: a launcher with
another Python thread by then refuses to fork); the one native thread ``import torch`` leaves
is the one every DataLoader worker forked after importing torch inherits too. For one node
only; jobs on a cluster start their ranks with srun.

Exit status: 0 when every rank succeeded, else the first failing rank's own status (2 for a
bad input, 75 for a stop to be requeued), 1 for a rank that raised or was killed. A rank that
fails leaves the others ``GRACE_S`` seconds to end by themselves (a bad input stops every rank
alike) before they are terminated, as torchrun's agent does.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import threading
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from multiprocessing.queues import SimpleQueue

GRACE_S = 15.0


def preload(args: Sequence[str]) -> bool:
    """Import what every rank of ``hpc-mca ARGS`` imports; False when nothing was preloaded
    (a ``train`` config that does not load: the ranks report it themselves)."""
    from hpc_mca.runtime.quiet import quiet_library_noise

    quiet_library_noise()  # before megatron is imported, as the train command does
    if args[:1] == ["train"] and len(args) > 1:
        from hpc_mca.config.loading import load_config
        from hpc_mca.errors import UserError
        from hpc_mca.loop.trackers import skip_unused_tracker_imports

        try:
            report_to = load_config(args[1], args[2:]).training.report_to
        except (UserError, OSError):
            return False
        skip_unused_tracker_imports(report_to)
    import megatron.core  # noqa: F401
    import transformers.trainer_callback  # noqa: F401

    import hpc_mca.launch.run  # noqa: F401
    import hpc_mca.models.build  # noqa: F401
    import hpc_mca.trainer.trainer  # noqa: F401
    return True


def _rank(local_rank: int, nproc: int, ports: SimpleQueue[int], args: list[str]) -> None:
    # The launcher hosts the rendezvous store, as torchrun's agent does: every rank joins it as
    # a client (TORCHELASTIC_USE_AGENT_STORE), on the port the launcher bound after the fork.
    port = ports.get()
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        # torchrun's default for several ranks on a node: one intra-op thread each (torch
        # read the variable at import, before the fork, so it is set on torch too).
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    run_command(args)


def run_command(args: list[str]) -> None:
    """Run ``hpc-mca ARGS`` in this process, or ``SCRIPT.py ARGS`` as ``python`` would run it."""
    if args[0].endswith(".py"):
        sys.argv = list(args)
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")
        return
    from hpc_mca.cli import main

    main(args=args, prog_name="hpc-mca")


def launch(nproc: int, args: list[str]) -> int:
    """Run ``hpc-mca ARGS`` as ``nproc`` local ranks; the exit status described above."""
    import multiprocessing

    from torch.distributed import TCPStore
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException, start_processes

    if threading.active_count() > 1:
        raise RuntimeError("forkrun: the launcher has threads after its imports; forking it is unsafe")
    sys.stdout.flush()
    sys.stderr.flush()
    ports = multiprocessing.get_context("fork").SimpleQueue()
    context = start_processes(_rank, args=(nproc, ports, args), nprocs=nproc, join=False,
                              start_method="fork")
    # Bound here, after the fork (the store's server thread must not be forked), on a port the
    # kernel picks: a port found free and bound later by rank 0 could be taken in between.
    store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    for _ in range(nproc):
        ports.put(store.port)
    try:
        while not context.join(grace_period=GRACE_S):
            pass
    except ProcessExitedException as failed:
        return failed.exit_code if failed.exit_code > 0 else 1
    except ProcessRaisedException as failed:
        print(failed, file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_mca.cli.forkrun",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", type=int, required=True, metavar="N")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="an hpc-mca command and its arguments, or SCRIPT.py and its arguments")
    opts = parser.parse_args(argv)
    if opts.nproc_per_node < 1:
        parser.error(f"--nproc-per-node {opts.nproc_per_node}: needs at least 1")
    if not opts.args:
        parser.error("no hpc-mca command given (e.g. train CONFIG)")
    preload(opts.args)
    return launch(opts.nproc_per_node, list(opts.args))


if __name__ == "__main__":
    sys.exit(main())
