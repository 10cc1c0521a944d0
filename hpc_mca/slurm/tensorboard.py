"""``hpc-mca tensorboard``: TensorBoard over chosen runs, on loopback, plus the ssh tunnel.

TensorBoard binds to 127.0.0.1 only (the login node is shared; nobody else should reach a
user's runs), on a free port picked here. The user reaches it through an ssh tunnel from
their own machine, whose command is printed. TensorBoard scans each run directory
recursively, so wherever the trainer puts its event files (``<run_dir>/tensorboard``) counts.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from . import commands
from .errors import OpsError
from .manifest import Run

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _run_names(runs: list[Run]) -> list[str]:
    """Unique, logdir_spec-safe names: the run dirs' names with odd characters replaced."""
    names: list[str] = []
    for run in runs:
        base = re.sub(r"[^A-Za-z0-9._-]", "_", run.name) or "run"
        name, n = base, 2
        while name in names:
            name, n = f"{base}.{n}", n + 1
        names.append(name)
    return names


def logdir_args(runs: list[Run], runs_root: Path) -> list[str]:
    """TensorBoard's log-directory arguments for ``runs`` (all of ``runs_root`` when empty).

    Each run is named after its run directory (``sft_addition_19``): the trainer's event
    files are in ``<run dir>/tensorboard``, which TensorBoard would otherwise show as a run
    called "tensorboard"."""
    if not runs:
        return ["--logdir", str(runs_root)]
    bad = [str(r.run_dir) for r in runs if "," in str(r.run_dir)]
    if bad:
        raise OpsError(f"run directory {bad[0]!r} contains ',', which TensorBoard's "
                       "--logdir_spec cannot carry; valid: a run directory without ','")
    spec = ",".join(f"{name}:{_events_dir(run.run_dir)}"
                    for name, run in zip(_run_names(runs), runs))
    return ["--logdir_spec", spec]


def _events_dir(run_dir: Path) -> Path:
    events = run_dir / "tensorboard"
    return events if events.is_dir() else run_dir


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
