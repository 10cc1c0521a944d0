"""The local Slurm cluster (bin/local-slurm) behaves like a real one: multi-node steps, requeue."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import slurm_cluster as slurm


@pytest.mark.slurm
@pytest.mark.slow
def test_two_nodes_two_tasks_each(slurm_cluster: None, tmp_path: Path) -> None:
    out = tmp_path / "ranks.out"
    job_id = slurm.sbatch(
        "#!/bin/bash\n"
        "set -euo pipefail\n"
        "srun bash -c 'echo \"rank $SLURM_PROCID $SLURM_NODEID $SLURMD_NODENAME $(hostname)\"'\n",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--time=2",
        f"--output={out}",
    )
    assert slurm.wait_for_job(job_id, timeout=120) == "COMPLETED", out.read_text()
    rows = [line.split() for line in out.read_text().splitlines() if line.startswith("rank ")]
    assert sorted(int(row[1]) for row in rows) == [0, 1, 2, 3], rows
    assert {row[2] for row in rows} == {"0", "1"}, rows
    assert len({row[3] for row in rows}) == 2, rows


REQUEUE_ONCE = """#!/bin/bash
set -euo pipefail
restart=${SLURM_RESTART_COUNT:-0}
echo "run job=$SLURM_JOB_ID restart=$restart start=$(date +%s.%N)"
if [[ "$restart" == 0 ]]; then
    echo "requeue at=$(date +%s.%N)"
    scontrol requeue "$SLURM_JOB_ID"
    sleep 120  # the requeue ends this run
    exit 1
fi
echo "done"
"""


@pytest.mark.slurm
@pytest.mark.slow
def test_requeue_from_batch_script_keeps_job_id(slurm_cluster: None, tmp_path: Path) -> None:
    out = tmp_path / "requeue.out"
    job_id = slurm.sbatch(REQUEUE_ONCE, "--requeue", "--open-mode=append", f"--output={out}")
    assert slurm.wait_for_job(job_id, timeout=120) == "COMPLETED", out.read_text()
    assert slurm.job_restart_count(job_id) == 1
    fields = [
        dict(kv.split("=", 1) for kv in line.split()[1:])
        for line in out.read_text().splitlines()
        if line.startswith(("run ", "requeue "))
    ]
    runs = [f for f in fields if "job" in f]
    assert [(r["job"], r["restart"]) for r in runs] == [(job_id, "0"), (job_id, "1")]
    assert "done" in out.read_text()
    requeued_at = next(float(f["at"]) for f in fields if "at" in f)
    latency = float(runs[1]["start"]) - requeued_at
    print(f"requeue -> restart: {latency:.1f} s")
    assert latency < 15, f"requeued job took {latency:.1f} s to restart"


def _crash_daemons(state_dir: Path) -> None:
    """Leave the cluster as a crash or a machine restored from a snapshot does: the state files
    list the running job, no daemon or job step runs. slurmctld gets SIGTERM so it writes its
    state first (killed at once it could lose a job it had not saved yet); every other daemon
    and slurmstepd gets SIGKILL."""
    ctld = (state_dir / "run" / "slurmctld.pid").read_text().strip()
    subprocess.run(["kill", "-TERM", ctld], capture_output=True, check=False)
    deadline = time.monotonic() + 30
    while _alive(int(ctld)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid_file in (state_dir / "run").glob("*.pid"):
        pid = pid_file.read_text().strip()
        if pid.isdigit():
            subprocess.run(["kill", "-KILL", pid], capture_output=True, check=False)
    subprocess.run(["pkill", "-KILL", "-x", "slurmstepd"], capture_output=True, check=False)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slurm
@pytest.mark.slow
def test_start_after_a_crash_cancels_recovered_jobs(slurm_cluster: None, tmp_path: Path) -> None:
    """A cluster started again from its state files does not bring back the jobs that were
    running (a recovered RUNNING job kept two nodes "mix" and failed a CI start), nor leaves
    their processes behind; job ids and accounting survive."""
    if os.geteuid() != 0:
        pytest.skip("crashing the cluster's daemons needs root")
    if slurm.live_job_ids():
        pytest.skip(f"other jobs are on the cluster: {sorted(slurm.live_job_ids())}")
    pid_file = tmp_path / "sleep.pid"
    script = f"#!/bin/bash\nsleep 600 &\necho $! > {pid_file}\nwait\n"
    job_id = slurm.sbatch(script, "--nodes=2", "--time=5", "--output=/dev/null")
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, f"job {job_id} did not start in 60 s"
        time.sleep(0.2)
    sleeper = int(pid_file.read_text())
    state_dir = Path(os.environ.get("LOCAL_SLURM_STATE_DIR", "/var/lib/hpc-mca-slurm"))

    _crash_daemons(state_dir)
    done = subprocess.run([str(slurm.LOCAL_SLURM), "start"], capture_output=True, text=True,
                          timeout=300, check=False)

    assert done.returncode == 0, done.stdout + done.stderr
    assert f"cancelling jobs recovered from before the restart: {job_id}" in done.stdout
    assert slurm.live_job_ids() == set()
    assert slurm.job_state(job_id) == "CANCELLED"
    assert not _alive(sleeper), "the crashed job's process survived the restart"
    next_id = slurm.sbatch("#!/bin/bash\ntrue\n", "--output=/dev/null")
    assert int(next_id) > int(job_id)
    assert slurm.wait_for_job(next_id, timeout=120) == "COMPLETED"


def _shell_scripts() -> list[str]:
    """Files in bin/, sbatch/ and benchmarks/ whose #! line names a shell (not e.g. a Python entry point)."""
    names = []
    for folder in ("bin", "sbatch", "benchmarks"):
        for path in sorted((slurm.REPO / folder).glob("*")):
            if path.is_file():
                with path.open("rb") as f:
                    first = f.readline()
                if first.startswith(b"#!") and first.rstrip().endswith((b"sh", b"bash")):
                    names.append(f"{folder}/{path.name}")
    return names


def _ensure_shellcheck() -> str | None:
    """shellcheck's path; installed through bin/local-slurm install when missing and root."""
    if shutil.which("shellcheck") is None and os.geteuid() == 0:
        subprocess.run([str(slurm.LOCAL_SLURM), "install"], capture_output=True, check=False)
    return shutil.which("shellcheck")


# Not marked slurm/slow: a lint that takes a fraction of a second and needs no cluster.
@pytest.mark.parametrize("script", _shell_scripts())
def test_shellcheck_clean(script: str) -> None:
    shellcheck = _ensure_shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    args = [shellcheck, "--external-sources", str(slurm.REPO / script)]
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout


def _local_slurm_functions(*names: str) -> str:
    """The bash source of these functions of bin/local-slurm (each ``name() {`` to its ``}``)."""
    lines, keep = [], False
    for line in (slurm.REPO / "bin" / "local-slurm").read_text().splitlines():
        if any(line.startswith(f"{name}() {{") for name in names):
            lines.append(line)
            keep = not line.endswith("}")  # else a one-line function
        elif keep:
            lines.append(line)
            keep = line != "}"
    return "\n".join(lines)


# Not marked slurm: a fake mariadbd, no cluster.
def test_a_mariadb_slow_to_write_its_pid_file_is_waited_for_and_stoppable(tmp_path: Path) -> None:
    """mariadbd writes its pid file only once its engines are up; on a loaded 2-core machine
    that took over start's 3-s grace, and start declared it dead (then left it running, as
    stop went by the pid file). A mariadbd started with our --pid-file counts as alive before
    the file exists; start waits for it, and stop finds it without the file."""
    pid_file = tmp_path / "mariadb.pid"
    fake = tmp_path / "mariadbd"  # a script's process is named after the script
    fake.write_text("#!/bin/bash\n# args: --pid-file=FILE\nsleep 4\necho $$ > \"${1#--pid-file=}\"\n"
                    "sleep 60 &\ntrap 'kill $!; exit 0' TERM\nwait\n")
    fake.chmod(0o755)
    functions = _local_slurm_functions("log", "err", "pid_alive", "pidfile_pid", "pids_named",
                                       "mariadb_pid", "mariadb_alive", "stop_pid", "wait_ready")
    script = f"""set -euo pipefail
{functions}
DB_PIDFILE={pid_file}
TIMEOUT=20
{fake} --pid-file={pid_file} >/dev/null 2>&1 &
fake=$!
sleep 0.5
[[ "$(mariadb_pid)" == "$fake" ]] || {{ echo "not found before its pid file"; exit 1; }}
wait_ready mariadb_alive test -s {pid_file} || {{ echo "declared dead while starting"; exit 1; }}
echo "ready after $SECONDS s"
[[ "$(mariadb_pid)" == "$fake" ]] || {{ echo "not found by its pid file"; exit 1; }}
rm {pid_file}
stop_pid "$(mariadb_pid)" mariadbd MariaDB
wait "$fake" || true
[[ -z "$(mariadb_pid)" ]] || {{ echo "still found after stop"; exit 1; }}
"""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stopped MariaDB (pid" in done.stdout
