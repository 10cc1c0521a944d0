"""``hpc-mca preflight [--verdict]``: the batch script's node checks before training (hidden:
the batch script runs it when ``HPC_MCA_PREFLIGHT=1``; ``hpc-mca submit --preflight`` sets it).

Without ``--verdict``, one task per node under srun: this node's checks and the job's
all-reduce (:mod:`hpc_mca.runtime.node_check`), exit 0 when this node passed, 1 when not.
With ``--verdict``, on the batch node beside the preflight's srun: waits for the nodes'
reports (every node reported or was named absent, srun returned, or the preflight's deadline),
then judges them (:mod:`hpc_mca.slurm.preflight`), exit 0 = train, 3 = failed nodes handed to
the exclusion.
"""

from __future__ import annotations

import os
import sys

import click


@click.command(hidden=True)
# The group's auto_envvar_prefix would read HPC_MCA_PREFLIGHT_VERDICT: the mode is the batch
# script's choice on the command line, never the environment's.
@click.option("--verdict", is_flag=True, allow_from_autoenv=False,
              help="Wait for the nodes' reports on the batch node and judge them instead of "
                   "checking this node.")
def preflight(verdict: bool) -> None:
    """Check this node (devices, memory, run dir, an all-reduce across the job) or, with
    --verdict, wait for every node's report and judge them."""
    if verdict:
        from hpc_mca.slurm.errors import OpsError
        from hpc_mca.slurm.preflight import verdict_for_job

        try:
            result, code = verdict_for_job(wait=True)
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
    sys.stderr.flush()
    # The report is written; a thread may still be blocked in a hung device's check or on the
    # store of a first node that stopped: leave without waiting for it (or for teardown).
    os._exit(0 if report["ok"] else 1)
