"""The user guide (docs/, built by mkdocs.yml) and README.md stay true: the site builds with
``mkdocs build --strict`` (a broken link or anchor, or a page left out of the navigation, fails
it), every command block marked runnable runs (docs/writing-docs.md: the markers), README stays
short, and Troubleshooting names every error class a user can meet."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]

# <!-- runnable -->, <!-- runnable: exit=2 -->, <!-- runnable: slurm --> right above a bash block.
MARKER = re.compile(r"^<!--\s*runnable\b(?P<options>[^>]*?)-->\n(?P<fence>```(?P<lang>\w*)\n(?P<body>.*?)\n```)?",
                    re.M | re.S)
OPTION = re.compile(r"^(slurm|exit=\d+)$")
BLOCK_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    body: str
    slurm: bool
    exit_status: int

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def runnable_blocks(page: Path) -> list[Block]:
    """The page's marked blocks in page order; a marker that is not right above a bash block,
    or has an unknown option, is an error (it would silently run nothing)."""
    text = page.read_text()
    found = []
    for match in MARKER.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        options = [o for o in match["options"].replace(":", " ").replace(",", " ").split() if o]
        bad = [o for o in options if not OPTION.match(o)]
        if match["fence"] is None or match["lang"] not in ("bash", "sh") or bad:
            raise ValueError(f"{page.relative_to(REPO)}:{line}: a runnable marker must be right above a "
                             f"```bash block, options slurm or exit=N (got {options})")
        status = next((int(o.split("=")[1]) for o in options if o.startswith("exit=")), 0)
        found.append(Block(page, line, match["body"], "slurm" in options, status))
    return found


def _pages_with(slurm: bool) -> list[Path]:
    return [page for page in PAGES if any(b.slurm == slurm for b in runnable_blocks(page))]


def _workdir(folder: Path) -> dict[str, str]:
    """A fresh directory laid out as a checkout for the pages' commands (`hpc_mca/` for the
    demo's paths, `.venv` for `.venv/bin/python`), and the environment to run them in:
    `hpc-mca` on PATH, nothing of an enclosing job's HPC_MCA_*/SLURM_* settings."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hpc_mca").symlink_to(REPO / "hpc_mca")
    (folder / ".venv").symlink_to(Path(sys.prefix))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _run_blocks(blocks: list[Block], folder: Path) -> None:
    env = _workdir(folder)
    for block in blocks:
        started = time.monotonic()
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.body], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        output = (done.stdout + done.stderr)[-3000:]
        assert done.returncode == block.exit_status, (
            f"{block.where()} exited {done.returncode}, the page expects {block.exit_status}:\n{output}")
        print(f"{block.where()}: exit {done.returncode} in {time.monotonic() - started:.1f} s")


def test_markers_are_well_formed():
    blocks = [block for page in PAGES for block in runnable_blocks(page)]
    assert any(block.page.name == "README.md" for block in blocks)
    assert any(block.slurm for block in blocks) and any(block.exit_status for block in blocks)


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= 220, f"README.md has {lines} lines; move detail to a page under docs/"


@pytest.mark.slow
def test_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail("mkdocs and mkdocs-material are not installed: bin/setup-env installs them (the test extra)")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(site)], cwd=REPO,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for page in DOCS.glob("*.md"):
        html = site / "index.html" if page.stem == "index" else site / page.stem / "index.html"
        assert html.is_file(), f"{page.name} was not built"


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with(slurm=False), ids=lambda page: page.name)
def test_runnable_blocks(page, tmp_path):
    """The page's CPU blocks, in order, in one fresh directory."""
    _run_blocks([block for block in runnable_blocks(page) if not block.slurm], tmp_path / "work")


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.parametrize("page", _pages_with(slurm=True), ids=lambda page: page.name)
def test_runnable_slurm_blocks(page, tmp_path, slurm_cluster):
    """The page's Slurm blocks, in order, on the local cluster."""
    _run_blocks([block for block in runnable_blocks(page) if block.slurm], tmp_path / "work")


def _user_error_classes() -> set[str]:
    """The public exception classes of the package that carry a user's one-line error: every
    subclass, at any depth, of UserError, OpsError and CheckpointError (read from the source)."""
    bases: dict[str, set[str]] = {}
    for path in (REPO / "hpc_mca").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, (ast.Name, ast.Attribute))}
                bases.setdefault(node.name, set()).update(names)
    found = {"UserError", "OpsError", "CheckpointError"}
    while True:
        more = {name for name, parents in bases.items() if parents & found} - found
        if not more:
            return {name for name in found if not name.startswith("_")}
        found |= more


def test_troubleshooting_names_every_error_class():
    page = (DOCS / "troubleshooting.md").read_text()
    classes = _user_error_classes()
    assert {"ConfigError", "DataError", "LayoutError", "CheckpointSpaceError"} <= classes
    missing = sorted(name for name in classes if f"`{name}`" not in page)
    assert not missing, f"docs/troubleshooting.md has no row for {missing}"
