"""The instrument of the GPU throughput figures (benchmarks/gpu_throughput.py), run on CPU with
the tiny shape: a GPU machine is lent rarely and for minutes, so the script its one call runs
must not have rotted in between. It trains ``hpc-mca train`` and the transformers loop side by
side, saves on the save steps it was given, and checks the trainer's logged tok/s against
steps.jsonl over the same window: that ratio is asserted here, the speeds are not."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_throughput_benchmark_runs_both_sides_on_cpu(tmp_path):
    work = tmp_path / "not-yet-made"  # the script makes its --dir
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_throughput.py", "--device", "cpu", "--tiny",
         "--seq-length", "512", "--steps", "4", "--warmup", "1", "--sides", "hpc-mca,bf16",
         "--dir", str(work), "--train-arg", "training.save_steps=2",
         "--train-arg", "training.save_total_limit=1"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout

    rows = dict(re.findall(r"^(hpc-mca|bf16)\s+([\d,]+)\s+[\d.]+\s", out, re.M))
    assert set(rows) == {"hpc-mca", "bf16"}, out
    assert all(int(v.replace(",", "")) > 0 for v in rows.values())
    assert re.search(r"^hpc-mca / transformers bf16: \d+\.\d\dx$", out, re.M), out

    # save_steps=2 over 4 steps: a save at step 2 and the end-of-run save at step 4.
    saves = re.findall(r"iter_(\d+) saved \((\w+)\)", out)
    assert saves == [("0000002", "interval"), ("0000004", "end")], out

    # The progress line's tok/s is the window average steps.jsonl gives over the same steps.
    ratio = float(re.search(r"steps\.jsonl over its window [\d,]+: ratio ([\d.]+)", out)[1])
    assert 0.98 <= ratio <= 1.02, out
    assert list(work.iterdir()) == []  # its temporary directory is cleaned up
