"""From run config + CLI options to a plan, trainer overrides and the rendered job (no Slurm)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_mca.cli import main
from hpc_mca.slurm.errors import OpsError
from hpc_mca.slurm.jobplan import PlanOptions, check_train_config, make_job_plan
from hpc_mca.slurm.submit import SubmitOptions, render_job

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "_name_or_path": "Llama-3-8B"}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "llama3-8b"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA3_8B))
    return path


def _config(tmp_path: Path, model_dir: Path, extra: str = "") -> Path:
    path = tmp_path / "run.yaml"
    (tmp_path / "d.jsonl").write_text('{"instruction": "1+1=", "output": "2"}\n')
    path.write_text(f"model:\n  model_name_or_path: {model_dir}\ndata:\n  dataset: d.jsonl\n"
                    f"  cutoff_len: 4096\ntraining:\n  bf16: true\n  global_batch_size: 64\n"
                    f"{extra}")
    return path


def _overrides(job) -> dict[str, str]:
    return dict(item.split("=", 1) for item in job.plan_overrides)


def test_plan_reads_model_sequence_batch_and_precision_from_the_config(tmp_path, model_dir):
    job = make_job_plan(PlanOptions(nodes=2), _config(tmp_path, model_dir))
    req = job.plan.request
    assert (req.shape.name, req.seq_length, req.global_batch_size, req.precision, req.stage) == (
        "Llama-3-8B", 4096, 64, "bf16", "sft")
    assert not job.plan.forced
    chosen = _overrides(job)
    assert chosen["tensor_model_parallel_size"] == str(job.plan.layout.tp)
    assert chosen["per_device_train_batch_size"] == str(job.plan.micro_batch_size)
    assert "global_batch_size" not in chosen  # stated by the config: left to it
    assert "stage" not in chosen and "bf16" not in chosen  # not given on the command line


def test_sizes_in_the_config_are_forced_and_kept(tmp_path, model_dir):
    extra = "parallel:\n  tensor_model_parallel_size: 8\n"
    job = make_job_plan(PlanOptions(nodes=2), _config(tmp_path, model_dir, extra),
                        ["per_device_train_batch_size=2"])
    assert job.plan.forced and job.plan.layout.tp == 8 and job.plan.micro_batch_size == 2
    chosen = _overrides(job)
    assert "tensor_model_parallel_size" not in chosen  # the user's own value stays theirs
    assert "per_device_train_batch_size" not in chosen
    assert job.train_overrides[0] == "per_device_train_batch_size=2"


def test_command_line_wins_over_the_config(tmp_path, model_dir):
    extra = "parallel:\n  tensor_model_parallel_size: 8\n"
    job = make_job_plan(PlanOptions(nodes=2, tp=4, stage="pt", precision="fp16", lora=False,
                                    recompute="full"),
                        _config(tmp_path, model_dir, extra))
    chosen = _overrides(job)
    assert chosen["tensor_model_parallel_size"] == "4"
    assert (chosen["stage"], chosen["bf16"], chosen["fp16"]) == ("pt", "false", "true")
    assert chosen["finetuning_type"] == "full"
    assert (chosen["recompute_granularity"], chosen["recompute_method"],
            chosen["recompute_num_layers"]) == ("full", "uniform", "1")


def test_block_recompute_reaches_the_trainer_and_a_configs_block_is_sized_as_given(
        tmp_path, model_dir):
    """The planner's block level (the fewest layers a chunk that fit) goes to the trainer as
    Megatron's block method; a config's own block recompute is sized with its N, a uniform one
    as full recompute of every layer."""
    job = make_job_plan(PlanOptions(nodes=2, gpus_per_node=1, recompute="block",
                                    seq_length=16384, gpu="H200-141GB"),
                        _config(tmp_path, model_dir))
    n = int(job.plan.recompute.split(":")[1])
    chosen = _overrides(job)
    assert (chosen["recompute_granularity"], chosen["recompute_method"],
            chosen["recompute_num_layers"]) == ("full", "block", str(n))
    extra = ("parallel:\n  recompute_granularity: full\n  recompute_method: block\n"
             "  recompute_num_layers: 4\n")
    given = make_job_plan(PlanOptions(nodes=2), _config(tmp_path, model_dir, extra))
    assert given.plan.recompute == "block:4"
    assert "recompute_num_layers" not in _overrides(given)  # the config's own stays its own
    uniform = extra.replace("block", "uniform")
    assert make_job_plan(PlanOptions(nodes=2), _config(tmp_path, model_dir, uniform)
                         ).plan.recompute == "full"


def test_the_plan_overlaps_gradient_reduction_unless_the_config_says_not_to(tmp_path, model_dir):
    """The step-time estimate assumes overlap_grad_reduce, so the plan turns it on for the
    trainer; a config that turns it off keeps it off and is estimated without the overlap."""
    job = make_job_plan(PlanOptions(nodes=2), _config(tmp_path, model_dir))
    assert job.plan.layout.dp > 1 and job.plan.overlap_grad_reduce
    assert _overrides(job)["overlap_grad_reduce"] == "true"
    lay = job.plan.layout
    same = dict(nodes=2, tp=lay.tp, pp=lay.pp, vp=lay.vp,
                micro_batch_size=job.plan.micro_batch_size)
    on = make_job_plan(PlanOptions(**same), _config(tmp_path, model_dir))
    off = make_job_plan(PlanOptions(**same), _config(
        tmp_path, model_dir, "parallel:\n  overlap_grad_reduce: false\n"))
    assert not off.plan.overlap_grad_reduce and "overlap_grad_reduce" not in _overrides(off)
    assert off.plan.step_time.data_parallel > on.plan.step_time.data_parallel > 0


def test_context_parallel_is_planned_with_the_configs_attention_exchange(tmp_path, model_dir):
    """Megatron-Bridge's Llama3-8B recipe (16×H100, seq 16384, TP4 PP2 CP2) becomes a job plan
    whose overrides carry CP2; the plan sizes the config's cp_comm_type, and a2a is refused
    in one line where CP does not divide the key/value heads per TP rank."""
    forced = dict(tp=4, pp=2, cp=2, seq_length=16384)
    job = make_job_plan(PlanOptions(nodes=2, **forced), _config(tmp_path, model_dir))
    assert job.plan.layout.cp == 2 and _overrides(job)["context_parallel_size"] == "2"
    assert job.plan.request.cp_comm_type == "all_gather"
    a2a = make_job_plan(PlanOptions(nodes=2, **forced), _config(
        tmp_path, model_dir, "parallel:\n  cp_comm_type: a2a\n"))
    assert a2a.plan.request.cp_comm_type == "a2a"
    assert a2a.plan.step_time.context_parallel != job.plan.step_time.context_parallel
    with pytest.raises(OpsError) as err:
        make_job_plan(PlanOptions(nodes=4, **{**forced, "cp": 4}), _config(
            tmp_path, model_dir, "parallel:\n  cp_comm_type: a2a\n"))
    assert str(err.value) == (
        "context_parallel_size=4 does not divide the 2 key/value heads per tensor-parallel rank "
        "that cp_comm_type='a2a' splits; valid: 1, 2, or cp_comm_type='all_gather'")


@pytest.mark.parametrize("options, config, message", [
    (dict(nodes=0), True, "nodes=0 must be a positive integer"),
    (dict(gpu="X100"), True, "gpu='X100' is not a known GPU preset; valid: A100-40GB"),
    (dict(tp=3), True, "tensor_parallel_size=3 does not divide num_attention_heads=32"),
    (dict(stage="rlhf"), True, "stage='rlhf' is not valid; valid: pt, sft, dpo, kto"),
    (dict(), None, "config file"),
    (dict(), False, "no model: give --model"),
])
def test_bad_input_is_one_line_per_problem(tmp_path, model_dir, options, config, message):
    path = (_config(tmp_path, model_dir) if config else
            tmp_path / "missing.yaml" if config is None else None)
    with pytest.raises(OpsError) as err:
        make_job_plan(PlanOptions(**options), path)
    assert message in str(err.value)
    assert len(str(err.value).splitlines()) == 1, str(err.value)


def test_unknown_config_key_and_bad_value_are_caught_before_submitting(tmp_path, model_dir):
    with pytest.raises(OpsError, match="unknown config key 'learning_rat'"):
        make_job_plan(PlanOptions(), _config(tmp_path, model_dir), ["learning_rat=1e-4"])
    job = make_job_plan(PlanOptions(), _config(tmp_path, model_dir), ["learning_rate=-1"])
    with pytest.raises(OpsError, match="training.learning_rate=-1.0 must be >= 0"):
        check_train_config(job, str(tmp_path / "runs" / "x_0"))


def test_render_job_for_gpus_and_cpus(tmp_path, model_dir):
    config = _config(tmp_path, model_dir)
    job = make_job_plan(PlanOptions(nodes=2), config, ["learning_rate=1e-4"])
    root = tmp_path / "100% runs"
    rendered = render_job(job, SubmitOptions(runs_root=root, partition="gpu", venv=None))
    script = rendered.script
    assert rendered.job_name == "run"
    assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --ntasks-per-node=8" in script
    assert f'#SBATCH --output="{tmp_path}/100%% runs/%x_%j/%x_%j.out"' in script
    assert f"    set -- {config} learning_rate=1e-4 " in script
    assert rendered.log("77") == root / "run_77" / "run_77.out"
    cpu = make_job_plan(PlanOptions(nodes=2, gpu="CPU", gpus_per_node=2, gpu_memory_gib=200),
                        config)
    rendered = render_job(cpu, SubmitOptions(runs_root=root, rank_command=("smoke", "--tp", "2"),
                                             job_name="check"))
    assert "#SBATCH --gpus-per-node" not in rendered.script
    assert "HPC_MCA_RANK_CMD=${HPC_MCA_RANK_CMD:-smoke}" in rendered.script
    assert "    set -- --tp 2\n" in rendered.script


def test_plan_command_prints_the_table_and_the_exact_script(tmp_path, model_dir):
    config = _config(tmp_path, model_dir)
    runner = CliRunner()
    table = runner.invoke(main, ["plan", str(config), "--nodes", "2"])
    assert table.exit_code == 0, table.output
    assert table.output.startswith("plan for Llama-3-8B: 2 node(s) × 8 H100-80GB (world 16)")
    assert "  trainer     tensor_model_parallel_size=" in table.output
    args = ["plan", str(config), "--nodes", "2", "--sbatch", "--runs-root", str(tmp_path / "r")]
    script = runner.invoke(main, args)
    assert script.exit_code == 0
    job = make_job_plan(PlanOptions(nodes=2), config)
    assert script.stdout == render_job(job, SubmitOptions(runs_root=tmp_path / "r")).script
    assert script.stderr.startswith("plan for Llama-3-8B")


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "Error: nodes=0 must be a positive integer"),
    (["--gpu", "X100"], "Error: gpu='X100' is not a known GPU preset"),
    (["--tp", "3"], "Error: tensor_parallel_size=3 does not divide num_attention_heads=32"),
])
def test_cli_errors_are_one_line(tmp_path, model_dir, args, message):
    result = CliRunner().invoke(main, ["plan", str(_config(tmp_path, model_dir)), *args])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(message)


@pytest.mark.parametrize("overrides, message", [
    (["learning_rate=-1"], "Error: training.learning_rate=-1.0 must be >= 0"),
    (["dataset=gone.jsonl"], "Error: data.dataset: dataset file "),
    (["max_steps=0"], "Error: training.max_steps=0 is not a step count; valid: a positive "
                      "number of optimizer steps, or -1"),
])
@pytest.mark.parametrize("sbatch", [False, True])
def test_plan_checks_the_run_config_as_submit_does(tmp_path, model_dir, overrides, message, sbatch):
    """plan and plan --sbatch refuse what submit would refuse (and the ranks after it), in one
    line, without touching Slurm."""
    args = ["plan", str(_config(tmp_path, model_dir)), *overrides, "--runs-root", str(tmp_path / "r")]
    result = CliRunner().invoke(main, args + (["--sbatch"] if sbatch else []))
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(message), result.stderr
    assert result.stdout == ""


def test_an_uneven_pipeline_goes_from_the_plan_to_the_trainer_config(tmp_path, model_dir):
    """--pp 3 on 32 layers: the plan splits 10,12,10, hands the split to the trainer as an
    override, and the trainer's config accepts it (the same rules); a split of the wrong sum is
    refused in one line naming the config key."""
    from hpc_mca.config.loading import load_config
    from hpc_mca.config.sections import ConfigError

    config = _config(tmp_path, model_dir)
    job = make_job_plan(PlanOptions(nodes=3, pp=3, tp=8), config)
    assert job.plan.layout.pipeline_layout == (10, 12, 10)
    assert _overrides(job)["pipeline_layout"] == "10,12,10"
    check_train_config(job, str(tmp_path / "runs" / "x_0"))  # the ranks' own check passes
    resolved = load_config(config, [*job.train_overrides, "output_dir=x"]).resolve(24)
    assert resolved.parallel.pipeline_layout == [10, 12, 10]
    bad = load_config(config, [*job.train_overrides, "output_dir=x", "pipeline_layout=10,10,10"])
    with pytest.raises(ConfigError) as err:
        bad.resolve(24)
    assert str(err.value) == ("parallel.pipeline_layout places 30 layers but num_layers=32; "
                              "valid: a sum of 32")


def test_the_configs_mtp_depths_are_planned(tmp_path, model_dir):
    """A config with MTP depths plans their parameters, activations and logits too."""
    plain = make_job_plan(PlanOptions(nodes=2, tp=4, pp=2), _config(tmp_path, model_dir))
    mtp = make_job_plan(PlanOptions(nodes=2, tp=4, pp=2),
                        _config(tmp_path, model_dir, "mtp_num_layers: 2\n"))
    assert (plain.plan.request.mtp_num_layers, mtp.plan.request.mtp_num_layers) == (0, 2)
    assert mtp.plan.memory.total > plain.plan.memory.total
    assert mtp.plan.step_time.compute > plain.plan.step_time.compute


def test_lora_plans_size_the_optimizer_for_adapters_only(tmp_path, model_dir):
    """--lora is planned (and handed to the trainer): the frozen base needs no gradients or
    optimizer state, so the same job needs far less of them."""
    config = _config(tmp_path, model_dir)
    full = make_job_plan(PlanOptions(nodes=1, tp=2), config)
    lora = make_job_plan(PlanOptions(nodes=1, tp=2, lora=True), config)
    assert _overrides(lora)["finetuning_type"] == "lora"
    assert lora.plan.request.lora and not full.plan.request.lora
    assert lora.plan.memory.optimizer < full.plan.memory.optimizer / 50
    assert lora.plan.memory.grads < full.plan.memory.grads / 50
