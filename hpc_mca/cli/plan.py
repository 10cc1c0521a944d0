"""``hpc-mca plan``: the layout a job would get, as a table (and its batch script); submits
nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hpc_mca.errors import UserError

if TYPE_CHECKING:
    from hpc_mca.slurm.jobplan import JobPlan

from ._options import ops_errors, plan_options, plan_options_from, slurm_options, submit_options_from


@click.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.argument("overrides", nargs=-1)
@plan_options
@slurm_options
@click.option("--sbatch", "show_sbatch", is_flag=True,
              help="Print the exact batch script submit would submit (the table goes to stderr).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the plan and the trainer overrides as JSON instead of the table.")
@click.option("--explain", is_flag=True,
              help="Also show the 5 fastest layouts the planner compared (with a forced layout: "
                   "it, then the search's), each with its estimated step time by cost term.")
@click.option("--dry-run", is_flag=True,
              help="Also build the planned ranks' model, DDP and optimizer on the meta device "
                   "(one process, a fake process group) and print their exact bytes beside the "
                   "planner's estimate; refuse a layout that does not fit.")
@click.option("--rank", "ranks", type=int, multiple=True,
              help="With --dry-run: the global rank(s) to build; default: the first and last "
                   "pipeline stage's.")
@click.option("--at-job-start", is_flag=True, hidden=True,
              help="Inside a batch job (the raw template): plan for its allocation, record "
                   "$HPC_MCA_RUN_DIR/job_plan.json, print the overrides (hpc_mca/slurm/startplan.py).")
def plan(config: Path | None, overrides: tuple[str, ...], show_sbatch: bool, as_json: bool,
         explain: bool, dry_run: bool, ranks: tuple[int, ...], at_job_start: bool,
         **options: object) -> None:
    """Plan TP/PP/CP/EP/DP, micro-batch, recompute and memory for a job; submit nothing.

    CONFIG is a run config (YAML) with key=value OVERRIDES, as for submit; without one, give
    --model. Sizes set on the command line or in the config are checked, not searched.
    """
    if at_job_start:  # the size comes from the allocation, not from these options
        from hpc_mca.slurm.startplan import main

        raise SystemExit(main(config, overrides))
    if ranks and not dry_run:
        raise click.UsageError("--rank applies to --dry-run; valid: add --dry-run")
    if as_json and show_sbatch:
        raise click.UsageError("--json and --sbatch print different things; valid: one of them")
    from hpc_mca.slurm.jobplan import make_job_plan, make_script_plan, plan_summary
    from hpc_mca.slurm.submit import checked_job
    from hpc_mca.topology import format_plan_table
    from hpc_mca.topology.report import explain_rows, format_explain

    with ops_errors():
        if config is not None and config.suffix == ".py":  # a script: see hpc-mca submit --help
            job = make_script_plan(plan_options_from(options), config, overrides)
        else:
            job = make_job_plan(plan_options_from(options), config, overrides)
        # The same checks as submit: a plan is only shown for a job that would be submitted.
        rendered = (checked_job(job, submit_options_from(options))
                    if config is not None or show_sbatch else None)
        if as_json:
            out: dict[str, object] = {"plan": plan_summary(job.plan),
                                      "plan_overrides": list(job.plan_overrides)}
            if explain:
                out["explain"] = explain_rows(job.plan)
            click.echo(json.dumps(out, indent=1))
            return
        table = format_plan_table(job.plan)
        if job.plan_overrides:
            table += "\n  trainer     " + " ".join(job.plan_overrides)
        if explain:
            table += "\n" + format_explain(job.plan)
        if dry_run:
            table += "\n" + _dry_run(job, list(ranks))
        if not show_sbatch:
            click.echo(table)
            return
        click.echo(table, err=True)
        assert rendered is not None  # rendered above whenever show_sbatch is set
        click.echo(rendered.script, nl=False)


def _dry_run(job: JobPlan, ranks: list[int]) -> str:
    """The dry run's table; its refusals (the trainer's, or a layout that does not fit) as
    the command's one-line error."""
    from hpc_mca.slurm.errors import OpsError
    from hpc_mca.slurm.jobplan import load_train_config
    from hpc_mca.trainer.dry_run_report import dry_run_plan

    finetuning = (load_train_config(job.config_path, job.user_overrides).finetuning
                  if job.config_path is not None else None)
    try:
        return dry_run_plan(job.plan, ranks=ranks or None, finetuning=finetuning)
    except UserError as err:  # LayoutError, ModelLoadError: what the trainer would say
        raise OpsError(f"dry run: {err}") from None
