"""The rooms where new stages and model converters go: one table each, in step with the
config rules (a stage or finetuning type the config accepts always has its implementation)."""

from __future__ import annotations

import types

import torch

from hpc_mca.config.sections import FINETUNING_TYPES, TrainConfig
from hpc_mca.models.converters import CONVERTERS, converter_for
from hpc_mca.stages import STAGE_NAMES
from hpc_mca.trainer.objective import SftObjective
from hpc_mca.trainer.stages import OBJECTIVES


def test_every_accepted_stage_has_an_objective_and_every_finetuning_type_a_converter():
    assert set(OBJECTIVES) == set(STAGE_NAMES)
    assert set(CONVERTERS) == set(FINETUNING_TYPES)


def test_sft_alone_adds_the_exact_match_metric():
    assert OBJECTIVES["sft"] is SftObjective
    ctx = types.SimpleNamespace(device=torch.device("cpu"))
    assert OBJECTIVES["pt"](TrainConfig(), ctx, 32).eval_metric() is None
    assert OBJECTIVES["sft"](TrainConfig(), ctx, 32).eval_metric() is not None


def test_full_finetuning_trains_the_model_as_built():
    chunks = [torch.nn.Linear(2, 2)]
    converter = converter_for(TrainConfig().finetuning)
    assert converter.convert_chunks(chunks, model_path="", seed=42) is chunks
    assert all(p.requires_grad for p in chunks[0].parameters())
