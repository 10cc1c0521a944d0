"""What a config may say and how it is told otherwise: settings refused outside their context,
every problem of a config in one message, suggestions only from the alias table and close
spellings, and transformers' meaning where the names are transformers'."""

import json
from pathlib import Path

import pytest
import yaml
from trainer_fixtures import CONFIG_ONLY_LLAMA, config_only_run

from hpc_mca.config.input import KNOWN_ELSEWHERE
from hpc_mca.config.loading import load_config
from hpc_mca.config.schedule import resolve_warmup_steps
from hpc_mca.config.scope import SCOPES
from hpc_mca.config.sections import ConfigError, TrainConfig


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return config_only_run(tmp_path)


def _problems(run: Path, overrides: list[str], world_size: int = 1) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(run / "run.yaml", overrides).resolve(world_size)
    return str(err.value).splitlines()


# A value other than the default for every field of SCOPES, and a setting that gives the
# field its context (checked to be accepted there, so each refusal is the context's doing).
OUT_OF_CONTEXT = {
    "finetuning.pref_beta": ("0.2", ["stage=dpo"]),
    # kto needs two examples per micro-step (its KL rows pair them)
    "finetuning.kto_chosen_weight": ("0.5", ["stage=kto", "per_device_train_batch_size=2"]),
    "finetuning.kto_rejected_weight": ("2.0", ["stage=kto", "per_device_train_batch_size=2"]),
    "finetuning.pref_loss": ("ipo", ["stage=dpo"]),
    "finetuning.pref_ftx": ("0.5", ["stage=dpo"]),
    "finetuning.dpo_label_smoothing": ("0.1", ["stage=dpo"]),
    "finetuning.simpo_gamma": ("0.3", ["stage=dpo", "pref_loss=simpo"]),
    "finetuning.use_ref_model": ("false", ["stage=dpo"]),
    "finetuning.ref_model": ("model", ["stage=dpo"]),  # the run's own model dir (see below)
    "finetuning.lora_rank": ("4", ["finetuning_type=lora"]),
    "finetuning.lora_alpha": ("32", ["finetuning_type=lora"]),
    "finetuning.lora_dropout": ("0.1", ["finetuning_type=lora"]),
    "finetuning.lora_target": ("q_proj", ["finetuning_type=lora"]),
    "finetuning.freeze_trainable_layers": ("-1", ["finetuning_type=freeze"]),
    "finetuning.freeze_trainable_modules": ("mlp", ["finetuning_type=freeze"]),
    "finetuning.freeze_extra_modules": ("embed_tokens", ["finetuning_type=freeze"]),
    "finetuning.create_new_adapter": ("true", ["finetuning_type=lora"]),  # + the adapter below
    "data.dataset_format": ("alpaca", None),
    "training.eval_steps": ("5", ["val_size=0.5"]),
    "training.per_device_eval_batch_size": ("2", ["eval_dataset=train.jsonl"]),
    "model.mtp_loss_scaling_factor": ("0.3", ["mtp_num_layers=1"]),
    "data.text_field": ("body", ["stage=pt"]),
    "data.pt_chunking": ("document", ["stage=pt"]),
    "data.train_on_prompt": ("true", None),
    "data.pack_alignment": ("4", ["sequence_packing=true"]),
    "parallel.cp_comm_type": ("a2a", ["context_parallel_size=2"]),
    "parallel.recompute_num_layers": ("2", ["recompute_granularity=full",
                                            "recompute_method=uniform"]),
    "parallel.recompute_modules": ("[layernorm]", ["recompute_granularity=selective"]),
    "training.adam_beta1": ("0.8", None),
    "training.adam_beta2": ("0.95", None),
    "training.adam_epsilon": ("1e-6", None),
    "training.warmup_steps": ("2", None),
    "training.warmup_ratio": ("0.1", None),
}
"""field -> (value, overrides that make its context); None: the context is the default run's,
and the refusal is shown with :data:`LEAVE_CONTEXT` instead."""
LEAVE_CONTEXT = {
    "data.dataset_format": ["dataset_dir=."],
    "data.train_on_prompt": ["stage=pt"], "parallel.cp_comm_type": [],
    "training.adam_beta1": ["optim=sgd"], "training.adam_beta2": ["optim=sgd"],
    "training.adam_epsilon": ["optim=sgd"], "training.warmup_steps": ["lr_scheduler_type=constant"],
    "training.warmup_ratio": ["lr_scheduler_type=constant"],
}


def _tiny_adapter(directory: Path) -> Path:
    """A PEFT LoRA adapter (q_proj of layer 0) for the config-only Llama."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{name}.lora_A.weight": torch.zeros(2, 64), f"{name}.lora_B.weight": torch.zeros(64, 2)},
              str(directory / "adapter_model.safetensors"))
    return directory


def test_every_scoped_field_has_a_case():
    assert {f for scope in SCOPES for f in scope.fields} == set(OUT_OF_CONTEXT)


@pytest.mark.parametrize("dotted", sorted(OUT_OF_CONTEXT))
def test_a_setting_outside_its_context_is_refused_and_accepted_inside(run: Path, dotted: str):
    value, context = OUT_OF_CONTEXT[dotted]
    if dotted == "finetuning.ref_model":
        value = str(run / value)
    outside = LEAVE_CONTEXT.get(dotted, [])
    if dotted == "data.dataset_format":
        (run / "dataset_info.json").write_text(json.dumps({"t": {"file_name": "train.jsonl"}}))
        outside = [f"dataset_dir={run}", "dataset=t"]
    lines = _problems(run, [*outside, f"{dotted}={value}"])
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{dotted}=") and " acts only with " in lines[0], lines
    inside = context if context is not None else []
    if dotted == "finetuning.create_new_adapter":
        inside = [*inside, f"adapter_name_or_path={_tiny_adapter(run / 'adapter')}"]
    world_size = 2 if "context_parallel_size=2" in inside else 1
    load_config(run / "run.yaml", [*inside, f"{dotted}={value}"]).resolve(world_size)


def test_a_resolved_config_read_back_is_accepted(run: Path, tmp_path: Path):
    """hpc-mca resume reads resolved_config.yaml, which writes every field: what resolve
    derives must not look like a setting made outside its context."""
    for overrides in ([], ["stage=dpo"], ["finetuning_type=lora"], ["stage=pt"]):
        resolved = load_config(run / "run.yaml", overrides).resolve(1)
        path = resolved.save_resolved(tmp_path / "_".join(overrides or ["sft"]))
        assert load_config(path).resolve(1) == resolved


def test_every_problem_of_a_config_in_one_message(run: Path):
    (run / "lf.yaml").write_text(yaml.safe_dump({
        "model_name_or_path": "model", "dataset": "train.jsonl", "output_dir": str(run / "o"),
        "do_train": False, "packing": "maybe", "use_dora": True, "ddp_timeout": 180000000,
        "flash_attn": "fa3", "learnig_rate": 1e-4, "bf16": "yes", "pref_beta": 0.1},
        sort_keys=False))
    with pytest.raises(ConfigError) as err:
        load_config(run / "lf.yaml")
    lines = str(err.value).splitlines()
    # LLaMA-Factory's keys (tests/test_lf_keys.py) among this config's own, in the order written
    assert [line.split("=")[0].split(" ")[0] for line in lines] == [
        "do_train", "packing", "use_dora", "flash_attn", "unknown", "training.bf16"], lines
    assert lines[2].startswith("use_dora=True is not supported: no DoRA here")
    assert lines[4].endswith("did you mean 'training.learning_rate'?")
    assert lines[5] == "training.bf16='yes' must be true or false"
    # Then the rules of every section at once (resolve)
    lines = _problems(run, ["stage=sft", "pref_loss=ipo", "lora_rank=4", "save_total_limit=0",
                            "mix_strategy=random", "tensor_model_parallel_size=3"], world_size=3)
    assert [line.split("=")[0] for line in lines] == [
        "finetuning.pref_loss", "finetuning.lora_rank", "data.mix_strategy", "training.save_total_limit",
        "parallel.tensor_model_parallel_size"], lines


def test_a_later_value_clears_an_earlier_problem(run: Path):
    config = load_config(run / "run.yaml", ["bf16=maybe", "training.bf16=true"])
    assert config.training.bf16 is True


@pytest.mark.parametrize("key, wrong", [
    ("deepspeed", "seed"), ("do_eval", "eval_steps'"), ("quantization_bit", "did you mean"),
    ("max_length", "seq_length"), ("lora_r", "lora_dropout"),
])
def test_suggestions_come_from_the_alias_table_not_loose_matches(key: str, wrong: str):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=1"])
    assert KNOWN_ELSEWHERE[key] in str(err.value) and wrong not in str(err.value)


def test_an_unrelated_key_gets_no_guess():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["quantisation_depth=4"])
    assert "did you mean" not in str(err.value)
    assert "valid: the fields of the model, data, finetuning, training and parallel" in str(
        err.value)


def test_warmup_steps_override_the_ratio_as_in_transformers(run: Path):
    (run / "ratio.yaml").write_text((run / "run.yaml").read_text() + "warmup_ratio: 0.1\n")
    resolved = load_config(run / "ratio.yaml", ["warmup_steps=3"]).resolve(1)
    tr = resolved.training
    assert resolve_warmup_steps(tr.warmup_steps, tr.warmup_ratio, 10) == 3


def test_a_ratio_of_a_one_step_run_rounds_up_and_runs(run: Path):
    (run / "ratio.yaml").write_text((run / "run.yaml").read_text() + "warmup_ratio: 0.1\n")
    resolved = load_config(run / "ratio.yaml", ["max_steps=1"]).resolve(1)
    tr = resolved.training
    assert resolve_warmup_steps(tr.warmup_steps, tr.warmup_ratio, 1) == 1


def test_resume_from_checkpoint_null_means_auto_as_in_llamafactory(run: Path):
    (run / "lf.yaml").write_text((run / "run.yaml").read_text()
                                 + "resume_from_checkpoint: null\n")
    assert load_config(run / "lf.yaml").training.resume_from_checkpoint == "auto"
    with pytest.raises(ConfigError, match=r"training.resume_from_checkpoint=\[1\] must be a "
                                          r"string; valid: auto, never, or a checkpoint"):
        load_config(None, ["resume_from_checkpoint=[1]"])


def test_defaults_are_in_context():
    """The defaults themselves never trip a scope (each default run is valid)."""
    from hpc_mca.config.scope import check_scopes

    check_scopes(TrainConfig(), 1)


@pytest.mark.parametrize("overrides, world_size, message", [
    (["calculate_per_token_loss=false"], 1, "parallel.calculate_per_token_loss=false: the loss "
     "functions return token sums that the step divides by the global batch's real tokens"),
    (["optimizer_cpu_offload=true"], 1, "parallel.optimizer_cpu_offload=true needs "
     "parallel.use_distributed_optimizer=true"),
    (["tensor_model_parallel_size=2", "expert_tensor_parallel_size=2", "tensor_model_parallel_size=4"],
     4, "parallel.expert_tensor_parallel_size=2 splits MoE experts, and"),
    (["model_name_or_path=moe", "tensor_model_parallel_size=2"], 2,
     "parallel.sequence_parallel=false with parallel.tensor_model_parallel_size=2 on a mixture "
     "of experts (qwen3_moe)"),
    (["recompute_num_layers=2"], 1, "parallel.recompute_num_layers=2 acts only with "
     "parallel.recompute_granularity full"),
    # the standard backend has no counterpart of these: refused rather than ignored
    (["use_mca=false", "overlap_grad_reduce=true"], 1, "parallel.overlap_grad_reduce=True with "
     "training.use_mca=false"),
    (["use_mca=false", "recompute_granularity=full", "recompute_method=uniform",
      "recompute_num_layers=2"], 1, "parallel.recompute_granularity='full', recompute_method="
     "'uniform', recompute_num_layers=2 with training.use_mca=false: the standard backend "
     "recomputes every decoder layer"),
])
def test_settings_that_would_compute_something_else_are_refused(run: Path, overrides: list[str],
                                                                world_size: int, message: str):
    if "model_name_or_path=moe" in overrides:
        (run / "moe").mkdir()
        (run / "moe" / "config.json").write_text(json.dumps({
            **CONFIG_ONLY_LLAMA, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "head_dim": 16}))
        overrides = [f"model_name_or_path={run / 'moe'}", *overrides[1:]]
    lines = _problems(run, overrides, world_size)
    assert any(message in line for line in lines), lines


def test_a_dense_model_takes_the_planners_etp_of_one(run: Path):
    resolved = load_config(run / "run.yaml", ["tensor_model_parallel_size=2",
                                              "expert_tensor_parallel_size=1"]).resolve(2)
    assert resolved.parallel.expert_tensor_parallel_size == 1
