"""Trainer processes for the tests, forked from one process that imported the stack once.

A rank's imports (torch, Megatron-Core, transformers, peft) cost ~7 s of CPU on the 2-core
VM, often more than the short run a test trains; the trainer tests start ~200 such processes.
``hpc_mca.cli.forkrun`` pays the imports once per launch and forks the ranks; this server
pays them once per pytest session: it imports what forkrun preloads, then serves each launch
by forking a child that becomes ``hpc-mca ARGS`` (one rank, as ``python -m hpc_mca ARGS``;
or ``python SCRIPT.py ARGS``) or forkrun's launcher for several ranks. Each child starts from
the server's state right after the imports, never from an earlier run's.

What a fresh interpreter would read from its environment at start-up is the server's: a
launch whose environment differs from the server's in anything but the rank variables,
``HPC_MCA_*`` and ``OMP_NUM_THREADS`` (read at run time) is not served warm: the caller starts
a fresh process instead (:func:`run` returns None). Tests that inspect a process's
``/proc/PID/environ`` must start fresh processes too: a forked child's shows the server's.

``HPC_MCA_TEST_COLD=1`` turns the server off (every launch a fresh process).

Protocol (a Unix socket): the client sends one JSON line ``{"args", "nproc", "launcher",
"env", "cwd", "stdout", "stderr"}``; the server forks a supervisor for the connection, which forks the
worker (in a session of its own, so a timeout kills its ranks too), replies
``{"pid": N}``, waits for it and replies ``{"status": S}`` (``-signal`` when killed, as
``subprocess`` reports it).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

RUN_TIME_PREFIXES = ("HPC_MCA_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                     "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                     "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                     "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
"""Variables a launch may set differently from the server's environment: nothing reads them
while the stack is imported. pytest sets PYTEST_CURRENT_TEST for each test; torch.compile's
first use in the pytest process puts its default cache directories into ``os.environ``, and
the first compiled C++ kernel it loads (test_rope.py compiles one) an address of its own
process, which inductor writes again, with the loading process's address, right before each
kernel module's init reads it (a launch's stale copy is never read). Kept out, that address
started every later trainer launch fresh (162 of them in the CI run before this was added)."""

_server: dict[str, object] = {}
fresh: dict[str, int] = {}
"""Launches this session could not serve warm, by the variables that kept them out (shown in
pytest's summary: a launch started fresh costs the imports again)."""
forked = 0
"""Launches this session served warm."""


# --- server side -----------------------------------------------------------------------------


def _serve(path: str) -> None:
    from hpc_mca.cli.forkrun import preload

    preload(["train"])
    # Warmed too when installed, to save their import in each forked rank; a machine without
    # them (a borrowed GPU box) still serves every launch that does not need them.
    for optional in ("datasets", "peft", "hpc_mca.standard.run"):
        with contextlib.suppress(ImportError):
            importlib.import_module(optional)
    import torch

    threads = torch.get_num_threads()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    print("ready", flush=True)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # nobody reads the pipe after "ready"
    os.close(null)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _supervise(conn, threads)
        conn.close()


def _supervise(conn: socket.socket, threads: int) -> None:
    stream = conn.makefile("rw")
    request = json.loads(stream.readline())
    pid = os.fork()
    if pid == 0:
        stream.close()
        conn.close()
        _work(request, threads)
    stream.write(json.dumps({"pid": pid}) + "\n")
    stream.flush()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    stream.write(json.dumps({"status": code}) + "\n")
    stream.flush()
    os._exit(0)


def _work(request: dict, threads: int) -> None:
    """Become the launched process; never returns."""
    code = 1
    try:
        os.setsid()
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", threads)))
        code = _launch(request["args"], request["nproc"], request["launcher"])
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, (int, type(None))):
            print(done.code, file=sys.stderr)
    except BaseException:  # what a fresh interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _launch(args: list[str], nproc: int, launcher: bool) -> int:
    if launcher:
        from hpc_mca.cli.forkrun import launch

        return launch(nproc, args)
    from hpc_mca.cli.forkrun import run_command

    if not args[0].endswith(".py"):
        sys.argv = ["hpc-mca", *args]
    run_command(args)
    return 0


# --- client side -----------------------------------------------------------------------------


base_env: dict[str, str] | None = None
"""The environment the server starts with: set by conftest.py at the session's start (the
tests' rank environment before any test changed ``os.environ``); else the first launch's."""


def _start(env: dict[str, str]) -> str | None:
    """The server's socket, starting the server on first use; None when it is off."""
    if os.environ.get("HPC_MCA_TEST_COLD") == "1":
        return None
    if "path" not in _server:
        tmp = tempfile.mkdtemp(prefix="hpc-mca-warm-")
        path = os.path.join(tmp, "socket")
        env = dict(base_env if base_env is not None else env)
        proc = subprocess.Popen([sys.executable, __file__, path], env=env, stdout=subprocess.PIPE,
                                stderr=open(os.path.join(tmp, "server.log"), "w"), text=True)
        printed = []
        for line in proc.stdout:  # libraries may print while the stack is imported
            if line.strip() == "ready":
                break
            printed.append(line)
        else:
            raise RuntimeError(f"warm launcher did not start: {''.join(printed)[-2000:]}"
                               f"(see {tmp}/server.log)")
        _server.update(path=path, env=env, proc=proc, tmp=tmp)
        atexit.register(proc.kill)
    return str(_server["path"])


def _served(env: dict[str, str]) -> bool:
    global forked
    base = _server["env"]
    assert isinstance(base, dict)
    differ = {k for k in set(env) | set(base) if env.get(k) != base.get(k)}
    blocking = sorted(k for k in differ if not k.startswith(RUN_TIME_PREFIXES))
    if blocking:
        key = ", ".join(blocking)
        fresh[key] = fresh.get(key, 0) + 1
        return False
    forked += 1
    return True


class WarmProcess:
    """A launch in flight (``subprocess.Popen``'s part the tests use)."""

    def __init__(self, conn: socket.socket, work: Path, command: list[str]) -> None:
        self._conn, self._work, self.args = conn, work, command
        self._stream = conn.makefile("rw")
        self.pid = int(json.loads(self._stream.readline())["pid"])

    def kill(self) -> None:
        """SIGKILL the launched process and its ranks (its session)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Its exit status and output, as ``subprocess.run(capture_output=True)`` gives them;
        ``TimeoutExpired`` (after killing it) when it runs past ``timeout`` seconds."""
        self._conn.settimeout(timeout)
        try:
            status = int(json.loads(self._stream.readline())["status"])
        except (TimeoutError, socket.timeout):
            self.kill()
            raise subprocess.TimeoutExpired(self.args, timeout) from None
        finally:
            self._conn.close()
        out, err = ((self._work / name).read_text(errors="replace") for name in ("out", "err"))
        return subprocess.CompletedProcess(self.args, status, out, err)


def start(args: list[str], nproc: int, env: dict[str, str], *, launcher: bool,
          cwd: str | Path | None = None) -> WarmProcess | None:
    """Start ``hpc-mca ARGS`` with ``env`` on ``nproc`` local ranks (forkrun's launcher, with
    torchrun's variables, when ``launcher``; else ``nproc`` is 1 and the process is started as
    ``python -m hpc_mca ARGS`` would be), forked from the warm server (started on first use); None
    when it cannot be served warm (server off, or ``env`` differs from the server's at
    start-up)."""
    if nproc > 1 and not launcher:
        raise ValueError("several ranks need the launcher")
    path = _start(env)
    if path is None or not _served(env):
        return None
    work = Path(tempfile.mkdtemp(dir=str(_server["tmp"])))
    request = {"args": [str(a) for a in args], "nproc": nproc, "launcher": launcher, "env": env,
               "cwd": str(cwd or os.getcwd()), "stdout": str(work / "out"),
               "stderr": str(work / "err")}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    conn.sendall((json.dumps(request) + "\n").encode())
    return WarmProcess(conn, work, ["warm-launcher", f"--nproc-per-node={nproc}", *request["args"]])


def run(args: list[str], nproc: int, env: dict[str, str], *, launcher: bool,
        cwd: str | Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess | None:
    """:func:`start`, then wait for the end (None when it cannot be served warm)."""
    launched = start(args, nproc, env, launcher=launcher, cwd=cwd)
    return None if launched is None else launched.wait(timeout)


if __name__ == "__main__":
    _serve(sys.argv[1])
