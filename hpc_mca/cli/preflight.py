"""``hpc-mca preflight [--verdict]``: the batch script's node checks before training (hidden:
the batch script runs it when ``HPC_MCA_PREFLIGHT=1``; ``hpc-mca submit --preflight`` sets it).

Without ``--verdict``, one task per node under srun: this node's checks and the job's
all-reduce (:mod:`hpc_mca.runtime.node_check`), exit 0 when this node passed, 1 when not.
With ``--verdict``, on the batch node: the nodes' reports judged
(:mod:`hpc_mca.slurm.preflight`), exit 0 = train, 3 = failed nodes handed to the exclusion.
"""

from __future__ import annotations

import os
import sys

import click


@click.command(hidden=True)
# The group's auto_envvar_prefix would read HPC_MCA_PREFLIGHT_VERDICT: the mode is the batch
# script's choice on the command line, never the environment's.
@click.option("--verdict", is_flag=True, allow_from_autoenv=False,
              help="Judge the nodes' reports on the batch node instead of checking this node.")
def preflight(verdict: bool) -> None:
    """Check this node (devices, memory, run dir, an all-reduce across the job) or, with
    --verdict, judge every node's report."""
    if verdict:
        from hpc_mca.slurm.errors import OpsError
        from hpc_mca.slurm.preflight import verdict_for_job

        try:
            result, code = verdict_for_job()
        except OpsError as err:
            raise click.ClickException(str(err)) from None
        click.echo(result.line)
        sys.exit(code)
    from hpc_mca.runtime.node_check import PreflightInputError, run

    try:
        report = run()
    except PreflightInputError as err:
        raise click.ClickException(str(err)) from None
    sys.stdout.flush()
    if any("did not finish" in c["detail"] for c in report["checks"]):
        # A check still runs in its thread (a hung device): leave without waiting for it.
        os._exit(1)
    sys.exit(0 if report["ok"] else 1)
