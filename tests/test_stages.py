"""The stage registry (:mod:`hpc_mca.stages`): its rows resolve, its names are the only ones
the config, planner and CLI accept, and no module outside it compares against a stage name
(code that needs to know what a stage does asks the registry for the trait)."""

from __future__ import annotations

import ast
import inspect
import sys
import types
from pathlib import Path

import click
import pytest
import torch

from hpc_mca.stages import RESERVED_STAGES, STAGE_NAMES, STAGES, get_stage, load, stage_context, stages_where

PACKAGE = Path(__file__).resolve().parents[1] / "hpc_mca"
REGISTRY = PACKAGE / "stages"


def _stage_strings(node: ast.expr, names: frozenset[str]) -> list[str]:
    """The stage names ``node`` spells out: a string constant, or a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in names else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for elt in node.elts for name in _stage_strings(elt, names)]
    return []


def stage_comparisons(source: str, filename: str,
                      names: frozenset[str] = frozenset((*STAGE_NAMES, *RESERVED_STAGES))
                      ) -> list[str]:
    """``file:line: 'name'`` for every comparison (==, !=, in, not in, is) one of whose
    operands is a stage name or a collection of them."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [f"{filename}:{node.lineno}: {name!r}"
                          for name in _stage_strings(operand, names)]
    return found


def test_no_module_outside_the_registry_compares_against_a_stage_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if REGISTRY not in path.parents:
            found += stage_comparisons(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, ("stage names compared outside hpc_mca/stages (ask get_stage(name) for "
                       "the trait instead):\n" + "\n".join(found))


def test_the_comparison_checker_finds_each_form(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text("def f(stage, c):\n"
                    "    a = stage == 'dpo'\n"
                    "    b = 'pt' != c.finetuning.stage\n"
                    "    d = stage in ('sft', 'dpo')\n"
                    "    e = stage not in {'pt'}\n"
                    "    g = stage == 'full'  # not a stage name\n"
                    "    h = {'dpo': 1}  # no comparison\n"
                    "    return get_stage(stage).reads == 'text'\n")
    found = stage_comparisons(fake.read_text(), "fake.py",
                              frozenset(("pt", "sft", "dpo")))
    assert found == ["fake.py:2: 'dpo'", "fake.py:3: 'pt'", "fake.py:4: 'sft'",
                     "fake.py:4: 'dpo'", "fake.py:5: 'pt'"]


def test_the_registry_is_pure_data():
    """Layer 0 and read on login nodes: the standard library only (no torch, nothing of
    hpc_mca); the implementations are strings until a backend loads them."""
    for path in REGISTRY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [(node.module or "").split(".")[0]] if not node.level else ["."]
            else:
                continue
            assert all(r in sys.stdlib_module_names or r == "__future__" for r in roots), (
                f"{path}:{node.lineno} imports {roots}")


def test_names_are_unique_and_the_reserved_ones_are_not_stages():
    assert len(set(STAGE_NAMES)) == len(STAGES)
    assert not set(RESERVED_STAGES) & set(STAGE_NAMES)
    assert [get_stage(name).name for name in STAGE_NAMES] == list(STAGE_NAMES)
    with pytest.raises(KeyError):
        get_stage("ppo")


@pytest.mark.parametrize("stage", STAGES, ids=STAGE_NAMES)
def test_every_backend_path_imports_and_names_a_class(stage):
    from hpc_mca.standard.trainer import StandardTrainer
    from hpc_mca.trainer.objective import Objective

    objective, trainer = load(stage.megatron), load(stage.standard)
    assert inspect.isclass(objective) and issubclass(objective, Objective)
    assert inspect.isclass(trainer) and issubclass(trainer, StandardTrainer)
    assert stage.rows_per_example >= 1 and stage.extra_forwards >= 0


def test_the_exact_match_trait_is_the_objective_that_adds_the_metric():
    from hpc_mca.config.sections import TrainConfig
    from hpc_mca.trainer.stages import OBJECTIVES

    ctx = types.SimpleNamespace(device=torch.device("cpu"))
    for stage in STAGES:
        metric = OBJECTIVES[stage.name](TrainConfig(), ctx, 32).eval_metric()
        assert (metric is not None) == stage.exact_match, stage.name


def test_the_cli_the_config_and_the_planner_accept_the_registry_names():
    from hpc_mca.cli._options import plan_options
    from hpc_mca.config.rules import _check_stage
    from hpc_mca.config.sections import DATASET_FORMATS, ConfigError, TrainConfig
    from hpc_mca.data.records import FORMATS_BY_READS

    command = plan_options(click.command()(lambda **kwargs: None))
    stage_help = next(p.help for p in command.params if p.name == "stage")
    assert stage_help.startswith(f"{', '.join(STAGE_NAMES[:-1])} or {STAGE_NAMES[-1]};")
    for name in STAGE_NAMES:
        config = TrainConfig()
        config.finetuning.stage = name
        _check_stage(config, 1)
    config.finetuning.stage = "ppo"
    with pytest.raises(ConfigError, match="valid: " + ", ".join(STAGE_NAMES)):
        _check_stage(config, 1)
    # Every way a stage reads rows has its tokenizer and its formats (each a dataset_format).
    from hpc_mca.data.dataset import _READERS

    assert set(FORMATS_BY_READS) == set(_READERS) == {stage.reads for stage in STAGES}
    assert {"auto", *(f for fits in FORMATS_BY_READS.values() for f in fits)} == set(
        DATASET_FORMATS)


def test_messages_name_the_stages_by_trait():
    assert stages_where("reads", get_stage("dpo").reads) == ("dpo",)
    assert stage_context(("dpo",)) == "finetuning.stage='dpo'"
    assert stage_context(("sft", "dpo")) == "finetuning.stage sft or dpo"
