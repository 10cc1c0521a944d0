"""The standard backend reaches transformers through its public API only.

transformers' ``Trainer`` changes its private methods between releases without notice; a
subclass that overrides or calls one can break silently on an upgrade (a step end never
called, a file never written). So :mod:`hpc_mca.standard` may not define ``_``-methods in a
Trainer subclass, touch a private member of transformers' Trainer, or pass a private keyword
(``save_model(..., _internal_call=True)``), except in its one adapter module
(``hpc_mca/standard/hf_adapter.py``), whose private names are checked here against the
installed transformers, which must lie in the range ``pyproject.toml`` declares.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
import tomllib
from functools import lru_cache
from pathlib import Path

import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from hpc_mca.standard import hf_adapter

ROOT = Path(__file__).resolve().parent.parent
STANDARD = ROOT / "hpc_mca" / "standard"
ADAPTER = "hf_adapter.py"


@lru_cache(maxsize=1)
def trainer_private_names() -> frozenset[str]:
    """transformers.Trainer's private members: its class attributes and every ``self._x`` its
    module assigns (instance state such as ``_tr_loss``); dunders are Python's, not its."""
    names = {name for name in dir(transformers.Trainer)}
    source = Path(inspect.getfile(transformers.Trainer)).read_text()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and isinstance(node.ctx, ast.Store)):
            names.add(node.attr)
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__"))


def _trainer_classes(trees: dict[str, ast.Module]) -> set[str]:
    """Names of the classes (in ``trees``) that derive from transformers' Trainer, directly or
    through each other."""
    classes = {node.name: node for tree in trees.values() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef)}
    found = {"Trainer"}
    changed = True
    while changed:
        changed = False
        for name, node in classes.items():
            bases = {ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases}
            if name not in found and bases & found:
                found.add(name)
                changed = True
    return found - {"Trainer"}


def private_uses(package: Path = STANDARD, adapter: str = ADAPTER) -> list[str]:
    """``file:line: what`` for each reach into transformers' Trainer internals outside
    ``adapter``."""
    trees = {path.name: ast.parse(path.read_text()) for path in sorted(package.glob("*.py"))}
    subclasses = _trainer_classes(trees)
    private = trainer_private_names()
    found = []
    for name, tree in trees.items():
        if name == adapter:
            continue
        where = f"{package.name}/{name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in subclasses:
                found += [f"{where}:{item.lineno}: {node.name} defines {item.name}"
                          for item in node.body
                          if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and item.name.startswith("_") and item.name != "__init__"]
            elif isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{where}:{node.lineno}: uses {ast.unparse(node)}")
            elif isinstance(node, ast.keyword) and node.arg and node.arg.startswith("_"):
                found.append(f"{where}:{node.value.lineno}: passes {node.arg}=")
    return sorted(found)


def test_the_standard_backend_uses_public_transformers_api_only():
    assert private_uses() == []


def test_the_private_use_checker_catches_each_kind(tmp_path):
    """The checker itself: a private override, a call through super() and through another
    object, a private keyword; a subclass of a subclass is still a Trainer; the adapter and a
    non-Trainer class's own helpers are not reported."""
    package = tmp_path / "standard"
    package.mkdir()
    (package / "base.py").write_text(textwrap.dedent("""\
        from transformers import Trainer
        class Mine(Trainer):
            def _maybe_log_save_evaluate(self, *args):
                return super()._maybe_log_save_evaluate(*args)
            def compute_loss(self, model, inputs, **kwargs):
                return self._tr_loss
        """))
    (package / "dpo.py").write_text(textwrap.dedent("""\
        from .base import Mine
        class Deeper(Mine):
            def _helper(self):
                return 1
        class Helper:
            def _own(self):
                return self._sums
        def save(trainer, path):
            trainer.save_model(path, _internal_call=True)
            trainer._save_rng_state(path)
        """))
    (package / "hf_adapter.py").write_text(textwrap.dedent("""\
        from transformers import Trainer
        class Adapted(Trainer):
            def _get_grad_norm(self, model, grad_norm=None):
                return super()._get_grad_norm(model, grad_norm=grad_norm)
        """))
    assert private_uses(package) == [
        "standard/base.py:3: Mine defines _maybe_log_save_evaluate",
        "standard/base.py:4: uses super()._maybe_log_save_evaluate",
        "standard/base.py:6: uses self._tr_loss",
        "standard/dpo.py:10: uses trainer._save_rng_state",
        "standard/dpo.py:3: Deeper defines _helper",
        "standard/dpo.py:9: passes _internal_call=",
    ]


def _declared_transformers() -> SpecifierSet:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in dependencies:
        match = re.fullmatch(r"transformers\s*([^;]*)", requirement.strip())
        if match:
            return SpecifierSet(match.group(1))
    raise AssertionError("pyproject.toml declares no transformers requirement")


def _step_loop_source() -> str:
    """The source of the Trainer method that takes the optimizer steps (its name changes
    between releases: the one that fetches each step's batches)."""
    for name, member in inspect.getmembers(transformers.Trainer, inspect.isfunction):
        source = inspect.getsource(member)
        if "self.get_batch_samples(" in source and name != "get_batch_samples":
            return source
    raise AssertionError("no transformers.Trainer method calls get_batch_samples")


def test_the_adapter_matches_the_declared_transformers_range():
    """The adapter's private names exist, with the parameters it passes, in the installed
    transformers, which lies in the declared range; and the training loop still calls the
    two hooks the step end depends on (so the grad norm and the step's count are not dropped
    silently by an upgrade)."""
    declared = _declared_transformers()
    assert Version(transformers.__version__) in declared, (transformers.__version__, str(declared))
    assert any(spec.operator in ("<", "<=", "~=", "==") for spec in declared), \
        f"the transformers range {declared} has no upper bound: the adapter is pinned to it"
    members = {name: inspect.signature(getattr(transformers.Trainer, name))
               for name in hf_adapter.PRIVATE_MEMBERS}
    assert list(members["_get_grad_norm"].parameters) == ["self", "model", "grad_norm"]
    assert list(members["_save_optimizer_and_scheduler"].parameters) == ["self", "output_dir"]
    assert list(members["_save_rng_state"].parameters) == ["self", "output_dir"]
    loop = _step_loop_source()
    # The step end (an on_step_end callback) needs the step's norm, update and count in.
    order = ["self._get_grad_norm(", "self.optimizer.step()", "self.state.global_step += 1",
             "callback_handler.on_step_end("]
    assert [loop.find(mark) for mark in order] == sorted(loop.find(mark) for mark in order)
    assert -1 not in [loop.find(mark) for mark in order]
