"""Every third-party package that hpc_mca imports is one that installing hpc-mca installs.

Read from the source (no import is executed): a module imported only because another
dependency happens to pull it in works here and fails on the next machine (``datasets`` came
in through trl, a test extra, until a borrowed GPU box without it said so).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

NOT_INSTALLED_HERE = {"transformer_engine": "transformer-engine", "flash_attn": "flash-attn"}
"""Optional GPU packages: absent from CPU machines, so their distribution is named here."""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: Path = REPO / "pyproject.toml", extras: tuple[str, ...] = ("gpu", "trackers")) -> set[str]:
    """Distributions that ``pip install hpc-mca[gpu,trackers]`` asks for by name."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = [*project["dependencies"],
                    *(r for extra in extras for r in project["optional-dependencies"][extra])]
    return {_normal(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in requirements}


def imported(package: Path) -> dict[str, str]:
    """Top-level third-party module -> the first ``file:line`` that imports it."""
    found: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                # (_typeshed: the standard library's stubs, imported for annotations only)
                if top not in sys.stdlib_module_names | {"_typeshed"} and top != package.name:
                    found.setdefault(top, f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def undeclared(package: Path = REPO / "hpc_mca", pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    distributions = packages_distributions()
    wanted = declared(pyproject)
    lines = []
    for module, where in sorted(imported(package).items()):
        names = distributions.get(module) or [NOT_INSTALLED_HERE.get(module, module)]
        if not any(_normal(name) in wanted for name in names):
            lines.append(f"{where}: imports {module} (distribution {', '.join(names)}), "
                         f"not in pyproject.toml's dependencies")
    return lines


def test_every_imported_package_is_a_declared_dependency():
    assert undeclared() == []


def test_the_check_catches_a_package_that_only_comes_along(tmp_path):
    """The checker itself: ``datasets`` imported, but only ``torch`` declared."""
    package = tmp_path / "hpc_mca"
    package.mkdir()
    (package / "mix.py").write_text("import os\nimport torch\nfrom . import other\n\n"
                                    "def f():\n    import datasets\n")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["torch>=2.6"]\n'
                         '[project.optional-dependencies]\ngpu = []\ntrackers = []\n')
    assert undeclared(package, pyproject) == [
        "hpc_mca/mix.py:6: imports datasets (distribution datasets), "
        "not in pyproject.toml's dependencies"]
