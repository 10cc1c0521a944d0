"""``hpc-mca train CONFIG.yaml [key=value ...]``: the rank command of a training job."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click

from ._rank_errors import exit_bad_input, global_rank


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("config", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def train(config: Path, overrides: tuple[str, ...]) -> None:
    """Train with CONFIG (YAML), overridden by key=value pairs, e.g. training.max_steps=20.

    Every rank of a job runs this (srun, torchrun or a single process). Bad inputs (unknown
    keys, missing datasets, impossible layouts, model/weights mismatches, a tokenizer larger
    than the model's vocabulary, an attention backend this machine does not have) stop every
    rank before anything is allocated; data errors rank 0 finds while it tokenizes, and a
    checkpoint that does not fit the disk, are shared with the other ranks. Every rank exits 2,
    rank 0 prints the one line and leaves it in the run directory, so the job is never
    requeued for it.
    """
    from hpc_mca.runtime import heartbeat

    heartbeat.begin()  # first: a rank that freezes while it starts is watched too
    from hpc_mca.runtime.quiet import quiet_library_noise

    quiet_library_noise()  # before megatron is imported
    from hpc_mca.errors import UserError
    from hpc_mca.launch.run import run_training

    try:
        run_training(config, overrides)
    except UserError as err:
        exit_bad_input("train", err)
    if global_rank() == 0:
        plot_loss(config, overrides)


PLOT_FILE = "training_loss.png"
"""``training.plot_loss``: the PNG rank 0 writes into output_dir (LLaMA-Factory's name)."""


def plot_loss(config: Path, overrides: Sequence[str]) -> None:
    """``training.plot_loss``: draw the run's curves as ``hpc-mca plot`` does, into output_dir.
    Here rather than in the backends: the drawing lives with the login-side commands, above
    them. A failed drawing is reported and leaves the run's result alone."""
    from hpc_mca.config.loading import load_config
    from hpc_mca.rundir import STEPS_FILE

    training = load_config(config, overrides).training
    run_dir = Path(training.output_dir)
    if not training.plot_loss or not (run_dir / STEPS_FILE).is_file():
        return
    from hpc_mca.errors import UserError
    from hpc_mca.slurm.plot import plot_run

    try:
        titles = plot_run(run_dir, run_dir / PLOT_FILE)
    except (UserError, OSError, ValueError) as err:
        click.echo(f"hpc-mca train: training.plot_loss: no plot ({err})", err=True)
        return
    click.echo(f"training.plot_loss: wrote {run_dir / PLOT_FILE}: {', '.join(titles)}")
