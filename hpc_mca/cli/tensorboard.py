"""``hpc-mca tensorboard [JOBID|RUN_DIR ...]``: TensorBoard on loopback over chosen runs."""

from __future__ import annotations

from pathlib import Path

import click

from ._options import ops_errors, runs_root_from, runs_root_option


@click.command()
@click.argument("runs", nargs=-1)
@runs_root_option
@click.option("--port", type=int, default=None, help="Port to bind; default: a free one.")
def tensorboard(runs: tuple[str, ...], runs_root: Path | None, port: int | None) -> None:
    """Start TensorBoard bound to 127.0.0.1 over RUNS (job ids or run dirs; default: every
    run under the runs root) and print the ssh tunnel command that reaches it."""
    from hpc_mca.slurm.manifest import resolve_runs
    from hpc_mca.slurm.tensorboard import exec_tensorboard, plan_launch

    root = runs_root_from(runs_root)
    with ops_errors():
        found = resolve_runs(list(runs), root)
        launch = plan_launch(found, root, port)
    what = ", ".join(str(r.run_dir) for r in found) or f"every run under {root}"
    click.echo(f"TensorBoard on {launch.url} (bound to 127.0.0.1 only) for {what}")
    click.echo(f"from your machine: {launch.tunnel}   then open http://localhost:{launch.port}/")
    exec_tensorboard(launch)
