"""One node's preflight (``hpc-mca preflight``: one task per node, before training).

The batch shell runs it on every node of the job when ``HPC_MCA_PREFLIGHT=1``; the verdict
on the batch node (:mod:`hpc_mca.slurm.preflight`) then excludes the nodes that failed and
requeues the job before any training starts. What one node checks:

* with GPUs: the device count equals what the allocation gave (``CUDA_VISIBLE_DEVICES``,
  else ``SLURM_GPUS_ON_NODE``), each device's free memory is at least
  :data:`MIN_FREE_GPU_FRACTION` of its total (nothing else should hold it at job start), and
  a matmul on each device equals the exact result;
* on CPU: the matmul on the CPU, the available memory (at least :data:`MIN_AVAILABLE_BYTES`);
* both: the run directory is writable (every rank writes there);
* then an all-reduce across the job's nodes: gloo over TCP (no GPU involved, so a broken
  device cannot hang it), one process per node, rendezvous at a TCPStore on the first node
  of ``HPC_MCA_JOB_NODES``. A node whose own checks failed still joins, so the others are not
  left waiting; a node that never joins is named by the others once
  :data:`RENDEZVOUS_TIMEOUT_S` has passed, and so is one that joined but stopped answering in
  the all-reduce (it never says, within :data:`AFTER_FAILURE_S`, that its all-reduce failed
  too), or the first node when its store stops answering.

Each node records its phase as it goes (:mod:`hpc_mca.runtime.preflight_records`): the batch
node names who is behind while the preflight runs, and stops waiting for a node the others
named (:mod:`hpc_mca.slurm.preflight`).

The local checks run in a thread bounded by :data:`CHECK_TIMEOUT_S`: a device that hangs
fails its check instead of holding the node (the process leaves the thread behind). So does
the all-reduce as a whole (:func:`~hpc_mca.runtime.preflight_records.all_reduce_bound_s`), and
each question to the store after a failure (:func:`bounded`): the store of a stopped first
node never answers, and none of its timeouts covers that.

Each node writes ``<run dir>/preflight/<node>.json`` (:func:`write_report`) and prints one
line. The matmul operands are small integers, so every fp32 path (TF32 included) must give
the exact product: any difference is a fault, not rounding.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from hpc_mca.errors import UserError
from hpc_mca.rundir import JOB_NODES_ENV, PREFLIGHT_DIR, RUN_DIR_ENV, write_atomic
from hpc_mca.runtime.env import job_nodes_from, port_for_job
from hpc_mca.runtime.preflight_records import (
    AFTER_FAILURE_S,
    CHECK_TIMEOUT_S,
    LEAVE_S,
    RENDEZVOUS_TIMEOUT_S,
    all_reduce_bound_s,
    write_phase,
)

MIN_FREE_GPU_FRACTION = 0.8
"""Free memory each GPU must have, as a fraction of its total: before training nothing of
this job holds any, so much less means another process (a previous job's leftover) does."""
MIN_AVAILABLE_BYTES = 1 << 30
"""Available host memory a node must have (MemAvailable)."""
MATMUL_SIZE = 512
"""The matmul's square size; its integer entries (|x| <= 4) keep every partial sum exact."""
_PORT_OFFSET = 8500
"""The preflight's rendezvous port is the training port of the job id 8500 further
(:func:`port_for_job`): a job's preflight and its own training never share a port, and on a
node shared by jobs a clash needs ids exactly 8500 apart."""


CheckFn = Callable[[], tuple[bool, str]]
"""A check: whether it passed, and what it found (one line)."""
R = TypeVar("R")


class PreflightInputError(UserError):
    """The preflight cannot run where it was started (no run directory, a node list that does
    not hold this node)."""


@dataclass
class Check:
    """One check's outcome."""

    name: str
    ok: bool
    detail: str
    seconds: float = 0.0


@dataclass(frozen=True)
class NodeEnv:
    """Who this node is in the job, from Slurm and the batch shell."""

    node: str
    node_id: int
    nodes: tuple[str, ...]
    job_id: str
    restart: int
    run_dir: Path

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> NodeEnv:
        run_dir = env.get(RUN_DIR_ENV)
        if not run_dir:
            raise PreflightInputError(f"{RUN_DIR_ENV} is not set; valid: the run directory "
                                      "(the batch script exports it)")
        names = job_nodes_from(env)
        node = env.get("SLURMD_NODENAME") or socket.gethostname()
        names = names or [node]
        node_id = env.get("SLURM_NODEID", "0")
        if not node_id.isdigit() or int(node_id) >= len(names):
            raise PreflightInputError(f"SLURM_NODEID={node_id!r} is not valid; valid: 0.."
                                      f"{len(names) - 1} ({JOB_NODES_ENV}={','.join(names)})")
        return cls(node, int(node_id), tuple(names), env.get("SLURM_JOB_ID", "0") or "0",
                   int(env.get("SLURM_RESTART_COUNT", "0") or 0), Path(run_dir))


def preflight_port(job_id: str) -> int:
    """The rendezvous port of ``job_id``'s preflight (every node derives it alone)."""
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    return port_for_job(str(int(digits) + _PORT_OFFSET))


# ---- local checks ----------------------------------------------------------------------------

def matmul_operands(size: int = MATMUL_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two fp32 matrices of integers in [-4, 4] and their exact product (float64 on the
    CPU: exact for these sizes, and a path independent of the device under test)."""
    gen = torch.Generator().manual_seed(size)
    a = torch.randint(-4, 5, (size, size), generator=gen).float()
    b = torch.randint(-4, 5, (size, size), generator=gen).float()
    return a, b, (a.double() @ b.double()).float()


def _product(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``a @ b`` computed on ``device``, back on the CPU."""
    out = a.to(device) @ b.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out.cpu()


def check_matmul(device: torch.device) -> tuple[bool, str]:
    a, b, want = matmul_operands()
    got = _product(a, b, device)
    if torch.equal(got, want):
        return True, f"{MATMUL_SIZE}x{MATMUL_SIZE} on {device} exact"
    off = (got.double() - want.double()).abs().nan_to_num(nan=float("inf")).max().item()
    wrong = int((got != want).sum().item())
    return False, (f"matmul on {device} off by {off:g}: {wrong} of {want.numel()} entries "
                   "differ from the exact product")


def expected_gpus(env: Mapping[str, str]) -> tuple[int | None, str]:
    """How many GPUs the allocation gave this task, and where that was read."""
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible and visible not in ("-1", "none", "NoDevFiles"):
        return len([d for d in visible.split(",") if d.strip()]), "CUDA_VISIBLE_DEVICES"
    count = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if count.isdigit() and int(count) > 0:
        return int(count), "SLURM_GPUS_ON_NODE"
    return None, ""


def check_gpu_count(expected: int, source: str) -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, f"CUDA is not available but the allocation gave {expected} GPU(s) ({source})"
    found = torch.cuda.device_count()
    if found != expected:
        return False, f"{found} GPU(s) visible, the allocation gave {expected} ({source})"
    return True, f"{found} GPU(s)"


def check_gpu_memory(index: int) -> tuple[bool, str]:
    free, total = torch.cuda.mem_get_info(index)
    floor = MIN_FREE_GPU_FRACTION * total
    text = f"cuda:{index} has {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
    return free >= floor, text if free >= floor else f"{text}, under {floor / 2**30:.1f} GiB"


def available_memory() -> int:
    """MemAvailable, in bytes (the kernel's estimate of what can be allocated)."""
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def check_host_memory() -> tuple[bool, str]:
    free = available_memory()
    text = f"{free / 2**30:.1f} GiB available"
    if free < MIN_AVAILABLE_BYTES:
        return False, f"{text}, under {MIN_AVAILABLE_BYTES / 2**30:.1f} GiB"
    return True, text


def check_run_dir(run_dir: Path) -> tuple[bool, str]:
    probe = run_dir / PREFLIGHT_DIR / f".probe.{socket.gethostname()}.{os.getpid()}"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok\n")
        probe.unlink()
    except OSError as err:
        return False, f"{run_dir} is not writable: {err.strerror or err}"
    return True, f"{run_dir} writable"


def local_plan(env: Mapping[str, str], run_dir: Path) -> list[tuple[str, CheckFn]]:
    """The checks this node runs, in order: (name, check)."""
    expected, source = expected_gpus(env)
    plan: list[tuple[str, CheckFn]] = []
    if expected is not None or torch.cuda.is_available():
        if expected is not None:
            plan.append(("gpu count", lambda: check_gpu_count(expected, source)))
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for i in range(count):
            plan.append((f"memory cuda:{i}", partial(check_gpu_memory, i)))
            plan.append((f"matmul cuda:{i}", partial(check_matmul, torch.device("cuda", i))))
    else:
        plan.append(("matmul cpu", lambda: check_matmul(torch.device("cpu"))))
    plan.append(("host memory", check_host_memory))
    plan.append(("run dir", lambda: check_run_dir(run_dir)))
    return plan


def run_local_checks(plan: list[tuple[str, CheckFn]],
                     timeout_s: float = CHECK_TIMEOUT_S) -> list[Check]:
    """Each check of ``plan``, timed, in a thread bounded by ``timeout_s``: a check that
    raises fails with its error; one still running at the deadline fails as unfinished, and
    the checks after it are not run."""
    done: list[Check] = []
    current: list[tuple[str, float]] = []  # the running check's name and start, while one runs

    def work() -> None:
        for name, check in plan:
            start = time.monotonic()
            current[:] = [(name, start)]
            try:
                ok, detail = check()
            except Exception as err:  # a failed check, whatever the device raised
                ok, detail = False, f"{name} raised {type(err).__name__}: {err}"
            done.append(Check(name, ok, detail, round(time.monotonic() - start, 3)))
        current.clear()

    thread = threading.Thread(target=work, name="preflight-checks", daemon=True)
    thread.start()
    thread.join(timeout_s)
    checks = list(done)
    running = current[:1]  # one read: the thread may still clear it
    if thread.is_alive() and running:
        name, start = running[0]
        checks.append(Check(name, False, f"{name} did not finish within {timeout_s:g} s",
                            round(time.monotonic() - start, 3)))
    return checks


# ---- the all-reduce --------------------------------------------------------------------------

@dataclass
class Gathered:
    """The all-reduce's outcome on this node."""

    check: Check
    absent: list[str] = field(default_factory=list)
    """Nodes that never joined (named only when the all-reduce failed)."""
    stopped: list[str] = field(default_factory=list)
    """Nodes that joined and then stopped answering: silent after the all-reduce itself
    failed, or the first node when the store it serves stopped answering."""


def all_reduce(me: NodeEnv, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> Gathered:
    """Join the job's all-reduce: every node adds a one-hot row of its index; each must see
    all ones. The TCPStore on the first node also records who joined, to name the absent."""
    import torch.distributed as dist

    start = time.monotonic()
    world, host = len(me.nodes), me.nodes[0]
    port = preflight_port(me.job_id)
    timeout = datetime.timedelta(seconds=timeout_s)

    def result(ok: bool, detail: str, absent: list[str] | None = None,
               stopped: list[str] | None = None) -> Gathered:
        return Gathered(Check("all-reduce", ok, detail, round(time.monotonic() - start, 3)),
                        absent or [], stopped or [])

    try:
        store = dist.TCPStore(host, port, None, me.node_id == 0, timeout,
                              wait_for_workers=False)
    except (RuntimeError, OSError) as err:  # DistStoreError, or the port is taken
        if me.node_id == 0:
            return result(False, f"cannot host the rendezvous at {host}:{port}: {_first_line(err)}")
        return result(False, f"the rendezvous at {host}:{port} did not answer within "
                             f"{timeout_s:g} s: {_first_line(err)}", [host])
    reducing = False  # every node joined the process group: only the all-reduce itself is left
    stopped: list[str] = []
    store_gone = False  # its server stopped answering: nothing to leave
    try:
        store.set(f"joined/{me.node_id}", me.node)
        write_phase(me.run_dir, me.node, me.restart, "joined")
        dist.init_process_group("gloo", store=dist.PrefixStore("preflight", store),
                                rank=me.node_id, world_size=world, timeout=timeout)
        try:
            row = torch.zeros(world)
            row[me.node_id] = 1.0
            reducing = True
            dist.all_reduce(row)
        finally:
            dist.destroy_process_group()
    except RuntimeError as err:  # a timeout, or a peer that went away
        # A stopped first node never answers its store's questions (no timeout covers them).
        answered, named = bounded(lambda: _absent(store, me, reducing), 2 * AFTER_FAILURE_S)
        absent, stopped = named if answered and named else ([], [] if me.node_id == 0 else [host])
        store_gone = not answered
        who = f"; never joined: {','.join(absent)}" if absent else ""
        who += f"; stopped answering: {','.join(stopped)}" if stopped else ""
        return result(False, f"all-reduce across {world} node(s) failed after "
                             f"{time.monotonic() - start:.1f} s{who}: {_first_line(err)}",
                      absent, stopped)
    finally:
        if not store_gone:
            bounded(lambda: _leave(store, me, stopped), LEAVE_S + AFTER_FAILURE_S)
    if not torch.equal(row, torch.ones(world)):
        return result(False, f"all-reduce across {world} node(s) returned {row.tolist()}, "
                             f"expected {world} ones")
    return result(True, f"{world} node(s) in {time.monotonic() - start:.2f} s")


def bounded(fn: Callable[[], R], timeout_s: float) -> tuple[bool, R | None]:
    """``fn()`` in a daemon thread: (True, its result) when it returns within ``timeout_s``,
    else (False, None) and the thread is left behind, blocked (a TCPStore whose server
    process is stopped never answers, and no timeout of the store covers its questions)."""
    box: list[R] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            box.append(fn())
        except BaseException as err:  # re-raised in the caller's thread
            errors.append(err)

    thread = threading.Thread(target=call, name="preflight-store", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if errors:
        raise errors[0]
    return (True, box[0]) if box else (False, None)


def _first_line(err: BaseException) -> str:
    """An error's first line, short (torch's distributed errors run to many lines)."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def _absent(store: torch.distributed.Store, me: NodeEnv,
            reducing: bool) -> tuple[list[str], list[str]]:
    """Whom to name after a failed all-reduce: (never joined, stopped answering). Never
    joined: the nodes whose join key is not in the store. When all joined and the all-reduce
    itself failed (they entered it together), stopped: those that do not say within
    :data:`AFTER_FAILURE_S` that theirs failed too (frozen, or cut off); and the first node
    when its store does not answer (its process is what serves it)."""
    try:
        absent = [me.nodes[i] for i in range(len(me.nodes)) if not store.check([f"joined/{i}"])]
        if absent or not reducing:
            return absent, []
        store.set(f"failed/{me.node_id}", me.node)
        deadline = time.monotonic() + AFTER_FAILURE_S
        while True:
            silent = [me.nodes[i] for i in range(len(me.nodes))
                      if not store.check([f"failed/{i}"]) and not store.check([f"left/{i}"])]
            if not silent or time.monotonic() >= deadline:
                return [], silent
            time.sleep(0.05)
    except RuntimeError:
        return [], [] if me.node_id == 0 else [me.nodes[0]]


def _leave(store: torch.distributed.Store, me: NodeEnv, stopped: list[str]) -> None:
    """The first node hosts the store: it waits (bounded) until every node that joined is
    done with it, so none of them loses the store while it still names the absent; not for
    the ``stopped`` ones, which never will be."""
    try:
        store.set(f"left/{me.node_id}", me.node)
        if me.node_id != 0:
            return
        deadline = time.monotonic() + LEAVE_S
        joined = [i for i in range(len(me.nodes))
                  if store.check([f"joined/{i}"]) and me.nodes[i] not in stopped]
        while time.monotonic() < deadline:
            if store.check([f"left/{i}" for i in joined]):
                return
            time.sleep(0.05)
    except RuntimeError:
        return


# ---- the report ------------------------------------------------------------------------------

def write_report(me: NodeEnv, report: Mapping[str, Any]) -> Path:
    path = me.run_dir / PREFLIGHT_DIR / f"{me.node}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(report, indent=1) + "\n")


def summary_line(report: Mapping[str, Any]) -> str:
    """The node's one line in the job's log."""
    checks = report["checks"]
    if report["ok"]:
        times = ", ".join(f"{c['name']} {c['seconds']:.2f} s" for c in checks)
        return f"preflight {report['node']}: ok in {report['seconds']:.1f} s ({times})"
    failed = "; ".join(c["detail"] for c in checks if not c["ok"])
    return f"preflight {report['node']}: FAILED: {failed}"


def _process_start() -> float:
    """When this process started (unix time): a node's time includes importing torch."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # psutil missing, or its own errors (AccessDenied...): from now on
        return time.time()


def run(env: Mapping[str, str] | None = None, *, rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S,
        check_timeout_s: float = CHECK_TIMEOUT_S) -> dict:
    """This node's preflight: the local checks, the all-reduce, the report and its line.
    Returns the report (``ok`` says whether this node passed)."""
    env = os.environ if env is None else env
    started = _process_start()
    me = NodeEnv.from_environ(env)
    write_phase(me.run_dir, me.node, me.restart, "checks")
    checks = run_local_checks(local_plan(env, me.run_dir), check_timeout_s)
    write_phase(me.run_dir, me.node, me.restart, "all-reduce")
    bound = all_reduce_bound_s(rendezvous_timeout_s)
    finished, gathered = bounded(lambda: all_reduce(me, rendezvous_timeout_s), bound)
    if not finished or gathered is None:  # blocked on the first node's store: it stopped
        host = me.nodes[0]
        gathered = Gathered(Check("all-reduce", False, f"all-reduce did not finish within {bound:g} s: "
                                  f"the rendezvous store on {host} stopped answering", bound),
                            stopped=[] if me.node_id == 0 else [host])
    checks.append(gathered.check)
    report = {"node": me.node, "node_id": me.node_id, "nodes": list(me.nodes), "job": me.job_id,
              "restart": me.restart, "ok": all(c.ok for c in checks),
              "local_ok": all(c.ok for c in checks[:-1]), "absent": gathered.absent,
              "stopped": gathered.stopped,
              "checks": [asdict(c) for c in checks], "started": round(started, 3),
              "seconds": round(time.time() - started, 3)}
    try:
        write_report(me, report)
    except OSError as err:  # the verdict then counts this node as silent: it failed
        print(f"preflight {me.node}: cannot write its report: {err}", flush=True)
    print(summary_line(report), flush=True)
    return report
