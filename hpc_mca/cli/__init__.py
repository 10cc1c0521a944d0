"""The ``hpc-mca`` command line: a Click group whose commands are imported on first use.

Login-node commands (``--help``, ``plan``, ``submit``, ``status``...) must stay instant, so
neither this module nor the group imports torch or megatron; each command module imports its
heavy dependencies inside the command function.
"""

from __future__ import annotations

import importlib

import click

# name -> "module:function". One module per command under hpc_mca/cli/.
_COMMANDS: dict[str, str] = {
    "cancel": "hpc_mca.cli.cancel:cancel",
    "export": "hpc_mca.cli.export:export",
    "logs": "hpc_mca.cli.logs:logs",
    "plan": "hpc_mca.cli.plan:plan",
    "plot": "hpc_mca.cli.plot:plot",
    "preflight": "hpc_mca.cli.preflight:preflight",
    "resume": "hpc_mca.cli.resume:resume",
    "run": "hpc_mca.cli.run:run",
    "smoke": "hpc_mca.cli.smoke:smoke",
    "status": "hpc_mca.cli.status:status",
    "submit": "hpc_mca.cli.submit:submit",
    "tensorboard": "hpc_mca.cli.tensorboard:tensorboard",
    "train": "hpc_mca.cli.train:train",
    "watch": "hpc_mca.cli.watch:watch",
    "watchdog": "hpc_mca.cli.watchdog:watchdog",
}


class LazyGroup(click.Group):
    """A group that resolves its subcommands from ``_COMMANDS`` only when they are invoked
    (``--help`` lists them with their short help, which is read from the command object, so
    listing imports the command modules but not what the commands themselves import)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "HPC_MCA"})
@click.version_option(package_name="hpc-mca")
def main() -> None:
    """hpc-mca: Megatron-Core training on Slurm clusters.

    Login-node commands plan and submit jobs; rank commands (smoke, train, run) are what every
    process of a job runs, under srun or torchrun.
    """
