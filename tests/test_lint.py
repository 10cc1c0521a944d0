"""The linter and the type checker hold the code to their rules (``[tool.ruff]`` and
``[tool.mypy]`` in pyproject.toml): ruff over the package, the tests and the benchmarks finds
nothing, mypy over the package finds nothing, and few parameters are ``Any``, each saying why."""

from __future__ import annotations

import ast
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


def test_mypy_finds_nothing():
    """The type checker (``[tool.mypy]`` in pyproject.toml: every function annotated in full,
    untyped bodies checked) passes over the package."""
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", "/dev/null"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_mypy_would_find_an_argument_of_the_wrong_type(tmp_path):
    """The check can fail: the same configuration reports a wrong argument type and a function
    without annotations (a file of its own, so that the check takes seconds)."""
    bad = tmp_path / "bad.py"
    bad.write_text("def steps(max_steps: int) -> int:\n    return max_steps\n\n\n"
                   "def untyped(value):\n    return value\n\n\nsteps('4')\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", "/dev/null", "--config-file",
                           str(REPO / "pyproject.toml"), str(bad)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 1 and "[arg-type]" in proc.stdout and "[no-untyped-def]" in proc.stdout, \
        proc.stdout[-2000:]


def _any_parameters() -> tuple[int, list[str]]:
    """Parameters of the package's functions (self and cls aside), and those annotated ``Any``
    (or ``Any | None``) as ``path:line name`` with ``justified`` when their line says why."""
    total, found = 0, []
    for path in sorted((REPO / "hpc_mca").rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]:
                if arg.arg in ("self", "cls"):
                    continue
                total += 1
                if arg.annotation is not None and ast.unparse(arg.annotation) in ("Any", "Any | None"):
                    why = "# Any:" in lines[arg.lineno - 1]
                    found.append(f"{path.relative_to(REPO)}:{arg.lineno} {arg.arg}{' justified' if why else ''}")
    return total, found


def test_any_parameters_are_few_and_each_says_why():
    """Under 2% of the package's parameters are ``Any``, each with a ``# Any: reason`` comment on
    its line (what no narrower type can say: a third-party object with no types, a value
    forwarded to an API whose signature is open)."""
    total, found = _any_parameters()
    assert len(found) < 0.02 * total, f"{len(found)} of {total} parameters are Any"
    unexplained = [f for f in found if not f.endswith(" justified")]
    assert not unexplained, "Any without '# Any: why' on its line: " + ", ".join(unexplained)
