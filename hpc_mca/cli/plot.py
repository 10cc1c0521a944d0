"""``hpc-mca plot RUN_DIR|JOBID``: a PNG of the run's loss, eval, LR and throughput curves."""

from __future__ import annotations

from pathlib import Path

import click

from ._options import ops_errors, runs_root_option


@click.command()
@click.argument("run")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG to write; default: <run dir>/curves.png.")
@click.option("--dpi", type=click.IntRange(min=30, max=600), default=100, show_default=True,
              help="Resolution (the figure is 12 inches wide).")
@runs_root_option
def plot(run: str, output: Path | None, dpi: int, runs_root: Path | None) -> None:
    """Plot RUN (a run directory or a job id): training and eval loss, accuracy, learning
    rate, throughput and grad norm, plus MTP and DPO metrics when the run has them.

    Steps come from the run's steps.jsonl, the evaluation history from its TensorBoard event
    files. Works while the job runs (what is written so far).
    """
    from hpc_mca.slurm.manifest import resolve_runs
    from hpc_mca.slurm.plot import plot_run

    with ops_errors():
        found = resolve_runs([run], runs_root)[0]
        target = output if output is not None else found.run_dir / "curves.png"
        titles = plot_run(found.run_dir, target, dpi=dpi)
    click.echo(f"wrote {target}: {', '.join(titles)}")
