"""The import direction of hpc_mca's packages, read from the source (no import is executed).

The rule, written once: every module has a layer (the longest matching entry of LAYERS) and
imports only modules of its own layer or lower ones. The login side (``slurm``, ``cli``) sits
on top of the rank side; the training loop sits on its checkpointer, models, runtime and
data, never the other way round.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hpc_mca"

LAYERS = {
    # 0: contracts everyone shares: the bad-input base class, the run directory's files, the
    # stage registry (pure data: each stage's traits and where its objectives live).
    "errors": 0, "frozen": 0, "rundir": 0, "stages": 0,
    # 1: pure planning and data: no knowledge of the trainer. Each owns its config section.
    "topology": 1, "data": 1,
    # 2: the run config: sections, rules, schedule names, run length (the login side validates
    # configs with it too).
    "config": 2,
    # 3: a script's arguments (transformers' and ROLL's shape; a view onto the run config).
    "training_args": 3,
    # 3-7: the rank side, bottom up: what both backends' loops share (3-6), then the backends;
    # a script's own peft LoRA calls (adapters) on the models.
    "runtime": 3, "models": 4, "checkpoint": 5, "adapters": 5, "loop": 6, "trainer": 7, "standard": 7,
    # 8: the Python API (TrainingArguments, AutoModel, McaTrainer) over the Megatron backend.
    "api": 8,
    # 9: from a config to the backend it names (the Megatron one through the API).
    "launch": 9,
    # 10-11: the login side and the entry points.
    "slurm": 10, "cli": 11, "assets": 11, "__main__": 12, "__init__": 12,
}


FACADES = {"models": {"api.model"}, "trainer": {"api.trainer"}}
"""Packages that re-export Python API names where mcore_adapter's scripts import them
(``hpc_mca.models.AutoModel``, ``hpc_mca.trainer.McaTrainer``): their ``__init__`` may import
these API modules, lazily (a module ``__getattr__``), and nothing else above them. These
imports are not edges of the layers or of the package graph."""


def _facade_import(module: str, target: str) -> bool:
    return target in FACADES.get(module, set())


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> int:
    """The layer of ``module`` (dotted, below hpc_mca): its longest prefix in LAYERS."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in LAYERS:
            return LAYERS[".".join(parts[:end])]
    raise KeyError(f"hpc_mca.{module} has no layer: add its package to LAYERS")


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dotted module below hpc_mca) for every hpc_mca import in ``path``."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            names = [".".join([*base, node.module] if node.module else base)]
            names = ["hpc_mca." + name for name in names]
            if not node.module:  # from . import x, y: each name is a module or a symbol
                names = [f"{names[0]}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
            if node.module == "hpc_mca":
                names = [f"hpc_mca.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(node.lineno, name.removeprefix("hpc_mca.")) for name in names
                  if name.startswith("hpc_mca.")]
    return found


def _package(module: str) -> str:
    return module.split(".")[0]


def violations(package: Path = PACKAGE) -> list[str]:
    """Each import of a higher layer, or of another package of the same layer (two packages
    side by side, like the two backends, never reach into each other)."""
    lines = []
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package)
        for lineno, target in _imports(path, module):
            if _facade_import(module, target):
                continue
            sideways = layer(target) == layer(module) and _package(target) != _package(module)
            if layer(target) > layer(module) or sideways:
                lines.append(f"{path.relative_to(package.parent)}:{lineno}: {module} (layer "
                             f"{layer(module)}) imports {target} (layer {layer(target)})")
    return lines


def package_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Top-level package -> the other top-level packages its modules import."""
    graph: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package)
        graph.setdefault(_package(module), set()).update(
            _package(target) for _, target in _imports(path, module)
            if _package(target) != _package(module) and not _facade_import(module, target))
    return graph


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``, each as the path from its smallest name back to it (a depth-
    first search from every node; the graph is a dozen packages)."""
    found = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                found.add(tuple(path))
            elif nxt not in path and nxt > start:
                walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return [list(cycle) for cycle in sorted(found)]


def test_no_package_imports_a_higher_one():
    assert violations() == []


def test_no_package_cycle():
    assert package_cycles(package_graph()) == []


def test_the_rule_catches_an_upward_import(tmp_path):
    """The checker itself: a checkpoint module that imports the login side is reported, and
    so is one backend importing the other."""
    fake = tmp_path / "hpc_mca"
    (fake / "checkpoint").mkdir(parents=True)
    (fake / "standard").mkdir()
    (fake / "checkpoint" / "bad.py").write_text(
        "from hpc_mca.slurm.commands import run\nfrom ..trainer import trainer\n"
        "from .store import read_tracker\n")
    (fake / "standard" / "bad.py").write_text("from hpc_mca.trainer.dpo import METRICS\n")
    assert violations(fake) == [
        "hpc_mca/checkpoint/bad.py:1: checkpoint.bad (layer 5) imports slurm.commands (layer 10)",
        "hpc_mca/checkpoint/bad.py:2: checkpoint.bad (layer 5) imports trainer (layer 7)",
        "hpc_mca/standard/bad.py:1: standard.bad (layer 7) imports trainer.dpo (layer 7)",
    ]


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert package_cycles(graph) == [["a", "b", "c"], ["e", "e2"]]


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (imports for annotations only: no edge)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(sub) for child in node.body for sub in ast.walk(child))
    return skip


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of its own package it imports at run time (module level or in a
    function; imports for type checking only are left out), each by dotted name below hpc_mca."""
    modules = {_module_name(path, package): path for path in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_only(tree)
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                names = [alias.name.removeprefix("hpc_mca.") for alias in node.names]
            else:
                stem = (".".join([*base[:len(base) - node.level + 1], *([node.module] if node.module else [])])
                        if node.level else (node.module or "").removeprefix("hpc_mca"))
                stem = stem.lstrip(".")
                names = [stem, *(f"{stem}.{alias.name}" for alias in node.names)]
            targets.update(n for n in names if n in modules and n != module)
        graph[module] = {t for t in targets if _package(t) == _package(module)}
    return graph


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each strongly connected set of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_module_import_circle_in_any_package():
    """Within every package, the modules' run-time imports form no circle (a bottom-of-file
    or function-local import does not hide one: both count)."""
    assert module_cycles(module_graph()) == []


def test_the_module_circle_finder_finds_a_function_local_circle(tmp_path):
    fake = tmp_path / "hpc_mca"
    (fake / "config").mkdir(parents=True)
    (fake / "config" / "a.py").write_text("from .b import x\n")
    (fake / "config" / "b.py").write_text("def f():\n    from .a import y\n")
    (fake / "config" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from .a import z\n")
    (fake / "config" / "d.py").write_text("from hpc_mca.config.c import w\n")
    graph = module_graph(fake)
    assert graph["config.c"] == set() and graph["config.d"] == {"config.c"}
    assert module_cycles(graph) == [["config.a", "config.b"]]


def test_no_module_imports_another_modules_private_name():
    """A name with a leading underscore is its module's own: no other module imports it."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hpc_mca")):
                found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {alias.name}"
                          for alias in node.names if alias.name.startswith("_")]
    assert found == []


def private_reaches(package: Path = PACKAGE) -> list[str]:
    """``obj._name`` where ``_name`` is a private member (a method, or an attribute set on
    ``self``) of one of the package's classes and the access is not inside that class: one
    class reaching into another's internals. Reaching a library's private member (a documented
    patch or a workaround) is not the package's own coupling and is left to the patch table."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(package.rglob("*.py"))}
    owners: dict[str, set[str]] = {}  # private member -> the classes defining it
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                name = None
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = node.name
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                        isinstance(node.value, ast.Name) and node.value.id == "self":
                    name = node.attr
                if name and name.startswith("_") and not name.startswith("__"):
                    owners.setdefault(name, set()).add(cls.name)
    found = []
    for path, tree in trees.items():
        def visit(node: ast.AST, inside: str | None) -> None:
            for child in ast.iter_child_nodes(node):
                here = child.name if isinstance(child, ast.ClassDef) else inside
                if isinstance(child, ast.Attribute) and child.attr in owners and not (
                        isinstance(child.value, ast.Name) and child.value.id in ("self", "cls")) and not (
                        isinstance(child.value, ast.Call) and ast.unparse(child.value.func) == "super") and \
                        inside not in owners[child.attr]:
                    found.append(f"{path.relative_to(package.parent)}:{child.lineno}: {ast.unparse(child)}")
                visit(child, here)
        visit(tree, None)
    return found


def test_no_class_reaches_another_classes_private_member():
    """A private member (leading underscore) is used by its own class only: what another class
    needs is public (the Python API's trainer gathers parameters through
    ``Trainer.gather_params``, not ``_gather_params``)."""
    assert private_reaches() == []


def test_the_private_reach_finder_finds_one(tmp_path):
    fake = tmp_path / "hpc_mca"
    fake.mkdir()
    (fake / "a.py").write_text("class A:\n    def __init__(self):\n        self._x = 1\n\n"
                               "    def same(self, other):\n        return other._x\n")
    (fake / "b.py").write_text("def f(a):\n    return a._x + a._unknown_library_member\n")
    assert private_reaches(fake) == ["hpc_mca/b.py:2: a._x"]


def library_patches(package: Path = PACKAGE) -> dict[str, list[str]]:
    """File -> the attributes of other libraries it assigns (``mtp.roll_tensor = ...``,
    ``torch.cuda.Event = ...``): an assignment whose target's root name was bound by an import
    of a module outside hpc_mca."""
    found: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        libraries = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):  # (sys.argv is the process's, not a library's)
                libraries.update((a.asname or a.name).split(".")[0] for a in node.names
                                 if not a.name.startswith(("hpc_mca", "sys")))
            elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("hpc_mca"):
                libraries.update(a.asname or a.name for a in node.names)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and _root(target) in libraries:
                    found.setdefault(str(path.relative_to(package.parent)), []).append(ast.unparse(target))
    return found


def test_every_library_patch_is_listed_in_the_docs():
    """The table under "Library patches" (docs/internals.md) names every file that patches a
    library."""
    import re

    text = (PACKAGE.parent / "docs" / "internals.md").read_text()
    table = text[text.index("| where | what it replaces | when |"):].split("\n\n", 1)[0]
    listed = set(re.findall(r"^\| `(hpc_mca/[\w/]+\.py)` \|", table, re.M))
    patches = library_patches()
    assert set(patches) == listed, patches
    assert "torch.cuda.Event" in patches["hpc_mca/runtime/cpu_compat.py"]  # the finder finds one


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer(_module_name(path))


# The checkpointer sees the training loop only through checkpoint.state.Resumable (model,
# optimizer, state_dict/load_state_dict): no function of these packages sets an attribute of an
# object it was handed (``trainer.state.global_step = ...`` with ``trainer`` a parameter); it
# may set its own (``self.x``).
OWN_STATE_ONLY = ("checkpoint",)


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def foreign_attribute_writes(package: Path = PACKAGE) -> list[str]:
    lines = []
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package)
        if not module.startswith(OWN_STATE_ONLY):
            continue
        for func in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = func.args
            handed = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]} - {"self", "cls"}
            for node in ast.walk(func):
                for leaf in ast.walk(node) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) else ():
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store) \
                            and _root(leaf) in handed:
                        lines.append(f"{path.relative_to(package.parent)}:{node.lineno}: "
                                     f"{module}.{func.name} sets {ast.unparse(leaf)}")
    return lines


def test_the_checkpointer_writes_no_attribute_of_the_loop():
    assert foreign_attribute_writes() == []


def test_the_attribute_rule_catches_a_write_from_outside(tmp_path):
    """The checker itself: the pre-refactor resume (the checkpointer setting the trainer's
    counters) is reported; a checkpointer's own attributes are not."""
    fake = tmp_path / "hpc_mca" / "checkpoint"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text(
        "def resume(self, trainer, saved):\n"
        "    self.last_saved_step = saved['global_step']\n"
        "    trainer.state.global_step = saved['global_step']\n"
        "    trainer.skipped_iters += 1\n")
    assert foreign_attribute_writes(fake.parent) == [
        "hpc_mca/checkpoint/bad.py:3: checkpoint.bad.resume sets trainer.state.global_step",
        "hpc_mca/checkpoint/bad.py:4: checkpoint.bad.resume sets trainer.skipped_iters",
    ]


def test_layout_table_names_every_package():
    """The layout table (docs/internals.md) and ARCHITECTURE.md's layer table name exactly the
    packages on disk, and the layer table agrees with LAYERS."""
    import re

    root = PACKAGE.parent
    on_disk = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_")}
    listed = set(re.findall(r"^\| `hpc_mca/(\w+)/", (root / "docs" / "internals.md").read_text(), re.M))
    assert listed == on_disk
    layers = {}
    for row in re.findall(r"^\| (\d+)(?:–\d+)? \| ([^|]+) \|", (root / "ARCHITECTURE.md").read_text(), re.M):
        for name in re.findall(r"`(\w+)`", row[1]):
            layers[name] = int(row[0])
    assert set(layers) >= on_disk
    assert {name: layers[name] for name in on_disk} == {name: LAYERS[name] for name in on_disk}
