"""The settings ledger (tests/settings_ledger.yaml, issue #37), enforced.

Every field of the run config's five sections (the dataclasses of hpc_mca.config.sections's
TrainConfig) has one row saying what it observably changes and which tests show it, or when the
rules refuse it. Checked here, without starting a trainer:

(a) every field has a row and every row names a field (a field added, renamed or removed
    without its row fails, naming the field);
(b) every test a row lists exists: the file is there and defines that test function (parsed,
    not imported);
(c) every row has at least one test or a ``refused`` entry, and no row carries ``missing``
    (a field whose effect no test shows yet: the row says what that test must assert).

The checks are plain functions of the sections and the ledger, so the tests at the end can
show them catching a field added without a row, and a row naming a test that does not exist.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpc_mca.config.sections import TrainConfig, TrainingArguments

REPO = Path(__file__).resolve().parents[1]
LEDGER = Path(__file__).with_name("settings_ledger.yaml")
LEDGER_NAME = "tests/settings_ledger.yaml"

KEYS = {"effect", "tests", "refused", "refused_tests", "missing"}
"""A row's keys: effect and tests always; refused, refused_tests and missing when they apply."""


def config_sections() -> dict[str, type]:
    """Section name -> its dataclass, as TrainConfig declares them."""
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def config_fields(sections: Mapping[str, type]) -> list[str]:
    """Every dotted field name (section.field) of ``sections``, in declaration order."""
    return [f"{section}.{f.name}" for section, cls in sections.items()
            for f in dataclasses.fields(cls)]


def load_ledger(path: Path = LEDGER) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text()) or {}
    assert isinstance(data, dict), f"{LEDGER_NAME}: the top level must be a mapping of fields"
    return data


# --- (a) coverage ------------------------------------------------------------------------------


def coverage_problems(sections: Mapping[str, type], ledger: Mapping[str, Any]) -> list[str]:
    """One line per field without a row, per row naming no field, per malformed row."""
    fields = config_fields(sections)
    known = set(fields)
    problems = [
        f"{name}: no row in {LEDGER_NAME}; add one: {{effect: what it changes that a test can "
        f"observe, tests: [tests that assert it], refused: when the rules refuse it (optional), "
        f"missing: what a test would have to assert (while none does)}}"
        for name in fields if name not in ledger]
    for name, row in ledger.items():
        if name not in known:
            problems.append(f"{name}: the row names no field of the run config; rename or remove "
                            f"it in {LEDGER_NAME} (fields are section.name, e.g. "
                            "training.learning_rate)")
            continue
        problems += [f"{name}: {line}" for line in _row_shape_problems(row)]
    return problems


def _row_shape_problems(row: Any) -> list[str]:
    if not isinstance(row, dict):
        return ["the row must be a mapping with effect and tests"]
    problems = []
    unknown = sorted(set(row) - KEYS)
    if unknown:
        problems.append(f"unknown key(s) {', '.join(map(str, unknown))}; valid: "
                        + ", ".join(sorted(KEYS)))
    if not isinstance(row.get("effect"), str) or not row["effect"].strip():
        problems.append("effect must be a sentence saying what the field observably changes")
    for key in ("tests", "refused_tests"):
        if key == "refused_tests" and key not in row:
            continue  # optional
        value = row.get(key)
        if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
            problems.append(f"{key} must be a list of 'tests/test_x.py::test_name' strings "
                            "(tests: [] when there is none)")
    for key in ("refused", "missing"):
        if key in row and (not isinstance(row[key], str) or not row[key].strip()):
            problems.append(f"{key} must be a non-empty sentence")
    return problems


# --- (b) the listed tests exist ----------------------------------------------------------------


@functools.cache
def _test_names(path: Path) -> frozenset[str]:
    """What pytest would collect from ``path`` by name: ``test_x`` (top-level functions, and
    methods of Test classes, which may also be named ``TestClass::test_x``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions) and node.name.startswith("test"):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, functions) and item.name.startswith("test"):
                    names.update({item.name, f"{node.name}::{item.name}"})
    return frozenset(names)


def reference_problem(reference: str, root: Path = REPO) -> str | None:
    """Why ``reference`` (tests/test_x.py::test_name or ::Class::test_name) names no test
    under ``root``; None when it does."""
    path, sep, name = reference.partition("::")
    if not sep or not name or "[" in name:
        return (f"{reference!r} is not 'tests/test_x.py::test_name' (parametrised tests are "
                "named without their parameters)")
    file = root / path
    if not file.is_file():
        return f"{reference!r}: no file {path}"
    if name not in _test_names(file):
        return f"{reference!r}: {path} defines no test {name}"
    return None


def reference_problems(ledger: Mapping[str, Any], root: Path = REPO) -> list[str]:
    """One line per listed test (tests and refused_tests) that does not exist."""
    problems = []
    for name, row in ledger.items():
        if not isinstance(row, dict):
            continue
        for key in ("tests", "refused_tests"):
            for reference in row.get(key) or []:
                problem = reference_problem(str(reference), root)
                if problem:
                    problems.append(f"{name}: {key} lists {problem}; fix the name or the row")
    return problems


# --- (c) evidence -----------------------------------------------------------------------------


def evidence_problems(ledger: Mapping[str, Any]) -> list[str]:
    """One line per row that shows neither a test nor a refusal, or that says a test is
    missing."""
    problems = []
    for name, row in ledger.items():
        if not isinstance(row, dict):
            continue
        if row.get("missing"):
            problems.append(f"{name}: no test shows its effect; write one that asserts: "
                            f"{row['missing'].strip()} -- then list it under tests and drop "
                            f"'missing' from its row in {LEDGER_NAME}")
        elif not row.get("tests") and not row.get("refused"):
            problems.append(f"{name}: the row lists no test and no refusal; list the tests "
                            "that assert its effect, or say when the rules refuse it")
    return problems


def _report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n" + "\n".join(f"  {p}" for p in problems)


# --- the ledger of this repository ------------------------------------------------------------


@pytest.fixture(scope="module")
def ledger() -> dict[str, Any]:
    return load_ledger()


def test_every_field_has_a_row_and_every_row_a_field(ledger):
    problems = coverage_problems(config_sections(), ledger)
    assert not problems, _report(problems, f"problem(s) with {LEDGER_NAME}'s rows")


def test_every_listed_test_exists(ledger):
    problems = reference_problems(ledger)
    assert not problems, _report(problems, "listed test(s) that do not exist")


def test_every_field_shows_its_effect_or_its_refusal(ledger):
    problems = evidence_problems(ledger)
    assert not problems, _report(problems, "field(s) whose effect no test shows")


# --- the checks catch what they are for -------------------------------------------------------


def _with_extra_training_field() -> dict[str, type]:
    """The run config's sections, with a TrainingArguments that has one field more."""
    extended = dataclasses.make_dataclass(
        "ExtendedTrainingArguments", [("brand_new_knob", int, dataclasses.field(default=3))],
        bases=(TrainingArguments,))
    return {**config_sections(), "training": extended}


def test_a_new_field_without_a_row_is_reported(ledger):
    problems = coverage_problems(_with_extra_training_field(), ledger)
    assert len(problems) == 1, problems
    assert problems[0].startswith("training.brand_new_knob: no row in tests/settings_ledger.yaml")


def test_a_row_without_a_field_and_a_missing_test_are_reported(ledger):
    fake = {"training.learnig_rate": {"effect": "x", "tests": []}}
    problems = coverage_problems(config_sections(), {**ledger, **fake})
    assert len(problems) == 1, problems
    assert problems[0].startswith("training.learnig_rate: the row names no field")
    odd = {**ledger, "training.seed": {"effect": "", "tests": "tests/test_x.py::test_a",
                                       "refused_tst": []}}
    problems = coverage_problems(config_sections(), odd)
    assert [p.split(": ", 1)[1].split(" ", 2)[:2] for p in problems] == [
        ["unknown", "key(s)"], ["effect", "must"], ["tests", "must"]], problems
    rows = {"training.seed": {"effect": "x", "tests": [
        "tests/test_settings_ledger.py::test_every_listed_test_exists",
        "tests/test_settings_ledger.py::test_that_is_not_there",
        "tests/no_such_file.py::test_x",
        "tests/test_lr_scheduler.py::test_bad_input_is_one_line[linear]"]}}
    problems = reference_problems(rows)
    assert len(problems) == 3, problems
    assert "defines no test test_that_is_not_there" in problems[0]
    assert "no file tests/no_such_file.py" in problems[1]
    assert "named without their parameters" in problems[2]
    assert all(p.startswith("training.seed: tests lists ") for p in problems)


def test_test_classes_and_helpers_are_told_apart(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "def test_a():\n    pass\n\ndef _helper():\n    pass\n\n"
        "class TestGroup:\n    def test_b(self):\n        pass\n\n"
        "class Helper:\n    def test_c(self):\n        pass\n")
    ok = ["tests/test_x.py::test_a", "tests/test_x.py::test_b",
          "tests/test_x.py::TestGroup::test_b"]
    assert [reference_problem(r, tmp_path) for r in ok] == [None, None, None]
    for bad in ("tests/test_x.py::_helper", "tests/test_x.py::test_c",
                "tests/test_x.py::Helper::test_c"):
        assert reference_problem(bad, tmp_path) is not None, bad


def test_missing_and_empty_rows_fail_the_evidence_check():
    rows = {"a.x": {"effect": "e", "tests": [], "missing": "that x moves y"},
            "a.y": {"effect": "e", "tests": []},
            "a.z": {"effect": "e", "tests": [], "refused": "outside stage=dpo"},
            "a.w": {"effect": "e", "tests": ["tests/test_x.py::test_a"]}}
    problems = evidence_problems(rows)
    assert [p.split(":", 1)[0] for p in problems] == ["a.x", "a.y"]
    assert "write one that asserts: that x moves y" in problems[0]
