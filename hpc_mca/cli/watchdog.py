"""``hpc-mca watchdog``: the batch script's hang watchdog (hpc_mca/slurm/watchdog.py); not a
command for users, hidden from ``--help``."""

from __future__ import annotations

import signal
import sys

import click


@click.command(hidden=True)
def watchdog() -> None:
    """Watch the ranks' heartbeats of this job ($HPC_MCA_RUN_DIR); exit 3 after a hang."""
    from hpc_mca.rundir import run_dir_from_env
    from hpc_mca.slurm.watchdog import watch

    # The batch shell stops it with TERM once the ranks ended: a normal end, not a kill
    # (bash would print "Terminated" into the job log).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_dir = run_dir_from_env()
    if run_dir is None:
        raise click.UsageError("HPC_MCA_RUN_DIR is not set: the batch script runs this command")
    sys.exit(watch(run_dir))
