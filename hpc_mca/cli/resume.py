"""``hpc-mca resume JOBID [--nodes N]``: continue a run from its latest checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from ._options import ops_errors, runs_root_from, runs_root_option, signal_lead_option
from .watch import follow_job, interval_option


@click.command()
@click.argument("job_id")
@click.argument("overrides", nargs=-1)
@click.option("--nodes", type=int, default=None, help="Nodes of the new job; default: as before.")
@click.option("--gpus-per-node", type=int, default=None, help="Ranks per node; default: as before.")
@click.option("--gpu", default=None,
              help="GPU preset (H100-80GB, ..., CPU); default: as before (a raw-template job "
                   "records its preset in job_plan.json; one from before that: H100-80GB).")
@click.option("--tp", type=int, default=None, help="Force the tensor-parallel size.")
@click.option("--pp", type=int, default=None, help="Force the pipeline-parallel size.")
@click.option("--vp", type=int, default=None, help="Force the virtual-pipeline size.")
@click.option("--ep", type=int, default=None, help="Force the expert-parallel size.")
@click.option("--distributed-optimizer/--no-distributed-optimizer", default=None,
              help="Must match the checkpoint's optimizer (checked); default: the checkpoint's.")
@click.option("--time", default=None, help="Time limit of the new job; default: as before.")
@click.option("--partition", default=None, help="Slurm partition; default: as before.")
@signal_lead_option
@click.option("--dry-run", is_flag=True, help="Check and print the batch script; submit nothing.")
@click.option("--wait", is_flag=True,
              help="Then follow the new job like hpc-mca watch and exit with its final state.")
@interval_option
@runs_root_option
def resume(job_id: str, overrides: tuple[str, ...], nodes: int | None, gpus_per_node: int | None,
           gpu: str | None, tp: int | None, pp: int | None, vp: int | None, ep: int | None,
           distributed_optimizer: bool | None, time: str | None, partition: str | None,
           signal_lead: int | None, dry_run: bool, wait: bool, interval: float,
           runs_root: Path | None) -> None:
    """Continue the run of JOBID from its latest checkpoint in a new job (same run directory),
    optionally on another number of nodes: the layout is planned anew for the new size
    (the checkpoint reshards over TP/PP/DP) unless --tp/--pp/... force it. OVERRIDES are extra
    key=value settings for the trainer (e.g. max_steps=2000).

    A finished run can be extended: give a larger max_steps (or num_train_epochs); the LR
    schedule is re-derived for the new total from the finished step on.

    Everything is checked first (job, checkpoint, layout, config); on a problem nothing is
    submitted and nothing deleted.
    """
    from hpc_mca.slurm.continuation import plan_continuation, submit_continuation
    from hpc_mca.slurm.timelimit import continuation_warning

    changes = {"gpus_per_node": gpus_per_node, "gpu": gpu, "tp": tp, "pp": pp, "vp": vp, "ep": ep,
               "distributed_optimizer": distributed_optimizer}
    with ops_errors():
        cont = plan_continuation(job_id, runs_root_from(runs_root), nodes=nodes,
                                 overrides=overrides, plan_changes=changes,
                                 slurm_changes={"time": time, "partition": partition,
                                                "signal_lead_s": signal_lead})
        warning = continuation_warning(cont.run.run_dir, cont.script)
        if warning:  # a lead that fits the limit but not the run's start-up (timelimit.py)
            click.echo(warning, err=True)
        if dry_run:
            click.echo(cont.script, nl=False)
            click.echo(f"# would continue {cont.describe()}")
            return
        new_id = submit_continuation(cont)
    click.echo(f"submitted job {new_id}: continues {cont.describe()}")
    click.echo(f"  log       {cont.log(new_id)}")
    click.echo(f"  watch     hpc-mca status {new_id}  |  hpc-mca logs {new_id} -f")
    if wait:
        follow_job(new_id, runs_root_from(runs_root), interval)
