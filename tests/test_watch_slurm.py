"""``hpc-mca submit --wait`` and ``hpc-mca watch`` on the real local Slurm cluster.

The submit runs under a pseudo-terminal, so the progress bar is drawn as a user sees it (tqdm
redraws with carriage returns); the watch of a failing job runs on a pipe (one line per
change). Both jobs are the demo on one CPU rank for a few steps.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "hpc_mca" / "assets" / "demo" / "sft_addition.yaml"
HPC_MCA = str(Path(sys.executable).with_name("hpc-mca"))
ONE_CPU = ["--gpu", "CPU", "--nodes", "1", "--gpus-per-node", "1"]
STEPS = 6
TINY = [f"max_steps={STEPS}", "logging_steps=1", "eval_dataset=null", "eval_steps=null"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    env["COLUMNS"] = "140"
    return env


def run_in_pty(args: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """Run ``args`` with a pseudo-terminal (140 columns) as stdin/stdout/stderr; returns the
    exit status and everything it wrote."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    proc = subprocess.Popen(args, cwd=cwd, env=_env(), stdin=slave, stdout=slave, stderr=slave,
                            close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        else:
            proc.kill()
            raise TimeoutError(f"{args} still running after {timeout} s: "
                               + b"".join(chunks).decode(errors="replace")[-2000:])
    finally:
        os.close(master)
    return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")


@pytest.fixture
def demo() -> Path:
    if not DEMO.is_file():
        pytest.skip(f"waiting on the trainer's demo config {DEMO.relative_to(REPO)}")
    return DEMO


def test_submit_wait_draws_the_bar_and_exits_0_when_the_job_completes(
        slurm_cluster: None, demo: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    status, text = run_in_pty([HPC_MCA, "submit", str(demo), *ONE_CPU, "--job-name", "watched",
                               "--wait", "--interval", "0.5", *TINY], tmp_path, timeout=540)
    took = time.monotonic() - started
    print(f"\nsubmit --wait: {took:.1f} s, exit {status}; terminal output:\n{text!r}")
    match = re.match(r"submitted job (\d+):", text)
    assert match, text
    job_id = match.group(1)
    assert status == 0, text
    # The bar: redrawn in place (\r) with the trainer's step/total, loss, tokens/s, requeues.
    bars = re.findall(rf"\rjob {job_id} RUNNING +\d+%\|[^|\r\n]*\| step (\d+)/{STEPS} \| "
                      r"loss \d+\.\d{4} \| tokens/s [\d,]+ \| (?:ETA \S+|finished) \| "
                      r"requeues 0", text)
    assert bars, text
    assert int(bars[-1]) >= 1
    lines = text.replace("\r\n", "\n").splitlines()
    assert re.fullmatch(rf"job {job_id} COMPLETED exit 0:0 \| step {STEPS}/{STEPS} \(100%\) \| "
                        r"loss \d+\.\d{4} \| tokens/s [\d,]+ \| finished \| requeues 0",
                        lines[-1]), lines[-1]
    run_dir = tmp_path / "runs" / f"watched_{job_id}"
    assert (run_dir / "steps.jsonl").read_text().count("\n") == STEPS
    # The same run, plotted by job id.
    done = subprocess.run([HPC_MCA, "plot", job_id, "-o", str(tmp_path / "c.png")], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith(f"wrote {tmp_path / 'c.png'}: loss"), \
        done.stderr


def test_watch_of_a_job_that_fails_on_bad_input_exits_non_zero(
        slurm_cluster: None, demo: Path, tmp_path: Path) -> None:
    rows = (demo.parent / "train.jsonl").read_text().splitlines()[:64]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(rows[:-1]) + "\n" + rows[-1][: len(rows[-1]) // 2] + "\n")
    done = subprocess.run([HPC_MCA, "submit", str(demo), *ONE_CPU, "--job-name", "broken",
                           f"dataset={data}", *TINY], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    job_id = re.match(r"submitted job (\d+):", done.stdout).group(1)
    started = time.monotonic()
    watched = subprocess.run([HPC_MCA, "watch", job_id, "--interval", "0.5"], cwd=tmp_path,
                             env=_env(), capture_output=True, text=True, timeout=540)
    print(f"\nwatch: {time.monotonic() - started:.1f} s, exit {watched.returncode}:\n"
          f"{watched.stdout}")
    assert watched.returncode == 3, watched.stdout + watched.stderr  # FAILED
    assert "\r" not in watched.stdout
    lines = watched.stdout.splitlines()
    assert len(lines) == len(set(lines))  # one line per change
    assert lines[-1].startswith(f"job {job_id} FAILED exit 2:0 | ")
    assert f"bad input: {data}:64: " in lines[-1] or "bad input: " in lines[-1], lines[-1]
