"""``hpc-mca run SCRIPT.py [ARGS ...]``: a rank command that runs a Python training script.

The script (one written against ``from hpc_mca import TrainingArguments, AutoModel,
McaTrainer``) runs in this process as ``__main__``, with ``sys.argv = [SCRIPT, *ARGS]`` and
its folder first on ``sys.path``, as ``python SCRIPT.py ARGS`` would run it. What this adds is
the failure contract every rank command of a job keeps (``hpc-mca train``'s): a bad input
(:class:`hpc_mca.errors.UserError`) that escapes the script becomes one line, a bad-input
record in the run directory and exit status 2, so the batch script never requeues it; a
``SystemExit`` keeps its code (75: ``McaTrainer.train()`` stopped for a requeue); anything
else is a crash (traceback, exit status 1).

Under srun, torchrun (``torchrun --nproc-per-node 2 -m hpc_mca run SCRIPT.py``) or
``hpc-mca submit SCRIPT.py``, each rank reads who it is from the environment, as ``train``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ._rank_errors import exit_bad_input


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("script", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(script: Path, args: tuple[str, ...]) -> None:
    """Run the Python training SCRIPT on this rank with ARGS as its command line.

    Bad input the script's hpc-mca calls raise stops the rank with one line and exit status 2
    (recorded in the run directory: the job is not requeued); the script's own sys.exit codes
    pass through (75: stopped to be requeued); any other exception is a crash (exit status 1).
    """
    from hpc_mca.runtime.quiet import quiet_library_noise

    quiet_library_noise()  # before the script imports megatron
    from hpc_mca.errors import UserError

    try:
        run_script(script, args)
    except UserError as err:
        exit_bad_input("run", err)


def run_script(script: Path, args: tuple[str, ...]) -> None:
    """``python SCRIPT ARGS`` in this process: ``__main__``, its argv and its folder on the path."""
    import runpy

    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        sys.stdout.flush()
