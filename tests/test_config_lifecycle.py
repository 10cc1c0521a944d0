"""A config's lifecycle: read (YAML, overrides, a script's arguments), resolved once into a new,
frozen, fully derived value that nothing changes later; the caller's objects are never written.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path

import pytest

import hpc_mca
from hpc_mca.config.loading import load_config
from hpc_mca.config.sections import Derived, TrainConfig
from hpc_mca.training_args import Seq2SeqTrainingArguments

DEMO = Path(hpc_mca.__file__).parent / "assets" / "demo" / "sft_addition.yaml"


@pytest.fixture()
def config() -> TrainConfig:
    return load_config(DEMO, ["per_device_train_batch_size=2", "gradient_accumulation_steps=2",
                                         "seq_length=null"])


def test_resolve_returns_a_new_frozen_derived_config_and_leaves_its_input(config: TrainConfig) -> None:
    before = config.to_dict()
    resolved = config.resolve(2)
    assert config.to_dict() == before and not config.frozen  # the input is not written to
    assert before["data"]["seq_length"] is None and before["training"]["global_batch_size"] is None
    assert resolved.frozen and all(getattr(resolved, f.name).frozen for f in dataclasses.fields(resolved))
    assert resolved.derived == Derived(seq_length=config.data.cutoff_len, data_parallel_size=2,
                                       gradient_accumulation_steps=2, global_batch_size=8)
    with pytest.raises(RuntimeError, match="before resolve"):
        _ = config.derived


@pytest.mark.parametrize("section", ["model", "data", "finetuning", "training", "parallel"])
def test_no_field_of_a_resolved_config_can_be_set(config: TrainConfig, section: str) -> None:
    resolved = config.resolve(1)
    part = getattr(resolved, section)
    name = dataclasses.fields(part)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError, match=f"{type(part).__name__}.{name}"):
        setattr(part, name, getattr(part, name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(resolved, section, part)
    # copies stay frozen; dataclasses.replace builds a new value, which resolves to the same
    assert copy.deepcopy(resolved).data.frozen and pickle.loads(pickle.dumps(resolved)).training.frozen
    fresh = dataclasses.replace(resolved, training=dataclasses.replace(resolved.training, seed=7))
    assert not fresh.frozen and not fresh.training.frozen
    again = fresh.resolve(1)
    assert again.training.seed == 7 and again.derived == resolved.derived


def test_amended_is_a_new_resolved_config(config: TrainConfig) -> None:
    """How a rank records a choice the rules cannot see (the fusions its machine runs)."""
    resolved = config.resolve(1)
    chosen = resolved.amended("model", fusions=["rope"])
    assert chosen.model.fusions == ["rope"] and chosen.frozen and chosen.derived == resolved.derived
    assert resolved.model.fusions is None
    with pytest.raises(RuntimeError, match="not resolved"):
        config.amended("model", fusions=[])


def test_a_script_arguments_object_is_not_written_to(config: TrainConfig) -> None:
    args = Seq2SeqTrainingArguments.from_config(config)
    before = dataclasses.asdict(args)
    resolved = args.resolve(1)
    assert resolved.frozen and dataclasses.asdict(args) == before
    assert not args.base_config.frozen and args.to_config().to_dict() == config.to_dict()
