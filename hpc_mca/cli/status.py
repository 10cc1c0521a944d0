"""``hpc-mca status [JOBID]``: Slurm state joined with the run's progress."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ._options import ops_errors, runs_root_from, runs_root_option


@click.command()
@click.argument("job_id", required=False)
@runs_root_option
@click.option("--limit", type=int, default=10, show_default=True,
              help="Without JOBID: how many of the newest runs to list.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(job_id: str | None, runs_root: Path | None, limit: int, as_json: bool) -> None:
    """Show a job's state, step/total, loss, tokens/s, ETA, last checkpoint and requeues.

    Without JOBID, list the newest runs under the runs root.
    """
    from hpc_mca.slurm.status import format_status, format_table, job_status, recent_statuses

    root = runs_root_from(runs_root)
    with ops_errors():
        if job_id is not None:
            one = job_status(job_id, root)
            click.echo(json.dumps(one.to_dict(), indent=1) if as_json else format_status(one))
            return
        many = recent_statuses(root, limit)
    if as_json:
        click.echo(json.dumps([st.to_dict() for st in many], indent=1))
    else:
        click.echo(format_table(many))
