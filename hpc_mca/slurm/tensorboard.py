"""``hpc-mca tensorboard``: TensorBoard over chosen runs, on loopback, plus the ssh tunnel.

TensorBoard binds to 127.0.0.1 only (the login node is shared; nobody else should reach a
user's runs), on a free port picked here. The user reaches it through an ssh tunnel from
their own machine, whose command is printed. TensorBoard scans each directory it is given
recursively; runs are named after their jobs (see :func:`logdir_args`).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from hpc_mca.rundir import TENSORBOARD_DIR

from . import commands
from .errors import OpsError
from .manifest import Run

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def logdir_args(runs: list[Run], runs_root: Path) -> list[str]:
    """TensorBoard's log-directory arguments for ``runs`` (all of ``runs_root`` when empty).

    The trainer writes its event files to ``<run dir>/tensorboard/<run dir name>``
    (:func:`hpc_mca.rundir.tensorboard_dir`); pointed at ``<run dir>/tensorboard``,
    TensorBoard names each run after its job (``sft_addition_19``). Several runs go in one
    ``--logdir_spec`` of unnamed absolute paths, which keeps those names."""
    if not runs:
        return ["--logdir", str(runs_root)]
    dirs = [_events_root(run.run_dir) for run in runs]
    if len(dirs) == 1:
        return ["--logdir", str(dirs[0])]
    bad = [str(d) for d in dirs if "," in str(d)]
    if bad:
        raise OpsError(f"run directory {bad[0]!r} contains ',', which TensorBoard's "
                       "--logdir_spec cannot carry; valid: a run directory without ','")
    return ["--logdir_spec", ",".join(str(d) for d in dirs)]


def _events_root(run_dir: Path) -> Path:
    events = run_dir.absolute() / TENSORBOARD_DIR
    return events if events.is_dir() else run_dir.absolute()


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    port: int
    url: str
    tunnel: str


def plan_launch(runs: list[Run], runs_root: Path, port: int | None = None) -> Launch:
    """The TensorBoard command line and what to tell the user."""
    port = port or free_port()
    argv = [sys.executable, "-m", "tensorboard.main", "--host", HOST, "--port", str(port),
            *logdir_args(runs, runs_root)]
    login = socket.getfqdn()
    if not login or login.startswith("localhost"):
        login = socket.gethostname()
    user = commands.current_user()
    tunnel = f"ssh -N -L {port}:{HOST}:{port} {user}@{login}"
    return Launch(argv, port, f"http://{HOST}:{port}/", tunnel)


def exec_tensorboard(launch: Launch) -> None:
    """Replace this process with TensorBoard (Ctrl-C stops it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(launch.argv[0], launch.argv)
