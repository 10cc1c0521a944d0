"""``hpc-mca cancel JOBID``: scancel a job of hpc-mca's."""

from __future__ import annotations

import click

from ._options import ops_errors


@click.command()
@click.argument("job_id")
def cancel(job_id: str) -> None:
    """Cancel JOBID (pending or running). Its run dir and log stay."""
    from hpc_mca.slurm import commands
    from hpc_mca.slurm.errors import OpsError

    with ops_errors():
        state = commands.job_state(commands.check_job_id(job_id))
        if state is None:
            raise OpsError(f"job {job_id} is unknown to Slurm (squeue, sacct); valid: a job id "
                           "from hpc-mca status")
        if state.finished:
            click.echo(f"job {job_id} already ended ({state.state}); nothing to cancel")
            return
        commands.run(["scancel", job_id])
    click.echo(f"cancelled job {job_id} ({state.name}, was {state.state})")
