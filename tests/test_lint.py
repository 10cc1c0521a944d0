"""The linter holds the code to its rules (``[tool.ruff]`` in pyproject.toml): ruff over the
package, the tests and the benchmarks finds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "hpc_mca", "tests", "benchmarks"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_would_find_an_unused_import(tmp_path):
    """The check can fail: the same configuration reports a file with an unused import."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config",
                           str(REPO / "pyproject.toml"), str(bad)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "F401" in proc.stdout
