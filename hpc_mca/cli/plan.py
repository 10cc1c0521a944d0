"""``hpc-mca plan``: the layout a job would get, as a table (and its batch script); submits
nothing."""

from __future__ import annotations

from pathlib import Path

import click

from ._options import ops_errors, plan_options, plan_options_from, slurm_options, submit_options_from


@click.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.argument("overrides", nargs=-1)
@plan_options
@slurm_options
@click.option("--sbatch", "show_sbatch", is_flag=True,
              help="Print the exact batch script submit would submit (the table goes to stderr).")
def plan(config: Path | None, overrides: tuple[str, ...], show_sbatch: bool, **options) -> None:
    """Plan TP/PP/CP/EP/DP, micro-batch, recompute and memory for a job; submit nothing.

    CONFIG is a run config (YAML) with key=value OVERRIDES, as for submit; without one, give
    --model. Sizes set on the command line or in the config are checked, not searched.
    """
    from hpc_mca.slurm.jobplan import make_job_plan
    from hpc_mca.slurm.submit import checked_job
    from hpc_mca.topology import format_plan_table

    with ops_errors():
        job = make_job_plan(plan_options_from(options), config, overrides)
        # The same checks as submit: a plan is only shown for a job that would be submitted.
        rendered = (checked_job(job, submit_options_from(options))
                    if config is not None or show_sbatch else None)
        table = format_plan_table(job.plan)
        if job.plan_overrides:
            table += "\n  trainer     " + " ".join(job.plan_overrides)
        if not show_sbatch:
            click.echo(table)
            return
        click.echo(table, err=True)
        click.echo(rendered.script, nl=False)
