"""``hpc-mca cancel JOBID``: end a job of hpc-mca's for good (no requeue)."""

from __future__ import annotations

from pathlib import Path

import click

from ._options import ops_errors, runs_root_from, runs_root_option


@click.command()
@click.argument("job_id")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until Slurm reports the job ended (the ranks may save first).")
@click.option("--timeout", type=float, default=120.0, show_default=True,
              help="Seconds to wait for the end.")
@runs_root_option
def cancel(job_id: str, wait: bool, timeout: float, runs_root: Path | None) -> None:
    """Cancel JOBID (pending or running) for good: it is not requeued, whatever signals came
    before. Its run dir, checkpoints and log stay; hpc-mca resume JOBID continues the run."""
    from hpc_mca.slurm.cancel import cancel_job

    with ops_errors():
        done = cancel_job(job_id, runs_root_from(runs_root), wait_s=timeout if wait else 0)
    if not done.cancelled:
        click.echo(f"job {job_id} already ended ({done.was}); nothing to cancel")
        return
    end = f"; now {done.now}" if done.now else ""
    click.echo(f"cancelled job {job_id} ({done.name}, was {done.was}{end})")
