"""``hpc-mca logs JOBID [-f]``: print or follow a job's log."""

from __future__ import annotations

from pathlib import Path

import click

from ._options import ops_errors, runs_root_from, runs_root_option


@click.command()
@click.argument("job_id")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
@click.option("-n", "--lines", type=int, default=None, help="Start with the last N lines.")
@runs_root_option
def logs(job_id: str, follow: bool, lines: int | None, runs_root: Path | None) -> None:
    """Print the log of JOBID (batch script and every rank, appended across requeues)."""
    from hpc_mca.slurm.logs import follow as follow_log
    from hpc_mca.slurm.logs import log_path, show

    with ops_errors():
        path = log_path(job_id, runs_root_from(runs_root))
        if not follow:
            show(path, lines)
            return
        click.echo(f"==> {path} (until job {job_id} ends; Ctrl-C stops)", err=True)
        try:
            state = follow_log(path, job_id, lines)
        except KeyboardInterrupt:
            return
        click.echo(f"==> job {job_id} {state or 'ended'}", err=True)
