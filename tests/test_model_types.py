"""The planner proposes nothing the trainer cannot build (issue #61): ``hpc-mca plan`` over a
model of every ``model_type`` transformers knows either plans it (the types the trainer builds,
``hpc_mca.topology.model.BUILDABLE_MODEL_TYPES``, which the trainer's config reader uses too) or
refuses it in one line (exit 1, as its other refusals), naming the type and the buildable
ones."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from hpc_mca.cli import main
from hpc_mca.models.hf_config import SUPPORTED_MODEL_TYPES
from hpc_mca.topology.model import BUILDABLE_MODEL_TYPES

SHAPE = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 512, "vocab_size": 1000, "num_local_experts": 4, "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 128}
"""A shape every planner path reads (dense and MoE keys): only model_type differs per case."""


def test_plan_refuses_every_model_type_the_trainer_cannot_build(tmp_path: Path) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert SUPPORTED_MODEL_TYPES == BUILDABLE_MODEL_TYPES  # the trainer's list is the planner's
    assert set(BUILDABLE_MODEL_TYPES) <= set(CONFIG_MAPPING_NAMES)
    runner = CliRunner()
    planned, refused = [], []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        model = tmp_path / model_type
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": model_type, **SHAPE}))
        result = runner.invoke(main, ["plan", "--model", str(model), "--nodes", "1", "--json"])
        if model_type in BUILDABLE_MODEL_TYPES:
            assert result.exit_code == 0, (model_type, result.output)
            planned.append(model_type)
            continue
        assert result.exit_code == 1, (model_type, result.output)  # as plan's other refusals
        line = [text for text in result.output.splitlines() if text.strip()]
        assert len(line) == 1 and f"model_type {model_type!r} is not one the trainer builds" in line[0], line
        assert ", ".join(BUILDABLE_MODEL_TYPES) in line[0]
        refused.append(model_type)
    assert sorted(planned) == sorted(BUILDABLE_MODEL_TYPES) and len(refused) > 300
