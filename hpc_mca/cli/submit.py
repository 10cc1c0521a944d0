"""``hpc-mca submit``: plan a job, render its batch script, submit it, write its run dir."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from ._options import ops_errors, plan_options, plan_options_from, slurm_options, submit_options_from
from .watch import follow_job, interval_option


@click.command()
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("overrides", nargs=-1)
@plan_options
@slurm_options
@click.option("--preflight", is_flag=True, envvar="HPC_MCA_SUBMIT_PREFLIGHT",
              help="Before training, at every start of the job, each node checks its devices "
                   "(count, free memory, a matmul) and joins an all-reduce across the job; a "
                   "failing node is excluded and the job requeued [$HPC_MCA_SUBMIT_PREFLIGHT].")
@click.option("--wait", is_flag=True,
              help="Then follow the job like hpc-mca watch and exit with its final state.")
@interval_option
def submit(config: Path, overrides: tuple[str, ...], preflight: bool, wait: bool,
           interval: float, **options: object) -> None:
    """Submit a training job: every rank runs `hpc-mca train CONFIG OVERRIDES...`.

    CONFIG may instead be a Python script (SCRIPT.py ARGS...: one using hpc-mca's API, e.g.
    hpc_mca/assets/demo/api_sft.py); every rank then runs `hpc-mca run SCRIPT.py ARGS...`,
    the planner needs --model (the model the script trains), and the planned layout reaches
    the script's TrainingArguments through $HPC_MCA_PLAN_OVERRIDES, its run dir through
    $HPC_MCA_RUN_DIR.

    The layout is planned from the config's model and the job size (see hpc-mca plan); the
    run directory <runs root>/<job name>_<job id> gets the script, a manifest, the log and
    everything the trainer writes.

    With --wait, a progress bar follows the job until it ends; the exit status is its final
    state's (0 COMPLETED; the others as hpc-mca watch documents).
    """
    from hpc_mca.slurm.jobplan import make_job_plan, make_script_plan
    from hpc_mca.slurm.submit import submit as submit_job

    with ops_errors():
        if config.suffix == ".py":
            job = make_script_plan(plan_options_from(options), config, overrides)
        else:
            job = make_job_plan(plan_options_from(options), config, overrides)
        submit_options = dataclasses.replace(submit_options_from(options), preflight=preflight)
        done = submit_job(job, submit_options, ["hpc-mca", *sys.argv[1:]])
    req = job.plan.request
    click.echo(f"submitted job {done.job_id}: {req.nodes} node(s) × {req.node_size} "
               f"{req.gpu_spec.name}, {job.plan.describe()}")
    click.echo(f"  run dir   {done.run_dir}")
    click.echo(f"  log       {done.log}")
    click.echo(f"  manifest  {done.manifest}")
    click.echo(f"  watch     hpc-mca status {done.job_id}  |  hpc-mca logs {done.job_id} -f  |  "
               f"hpc-mca tensorboard {done.job_id}  |  hpc-mca cancel {done.job_id}")
    if wait:
        follow_job(done.job_id, Path(done.run_dir).parent, interval, run_dir=Path(done.run_dir))
