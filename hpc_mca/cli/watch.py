"""``hpc-mca watch JOBID``: a live progress bar until the job ends; exits with its final state."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ._options import ops_errors, runs_root_from, runs_root_option

interval_option = click.option(
    "--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
    help="Seconds between polls of Slurm and the run's progress.json.")


def follow_job(job_id: str, runs_root: Path, interval: float, run_dir: Path | None = None) -> None:
    """Watch ``job_id`` on stdout and leave with the exit status of its final state (shared by
    watch, submit --wait and resume --wait)."""
    from hpc_mca.slurm.watch import watch as watch_job

    try:
        with ops_errors():
            last = watch_job(job_id, runs_root, sys.stdout, interval=interval, run_dir=run_dir)
    except KeyboardInterrupt:
        click.echo(f"\nstopped watching; job {job_id} keeps running (hpc-mca cancel {job_id} "
                   "stops it)", err=True)
        raise SystemExit(130) from None
    raise SystemExit(last.exit_status)


@click.command()
@click.argument("job_id")
@interval_option
@runs_root_option
def watch(job_id: str, interval: float, runs_root: Path | None) -> None:
    """Follow JOBID until it ends: step/total, loss, tokens/s, ETA and requeues from the run's
    progress.json (squeue's reason while it is pending), then its final state.

    On a terminal the line is a bar redrawn in place; otherwise one line per change.
    Exit status: 0 COMPLETED, 3 FAILED, 4 CANCELLED, 5 TIMEOUT/DEADLINE, 6 OUT_OF_MEMORY,
    7 NODE_FAIL/BOOT_FAIL/PREEMPTED; 1 when the job cannot be followed; 130 on Ctrl-C (the
    job keeps running).
    """
    follow_job(job_id, runs_root_from(runs_root), interval)
