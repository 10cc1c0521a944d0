"""Model converters (:mod:`hpc_mca.models.converters`): every finetuning type the config accepts
has one, it is the only place outside the config that tells the types apart (code that needs to
know what a type does asks the converter), and it stays importable on the login side."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_mca.config.sections import (
    FINETUNING_TYPES,
    RESERVED_FINETUNING_TYPES,
    FinetuningArguments,
)
from hpc_mca.models.converters import (
    CONVERTERS,
    ModelConverter,
    converter_for,
    trains_adapters_only,
)

PACKAGE = Path(__file__).resolve().parents[1] / "hpc_mca"
ALLOWED = (PACKAGE / "config", PACKAGE / "models" / "converters.py")
TYPE_NAMES = frozenset((*FINETUNING_TYPES, *RESERVED_FINETUNING_TYPES))
# "full" is also a recompute granularity: compared against, it is a finetuning type only where
# the other side reads finetuning_type.
SHARED_WORDS = frozenset({"full"})


def _strings(node: ast.AST) -> list[str]:
    """The strings ``node`` spells out: a string constant, or a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for elt in node.elts for s in _strings(elt)]
    return []


def _reads_type(node: ast.AST) -> bool:
    """Whether ``node`` reads a finetuning type (``x.finetuning_type``, ``finetuning_type``,
    ``record["finetuning_type"]``)."""
    return any(isinstance(n, ast.Attribute) and n.attr == "finetuning_type"
               or isinstance(n, ast.Name) and n.id == "finetuning_type"
               or isinstance(n, ast.Constant) and n.value == "finetuning_type"
               for n in ast.walk(node))


def _flagged(names: list[str], reads_type: bool, types: frozenset[str]) -> list[str]:
    return [n for n in names if n in types and (reads_type or n not in SHARED_WORDS)]


def type_comparisons(source: str, filename: str, types: frozenset[str] = TYPE_NAMES) -> list[str]:
    """``file:line: 'name'`` for every comparison (==, !=, in, is, match/case) against a
    finetuning type name."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            reads = any(_reads_type(op) for op in operands)
            names = [s for op in operands for s in _strings(op)]
        elif isinstance(node, ast.Match):
            reads = _reads_type(node.subject)
            names = [s for case in node.cases for n in ast.walk(case.pattern)
                     if isinstance(n, ast.MatchValue) for s in _strings(n.value)]
        else:
            continue
        found += [(node.lineno, n) for n in _flagged(names, reads, types)]
    # ast.walk goes breadth first: in line order (stable within a line) for the report.
    return [f"{filename}:{line}: {n!r}" for line, n in sorted(found, key=lambda f: f[0])]


def test_no_module_outside_the_config_and_the_converters_compares_finetuning_types():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if not any(path == allowed or allowed in path.parents for allowed in ALLOWED):
            found += type_comparisons(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, ("finetuning types compared outside hpc_mca/config and "
                       "hpc_mca/models/converters.py (ask converter_for(finetuning) instead):\n"
                       + "\n".join(found))


def test_the_comparison_checker_finds_each_form(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text("def f(ft, par, record):\n"
                    "    a = ft.finetuning_type == 'lora'\n"
                    "    b = 'full' != ft.finetuning_type\n"
                    "    c = record['finetuning_type'] in ('full', 'lora')\n"
                    "    d = kind == 'lora'\n"
                    "    e = par.recompute_granularity == 'full'  # a recompute granularity\n"
                    "    g = {'lora': 1}  # no comparison\n"
                    "    match ft.finetuning_type:\n"
                    "        case 'full':\n"
                    "            pass\n"
                    "    return converter_for(ft).trains_adapters\n")
    assert type_comparisons(fake.read_text(), "fake.py") == [
        "fake.py:2: 'lora'", "fake.py:3: 'full'", "fake.py:4: 'full'", "fake.py:4: 'lora'",
        "fake.py:5: 'lora'", "fake.py:8: 'full'"]


@pytest.mark.parametrize("name", FINETUNING_TYPES)
def test_every_finetuning_type_has_a_converter_of_its_name(name):
    converter = converter_for(FinetuningArguments(finetuning_type=name))
    assert isinstance(converter, ModelConverter) and converter.name == name
    assert set(CONVERTERS) == set(FINETUNING_TYPES)


def test_what_full_lora_and_freeze_change():
    full = converter_for(FinetuningArguments())
    lora = converter_for(FinetuningArguments(finetuning_type="lora"))
    freeze = converter_for(FinetuningArguments(finetuning_type="freeze"))
    assert (full.trains_adapters, full.can_merge, full.reference_is_base) == (False, False, False)
    assert (lora.trains_adapters, lora.can_merge, lora.reference_is_base) == (True, True, True)
    # freeze: no adapters (nothing to merge), its reference is a frozen copy of the model.
    assert (freeze.trains_adapters, freeze.can_merge, freeze.reference_is_base) == (False, False, False)
    assert full.resume_record("/nowhere") == {}
    assert full.frozen_sizing("/nowhere") is None
    # A name the rules will refuse plans as a full run, as before the rules run.
    assert not trains_adapters_only(FinetuningArguments(finetuning_type="oft"))
    assert not trains_adapters_only(FinetuningArguments(finetuning_type="freeze"))
    assert trains_adapters_only(FinetuningArguments(finetuning_type="lora"))


def test_the_login_side_imports_converters_without_torch():
    code = ("import sys, hpc_mca.models.converters, hpc_mca.checkpoint.compat\n"
            "heavy = [m for m in ('torch', 'peft', 'megatron', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
