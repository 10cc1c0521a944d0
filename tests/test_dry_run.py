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
from hpc_mca.models.converters import converter_for
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
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 128, "intermediate_size": 256,
               "moe_intermediate_size": 64, "num_hidden_layers": 4, "first_k_dense_replace": 1,
               "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000,
               "max_position_embeddings": 256, "n_routed_experts": 8, "n_shared_experts": 1,
               "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
               "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
               "qk_rope_head_dim": 8, "v_head_dim": 16, "num_nextn_predict_layers": 1,
               "tie_word_embeddings": False}
BF16 = TrainingArguments(bf16=True)


def _compare(config: dict | str, layout: Layout, world: int, *, distributed: bool = True,
             finetuning: FinetuningArguments | None = None, lora: bool = False,
             mtp: int = 0, **planned_work: object) -> list[float]:
    """The planner's static bytes over the dry run's, for the default ranks (``planned_work``:
    the planner's Workload fields for the same run: stage, freeze ...)."""
    shape = ModelShape.from_hf_config(config)
    work = Workload(seq_length=256, use_distributed_optimizer=distributed, lora=lora,
                    lora_rank=finetuning.lora_rank if finetuning else 16, mtp_num_layers=mtp,
                    **planned_work)  # type: ignore[arg-type]
    ratios = []
    for rank in default_ranks(layout, world):
        got = dry_run(config, layout, world, rank, training=BF16, finetuning=finetuning,
                      parallel=ParallelArguments(use_distributed_optimizer=distributed),
                      model_overrides={"mtp_num_layers": mtp} if mtp else None)
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


def test_deepseek_v3_static_terms_equal_the_dry_run():
    """MLA, a dense first layer, a shared expert beside EP-split routed ones, and an MTP layer
    on the last stage (what the full-size DeepSeek-V3 rows in the README measure)."""
    with_mtp = _compare(DEEPSEEK_V3, Layout(tp=2, pp=2, ep=2), 8, mtp=1)
    without = _compare(DEEPSEEK_V3, Layout(tp=2, pp=2, ep=2), 8)
    assert with_mtp == pytest.approx([1.0, 1.0], abs=0.01)
    assert without == pytest.approx([1.0, 1.0], abs=0.01)


def test_lora_static_terms_equal_the_dry_run(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    lora = FinetuningArguments(finetuning_type="lora", lora_rank=8, lora_alpha=16, lora_target="all")
    for ratio in _compare(str(tmp_path), Layout(tp=2, pp=2), 8, finetuning=lora, lora=True):
        assert ratio == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_the_reference_model_is_built_and_planned_alike(tmp_path: Path, stage: str):
    """dpo/kto: the trainer's frozen reference copy (outside DDP and the optimizer) doubles
    the weights; with LoRA the reference is the policy's own frozen base: no second copy."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    layout, ft = Layout(tp=2, pp=2), FinetuningArguments(stage=stage)
    for ratio in _compare(str(tmp_path), layout, 8, finetuning=ft, stage=stage):
        assert ratio == pytest.approx(1.0, abs=0.01)
    policy = dry_run(LLAMA, layout, 8, 0, training=BF16, parallel=ParallelArguments())
    with_reference = dry_run(str(tmp_path), layout, 8, 0, training=BF16, finetuning=ft,
                             parallel=ParallelArguments())
    # (the policy's DDP buffer is padded; the reference, outside DDP, is not)
    assert with_reference.params["bfloat16"] == pytest.approx(2 * policy.params["bfloat16"],
                                                              rel=1e-3)
    assert with_reference.grads == policy.grads and with_reference.optimizer == policy.optimizer
    lora = dataclasses.replace(ft, finetuning_type="lora", lora_rank=8, lora_alpha=16,
                               lora_target="all")
    for ratio in _compare(str(tmp_path), layout, 8, finetuning=lora, lora=True, stage=stage):
        assert ratio == pytest.approx(1.0, abs=0.01)


def test_freeze_static_terms_equal_the_dry_run(tmp_path: Path):
    """freeze: every weight is held, gradients and optimizer state only for what trains (the
    last 2 decoder layers: all on the last stage, none on the first)."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    ft = FinetuningArguments(finetuning_type="freeze", freeze_trainable_layers=2)
    sizing = converter_for(ft).frozen_sizing(str(tmp_path))
    assert _compare(str(tmp_path), Layout(tp=2, pp=2), 8, finetuning=ft,
                    freeze=sizing) == pytest.approx([1.0, 1.0], abs=0.01)
    first, last = (dry_run(str(tmp_path), Layout(tp=2, pp=2), 8, rank, training=BF16,
                           finetuning=ft, parallel=ParallelArguments()) for rank in (0, 7))
    assert first.grads == {} and first.optimizer == 0  # every weight frozen, none padded
    assert first.params["bfloat16"] == pytest.approx(last.params["bfloat16"], rel=1e-3)
    assert sum(last.grads.values()) > 0


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
