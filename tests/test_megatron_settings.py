"""Megatron-Core's own refusals of a run's settings are bad input: found on every rank before
the process group and before tokenizing, one line in this config's names, exit 2 (so a Slurm
job fails without a requeue: tests/test_faults.py), where they used to be a traceback after
tokenizing (exit 1, which the batch script requeues)."""

from __future__ import annotations

import pytest
import torch
from trainer_fixtures import (
    assert_bad_input_on_every_rank,
    launch_ranks,
    make_model_dir,
    make_sft_data,
    write_config,
)

from hpc_mca.api.session import choose_fusions
from hpc_mca.config.layout import layout_of
from hpc_mca.config.loading import load_config
from hpc_mca.config.sections import ConfigError
from hpc_mca.trainer.megatron_settings import check_megatron_settings, default_fusions

REFUSED = {
    # Megatron's TransformerConfig: full recomputation without a method
    "recompute_full_without_method": (
        ["recompute_granularity=full", "recompute_num_layers=1"],
        "Megatron-Core refuses these settings: Using parallel.recompute_granularity: full so "
        "parallel.recompute_method must be \"block\" or \"uniform\""),
    # ... and a layer count with selective recomputation
    "recompute_selective_with_layers": (
        ["recompute_granularity=selective", "recompute_num_layers=1"],
        "Megatron-Core refuses these settings: When using parallel.recompute_granularity: "
        "selective parallel.recompute_num_layers must be None."),
    # Megatron's optimizer without the distributed one: KeyError at its build (exit 1) before
    "offload_without_distributed_optimizer": (
        ["optimizer_cpu_offload=true"],
        "parallel.optimizer_cpu_offload=true needs parallel.use_distributed_optimizer=true"),
    # ... and with it, on a machine without CUDA: ValueError at the first step before
    "offload_without_cuda": (
        ["optimizer_cpu_offload=true", "use_distributed_optimizer=true"],
        "parallel.optimizer_cpu_offload=true on a machine without CUDA"),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_settings")
    make_model_dir(root, layers=2)
    make_sft_data(root, 16, seed=3, name="train")
    return root


def _config(root, name: str):
    return write_config(root / name, root / "model", root / "train.jsonl", data={
        "preprocessing_cache_dir": str(root / name / "cache")}, training={"max_steps": 2})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the offload case is refused on CPU only")
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_megatrons_refusal_is_one_line_in_our_names(root, name):
    (root / name).mkdir(exist_ok=True)
    overrides, message = REFUSED[name]
    with pytest.raises(ConfigError) as err:
        config = load_config(_config(root, name), overrides).resolve(1)
        check_megatron_settings(config, layout_of(config.parallel))
    assert str(err.value) == message or str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_settings_megatron_accepts_pass(root):
    (root / "fine").mkdir(exist_ok=True)
    for overrides in ([], ["recompute_granularity=full", "recompute_method=uniform",
                           "recompute_num_layers=1"], ["recompute_granularity=selective"]):
        config = load_config(_config(root, "fine"), overrides).resolve(1)
        check_megatron_settings(config, layout_of(config.parallel))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the offload case is refused on CPU only")
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_rank_stops_before_tokenizing(root, name):
    (root / name).mkdir(exist_ok=True)
    overrides, message = REFUSED[name]
    config = _config(root, name)
    ranks = launch_ranks(2, ["train", str(config), *overrides], timeout=180)
    assert_bad_input_on_every_rank(ranks, message)
    assert not (root / name / "cache").exists()  # nothing was tokenized
    assert not (root / name / "run" / "steps.jsonl").exists()


FUSION_DEFAULTS = [  # (overrides, machine: (cuda, attention backend, MoE), the fusions that run)
    (["bf16=true"], (True, "torch", False), ["layer", "cross_entropy"]),
    (["bf16=true"], (True, "flash", False), ["layer", "cross_entropy"]),
    (["bf16=true"], (True, "te", False), []),  # TE's layers were never measured compiled
    (["bf16=true"], (True, "torch", True), []),  # nor MoE layers
    (["bf16=true"], (False, "torch", False), []),  # CPU: compiling costs start-up, gains nothing
    ([], (True, "torch", False), []),  # fp32: the fused cross-entropy's gradient would be bf16
    (["bf16=true", "use_mca=false"], (True, "", False), []),  # the standard backend has none
    (["bf16=true", "fusions=[]"], (True, "torch", False), []),  # the user's choice stays
    (["bf16=true", "fusions=[rope]"], (True, "torch", True), ["rope"]),
    # The norms' recompute does not run inside compiled layers: the rest of the fast set.
    (["bf16=true", "recompute_granularity=selective", "recompute_modules=[layernorm]"],
     (True, "torch", False), ["cross_entropy"]),
]


@pytest.mark.parametrize("overrides, machine, fusions", FUSION_DEFAULTS)
def test_unset_fusions_are_the_fastest_measured_for_the_machine(root, overrides, machine, fusions):
    """model.fusions unset: [layer, cross_entropy] on a bf16 Megatron run of a dense model on
    CUDA without TE (53,350 tokens/s against 47,784 unfused on one H200), else none; a set list
    is kept."""
    (root / "fusions").mkdir(exist_ok=True)
    config = load_config(_config(root, "fusions"), overrides).resolve(1)
    cuda, backend, moe = machine
    assert default_fusions(config, cuda=cuda, backend=backend, moe=moe) == fusions


def test_a_rank_writes_the_chosen_fusions_into_the_run_config(root):
    """On this machine (no CUDA) an unset model.fusions becomes [] before Megatron's checks,
    so the config a run saves names what ran."""
    (root / "chosen").mkdir(exist_ok=True)
    config = load_config(_config(root, "chosen"), ["bf16=true"]).resolve(1)
    assert config.model.fusions is None
    chosen = config.amended("model", fusions=choose_fusions(config))
    assert chosen.to_dict()["model"]["fusions"] == ([] if not torch.cuda.is_available()
                                                     else ["layer", "cross_entropy"])
    assert config.model.fusions is None and chosen.frozen  # a new resolved config; the old one stands
