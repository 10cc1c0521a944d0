"""``hpc-mca plan --dry-run``: one process builds a planned rank's Megatron model, DDP and
optimizer on the meta device (a fake process group) and counts its bytes. The planner's static
terms (parameters, gradient buffers, optimizer state) equal those bytes within 1% on TP/PP/VP,
EP and LoRA layouts; a layout the trainer refuses gets the trainer's one-line error; a layout
whose real bytes do not fit is refused in one line; a rank builds in seconds."""

from __future__ import annotations

import dataclasses
import json
import resource
from pathlib import Path

import pytest

from hpc_mca.config.sections import FinetuningArguments, ParallelArguments, TrainingArguments
from hpc_mca.topology import Layout, LayoutError, ModelShape, PlanRequest, plan
from hpc_mca.topology.memory import Workload, rank_memory
from hpc_mca.trainer.dry_run import default_ranks, dry_run
from hpc_mca.trainer.dry_run_report import dry_run_plan

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
         "vocab_size": 1000, "max_position_embeddings": 256, "tie_word_embeddings": False}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
           "vocab_size": 1000, "max_position_embeddings": 256, "num_local_experts": 8,
           "num_experts_per_tok": 2, "sliding_window": None}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 128, "intermediate_size": 256,
             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 32, "vocab_size": 1000, "max_position_embeddings": 256,
             "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
BF16 = TrainingArguments(bf16=True)


def _compare(config: dict | str, layout: Layout, world: int, *, distributed: bool = True,
             finetuning: FinetuningArguments | None = None, lora: bool = False) -> list[float]:
    """The planner's static bytes over the dry run's, for the default ranks."""
    shape = ModelShape.from_hf_config(config)
    work = Workload(seq_length=256, use_distributed_optimizer=distributed, lora=lora,
                    lora_rank=finetuning.lora_rank if finetuning else 16)
    ratios = []
    for rank in default_ranks(layout, world):
        got = dry_run(config, layout, world, rank, training=BF16, finetuning=finetuning,
                      parallel=ParallelArguments(use_distributed_optimizer=distributed))
        planned = rank_memory(shape, layout.resolved(world), work, got.pipeline_rank)
        assert got.seconds < 10  # seconds, not minutes, even on a 2-core CI box
        assert abs(planned.params - sum(got.params.values())) <= 0.01 * sum(got.params.values())
        ratios.append((planned.params + planned.grads + planned.optimizer) / got.static)
    return ratios


@pytest.mark.parametrize("config, layout, world, distributed", [
    (LLAMA, Layout(tp=2, pp=2, vp=2), 16, True),
    ({**LLAMA, "tie_word_embeddings": True}, Layout(tp=2), 4, False),
    (MIXTRAL, Layout(tp=2, pp=2, ep=2), 8, True),
    (QWEN3_MOE, Layout(tp=2, pp=2, ep=4), 16, True),
], ids=["llama-tp2-pp2-vp2", "llama-tied-no-distopt", "mixtral-ep2", "qwen3moe-ep4"])
def test_planner_static_terms_equal_the_dry_run(config, layout, world, distributed):
    for ratio in _compare(config, layout, world, distributed=distributed):
        assert ratio == pytest.approx(1.0, abs=0.01)


def test_lora_static_terms_equal_the_dry_run(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    lora = FinetuningArguments(finetuning_type="lora", lora_rank=8, lora_alpha=16, lora_target="all")
    for ratio in _compare(str(tmp_path), Layout(tp=2, pp=2), 8, finetuning=lora, lora=True):
        assert ratio == pytest.approx(1.0, abs=0.01)


def test_the_busiest_ranks_are_the_first_and_last_stage():
    got = [dry_run(LLAMA, Layout(tp=2, pp=4), 16, rank, training=BF16,
                   parallel=ParallelArguments()).pipeline_rank
           for rank in default_ranks(Layout(tp=2, pp=4), 16)]
    assert got == [0, 3]


def test_a_layout_the_trainer_refuses_gets_its_one_line_error():
    with pytest.raises(LayoutError) as err:
        dry_run(LLAMA, Layout(tp=3), 6, 0, training=BF16, parallel=ParallelArguments())
    assert str(err.value) == ("tensor_parallel_size=3 does not divide num_attention_heads=8; "
                              "valid: 1, 2")


def test_a_layout_whose_real_bytes_do_not_fit_is_refused_in_one_line(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    planned = plan(PlanRequest(model=str(tmp_path), nodes=1, gpus_per_node=8, seq_length=256,
                               global_batch_size=8, layout=Layout(tp=2, pp=2)))
    table = dry_run_plan(planned)
    assert "dry run  rank 0 (pipeline stage 0 of 2)" in table and "rank 7" in table
    assert "static" in table and "(+0.00%)" in table and "the planner's estimate" in table
    tight = dataclasses.replace(planned, usable_bytes=planned.memory.activations)
    with pytest.raises(LayoutError) as err:
        dry_run_plan(tight, ranks=[0])
    assert "\n" not in str(err.value) and "rank 0 (pipeline stage 0)" in str(err.value)
    assert "GiB usable; valid:" in str(err.value)


def test_a_rank_builds_in_little_memory():
    """A bigger layer (hidden 2048, 16 of them) on the meta device holds no storage: the
    process stays far below the model's 2 GiB of bf16 weights plus its fp32 state."""
    config = {**LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = dry_run(config, Layout(), 1, 0, training=BF16, parallel=ParallelArguments())
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert got.static > 8 * 2**30 and grown_kib < 512 * 1024
