"""hpc-mca plan/submit with the standard backend (training.use_mca=false): a whole model per
GPU, DP × Ulysses SP, no Megatron keys for the trainer; what it cannot run is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_mca.cli import main
from hpc_mca.slurm.errors import OpsError
from hpc_mca.slurm.jobplan import PlanOptions, check_train_config, make_job_plan, plan_summary
from hpc_mca.topology import Layout, LayoutError, PlanRequest, plan

# 4 heads and 4 KV heads: Ulysses sizes 1, 2 and 4 on 8 GPUs.
TINY = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 32000, "_name_or_path": "tiny-llama"}
# Embedding and untied output (2·V·h), 8 layers of QKVO (4·h·h) + SwiGLU (3·h·f) + 2 norms,
# the final norm.
TINY_PARAMS = 2 * 32000 * 1024 + 8 * (4 * 1024 * 1024 + 3 * 1024 * 2816 + 2 * 1024) + 1024
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "_name_or_path": "Llama-3-8B"}
TINY_MOE = {"model_type": "qwen3_moe", "hidden_size": 512, "intermediate_size": 1024,
            "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 128, "vocab_size": 32000, "_name_or_path": "tiny-moe"}
EIGHT_GPUS = dict(nodes=2, gpus_per_node=4)
MEGATRON_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size", "pipeline_layout",
                 "use_distributed_optimizer", "sequence_parallel", "overlap_grad_reduce",
                 "recompute_granularity")
WHOLE_MODEL = ("with training.use_mca=false: the standard backend keeps a whole model on every "
               "GPU (data and Ulysses sequence parallelism only); valid: 1, or "
               "training.use_mca=true")


def _model(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / config["_name_or_path"]
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def _config(tmp_path: Path, use_mca: bool = False, model: dict = TINY, extra: str = "") -> Path:
    path = tmp_path / "run.yaml"
    (tmp_path / "d.jsonl").write_text('{"instruction": "1+1=", "output": "2"}\n')
    path.write_text(f"model:\n  model_name_or_path: {_model(tmp_path, model)}\ndata:\n"
                    f"  dataset: d.jsonl\n  cutoff_len: 4096\ntraining:\n"
                    f"  use_mca: {str(use_mca).lower()}\n  bf16: true\n  global_batch_size: 64\n"
                    f"{extra}")
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _overrides(job) -> dict[str, str]:
    return dict(item.split("=", 1) for item in job.plan_overrides)


def _plan_cli(tmp_path: Path, config: Path, *args: str):
    return CliRunner().invoke(main, ["plan", str(config), "--nodes", "2", "--gpus-per-node", "4",
                                     "--runs-root", str(tmp_path / "r"), *args])


def _one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# --- plans -------------------------------------------------------------------------------------

def test_standard_plan_is_a_whole_model_per_gpu_and_the_trainer_accepts_it(tmp_path):
    config = _config(tmp_path)
    job = make_job_plan(PlanOptions(**EIGHT_GPUS), config)
    p = job.plan
    assert p.backend == "standard" and p.request.backend == "standard"
    lay = p.layout
    assert (lay.tp, lay.pp, lay.cp, lay.ep, lay.etp, lay.vp) == (1, 1, 1, 1, 1, None)
    assert lay.dp * p.sequence_parallel_size == 8 and p.sequence_parallel_size == 1
    assert not p.use_distributed_optimizer and not p.sequence_parallel and p.recompute == "none"
    # The trainer refuses every Megatron key with use_mca=false: the plan hands it none.
    assert _overrides(job) == {"per_device_train_batch_size": str(p.micro_batch_size)}
    assert p.micro_batch_size * lay.dp * p.num_microbatches == 64
    check_train_config(job, str(tmp_path / "runs" / "x_0"))  # the ranks' own rules pass


def test_forced_sp_halves_data_parallelism_and_goes_to_the_trainer(tmp_path):
    from hpc_mca.config.loading import load_config

    config = _config(tmp_path)
    one = make_job_plan(PlanOptions(**EIGHT_GPUS), config)
    job = make_job_plan(PlanOptions(**EIGHT_GPUS, sp=2), config)
    assert job.plan.forced and (job.plan.layout.dp, job.plan.sequence_parallel_size) == (4, 2)
    chosen = _overrides(job)
    assert chosen["parallel.sequence_parallel_size"] == "2"
    assert not set(MEGATRON_KEYS) & set(chosen), chosen
    resolved = load_config(config, [*job.train_overrides, "output_dir=x"]).resolve(8)
    par = resolved.parallel
    assert (par.data_parallel_size, par.sequence_parallel_size) == (4, 2)
    # Each GPU holds half of every row: the same weights and state, fewer activations, and the
    # Ulysses all-to-all in the step.
    mem1, mem2 = one.plan.memory, job.plan.memory
    assert (mem2.params, mem2.grads, mem2.optimizer) == (mem1.params, mem1.grads, mem1.optimizer)
    assert 0.5 * mem1.activations < mem2.activations < 0.65 * mem1.activations
    assert one.plan.step_time.context_parallel == 0 < job.plan.step_time.context_parallel
    assert job.plan.searched is not None and job.plan.searched.sequence_parallel_size == 1


def test_standard_memory_is_float32_weights_grads_and_adam_unsharded(tmp_path):
    """The standard backend builds the model in float32 (autocast for bf16): 4 B weights,
    4 B gradients, 8 B Adam moments per parameter, none sharded; Megatron's bf16 run keeps
    2 B weights and 12 B of optimizer state (fp32 master copy)."""
    standard = make_job_plan(PlanOptions(**EIGHT_GPUS), _config(tmp_path)).plan.memory
    assert (standard.params, standard.grads, standard.optimizer) == (
        4 * TINY_PARAMS, 4 * TINY_PARAMS, 8 * TINY_PARAMS)
    megatron = make_job_plan(PlanOptions(**EIGHT_GPUS, tp=1, distributed_optimizer=False),
                             _config(_mkdir(tmp_path / "m"), use_mca=True)).plan.memory
    assert (megatron.params, megatron.optimizer) == (2 * TINY_PARAMS, 12 * TINY_PARAMS)


def test_a_long_sequence_gets_ulysses_when_a_row_does_not_fit_one_gpu(tmp_path):
    """262144-token rows: one GPU's activations would be ~112 GiB, so the plan splits each row
    over SP GPUs by itself and tells the trainer."""
    job = make_job_plan(PlanOptions(nodes=1, gpus_per_node=4), _config(tmp_path),
                        ["cutoff_len=262144", "global_batch_size=8"])
    p = job.plan
    assert p.sequence_parallel_size > 1 and p.layout.dp == 4 // p.sequence_parallel_size
    assert p.memory.total <= 0.9 * p.usable_bytes
    assert _overrides(job)["parallel.sequence_parallel_size"] == str(p.sequence_parallel_size)
    assert f"Ulysses SP{p.sequence_parallel_size} splits each 262144-token row" in p.reason


def test_lora_on_the_standard_backend_never_gets_the_distributed_optimizer(tmp_path):
    """Megatron LoRA in bf16 needs the distributed optimizer even on one GPU; the standard
    backend has none and its trainer accepts the plan without it."""
    config = _config(tmp_path)
    job = make_job_plan(PlanOptions(nodes=1, gpus_per_node=1, lora=True), config)
    assert not job.plan.use_distributed_optimizer
    assert _overrides(job) == {"finetuning_type": "lora",
                               "per_device_train_batch_size": str(job.plan.micro_batch_size)}
    check_train_config(job, str(tmp_path / "runs" / "x_0"))
    megatron = plan(model=TINY, nodes=1, gpus_per_node=1, seq_length=4096, global_batch_size=8,
                    lora=True)
    assert megatron.use_distributed_optimizer


def test_plan_summary_records_the_backend(tmp_path):
    summary = plan_summary(make_job_plan(PlanOptions(**EIGHT_GPUS, sp=4), _config(tmp_path)).plan)
    assert (summary["backend"], summary["sequence_parallel_size"], summary["describe"]) == (
        "standard", 4, "DP2 × SP4")
    assert summary["layout"]["tp"] == 1 and summary["layout"]["dp"] == 2


# --- the table names the backend ---------------------------------------------------------------

def test_plan_table_names_the_backend_and_why(tmp_path):
    standard = _plan_cli(tmp_path / "s", _config(_mkdir(tmp_path / "s")), "--sp", "2")
    assert standard.exit_code == 0, standard.output
    lines = standard.output.splitlines()
    assert lines[1] == ("  backend     standard (training.use_mca=false): transformers Trainer, "
                        "DP 4 × Ulysses SP 2")
    assert lines[2].startswith("  layout      DP4 × SP2  (forced; a whole model per GPU")
    assert lines[-1].startswith("  trainer     per_device_train_batch_size=")
    assert lines[-1].endswith(" parallel.sequence_parallel_size=2")
    megatron = _plan_cli(tmp_path / "m", _config(_mkdir(tmp_path / "m"), use_mca=True))
    assert megatron.exit_code == 0, megatron.output
    assert megatron.output.splitlines()[1] == (
        "  backend     megatron-core (training.use_mca=true, the default)")
    assert "  trainer     tensor_model_parallel_size=1 " in megatron.output


# --- refusals, one line each -------------------------------------------------------------------

@pytest.mark.parametrize("args, overrides, line", [
    (["--tp", "2"], [], f"--tp 2 {WHOLE_MODEL}"),
    (["--pp", "2"], [], f"--pp 2 {WHOLE_MODEL}"),
    (["--cp", "2"], [], f"--cp 2 {WHOLE_MODEL}"),
    ([], ["parallel.tensor_model_parallel_size=4"],
     f"parallel.tensor_model_parallel_size=4 {WHOLE_MODEL}"),
    (["--distributed-optimizer"], [],
     "--distributed-optimizer with training.use_mca=false: the distributed optimizer is "
     "Megatron-Core's (the standard backend keeps Adam's state whole on every GPU); valid: "
     "--no-distributed-optimizer, or training.use_mca=true"),
    (["--recompute", "full"], [],
     "--recompute full with training.use_mca=false: the planner sizes the standard backend "
     "without activation recompute (its gradient checkpointing of every layer is the config's "
     "gradient_checkpointing=true); valid: none, or training.use_mca=true"),
    (["--sp", "3"], [],
     "--sp 3 must divide the world size 8, num_attention_heads=4 and num_key_value_heads=4 "
     "(Ulysses splits heads over the ranks); valid: 1, 2, 4"),
    ([], ["parallel.sequence_parallel_size=8"],
     "parallel.sequence_parallel_size=8 must divide the world size 8, num_attention_heads=4 "
     "and num_key_value_heads=4 (Ulysses splits heads over the ranks); valid: 1, 2, 4"),
])
def test_what_the_standard_backend_cannot_run_is_one_line(tmp_path, args, overrides, line):
    result = _plan_cli(tmp_path, _config(tmp_path), *overrides, *args)
    assert _one_line_error(result) == f"Error: {line}"


def test_sp_with_the_megatron_backend_is_one_line(tmp_path):
    result = _plan_cli(tmp_path, _config(tmp_path, use_mca=True), "--sp", "2")
    assert _one_line_error(result) == (
        "Error: --sp 2 with training.use_mca=true: Ulysses sequence parallelism is the standard "
        "backend's; valid: 1 (Megatron splits sequences with --cp), or training.use_mca=false")
    one = _plan_cli(tmp_path, _config(_mkdir(tmp_path / "one"), use_mca=True), "--sp", "1")
    assert one.exit_code == 0, one.output  # SP 1 is no Ulysses at all: nothing to refuse


def test_an_moe_model_on_the_standard_backend_is_one_line(tmp_path):
    result = _plan_cli(tmp_path, _config(tmp_path, model=TINY_MOE))
    assert _one_line_error(result) == (
        "Error: model tiny-moe is a mixture of experts (8 experts) with training.use_mca=false: "
        "the standard backend's loss has no router load-balancing term; valid: a dense model or "
        "one whose router is balanced by its bias (glm4_moe, deepseek_v3), or "
        "training.use_mca=true")


def test_a_model_too_big_for_one_gpu_is_one_line_with_the_estimate(tmp_path):
    """Llama-3-8B, full fine-tuning: 16 B per parameter (~120 GiB) on every GPU, even with the
    longest Ulysses split; Megatron-Core would shard it."""
    result = _plan_cli(tmp_path, _config(tmp_path, model=LLAMA3_8B))
    line = _one_line_error(result)
    assert line == (
        "Error: Llama-3-8B does not fit one H100-80GB with training.use_mca=false: the standard "
        "backend keeps a whole model on every GPU, and the leanest option (DP1 × SP8, "
        "micro-batch 1) needs 122.5 GiB (params 29.9 GiB, grads 29.9 GiB, optimizer 59.8 GiB, "
        "activations 2.8 GiB), more than the 63.1 GiB per GPU: 70.1 GiB usable less 10% "
        "headroom; valid: training.use_mca=true (Megatron-Core model parallelism), LoRA, a "
        "shorter seq_length or a larger GPU")
    megatron = _plan_cli(tmp_path / "m", _config(_mkdir(tmp_path / "m"), use_mca=True,
                                                  model=LLAMA3_8B))
    assert megatron.exit_code == 0, megatron.output  # the suggested fix plans


@pytest.mark.parametrize("fields, line", [
    (dict(layout=Layout(tp=2)), "tensor_parallel_size=2 " + WHOLE_MODEL),
    (dict(layout=Layout(pp=2, vp=2)), "pipeline_parallel_size=2 " + WHOLE_MODEL),
    (dict(use_distributed_optimizer=True), "use_distributed_optimizer=True with "
     "training.use_mca=false: the distributed optimizer is Megatron-Core's"),
    (dict(sequence_parallel_size=3), "sequence_parallel_size=3 must divide the world size 8"),
    (dict(backend="deepspeed"), "backend='deepspeed' is not valid; valid: megatron, standard"),
])
def test_plan_request_refuses_what_the_standard_backend_cannot_run(fields, line):
    with pytest.raises(LayoutError) as err:
        PlanRequest(model=TINY, nodes=2, gpus_per_node=4, seq_length=4096,
                    global_batch_size=64, **{"backend": "standard", **fields})
    assert str(err.value).splitlines()[0].startswith(line), str(err.value)


def test_make_job_plan_refusals_are_ops_errors(tmp_path):
    with pytest.raises(OpsError) as err:
        make_job_plan(PlanOptions(**EIGHT_GPUS, tp=2, pp=2), _config(tmp_path))
    assert str(err.value).splitlines() == [f"--tp 2 {WHOLE_MODEL}", f"--pp 2 {WHOLE_MODEL}"]


def test_the_submitted_script_runs_the_standard_plan(tmp_path):
    """What submit renders: the trainer command line carries the Ulysses size and nothing
    of Megatron's layout."""
    from hpc_mca.slurm.submit import SubmitOptions, render_job

    config = _config(tmp_path)
    job = make_job_plan(PlanOptions(**EIGHT_GPUS, sp=2, micro_batch_size=2), config)
    script = render_job(job, SubmitOptions(runs_root=tmp_path / "r")).script
    assert (f"    set -- {config} per_device_train_batch_size=2 "
            "parallel.sequence_parallel_size=2\n") in script
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=4" in script
    assert "tensor_model_parallel_size" not in script
