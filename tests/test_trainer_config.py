"""hpc_mca.config.sections: YAML + overrides, type checks, cross-field rules, resolved output."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trainer_fixtures import config_only_run

from hpc_mca.config.loading import load_config
from hpc_mca.config.run_length import total_training_steps
from hpc_mca.config.sections import ConfigError, TrainConfig


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A directory with a config-only model, a dataset file and a YAML using relative paths."""
    return config_only_run(tmp_path, per_device_train_batch_size=2, learning_rate="1e-3",
                           parallel={"tensor_model_parallel_size": 2})


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_yaml_flat_and_sectioned_keys_with_relative_paths(run: Path):
    config = load_config(run / "run.yaml")
    assert config.model.model_name_or_path == str(run / "model")
    assert config.data.dataset == [str(run / "train.jsonl")]
    assert config.training.learning_rate == pytest.approx(1e-3)  # "1e-3" is a YAML string
    assert config.parallel.tensor_model_parallel_size == 2


def test_overrides_flat_dotted_and_yaml_typed(run: Path):
    config = load_config(run / "run.yaml", [
        "training.learning_rate=2e-4", "bf16=true", "warmup_steps=3",
        "lr_scheduler_type=cosine_with_min_lr", "lr_scheduler_kwargs={min_lr_rate: 0.1}",
        "training.lr_scheduler_kwargs.min_lr_rate=0.2", "report_to=none",
    ])
    tr = config.training
    assert (tr.learning_rate, tr.bf16, tr.warmup_steps) == (2e-4, True, 3)
    assert tr.lr_scheduler_kwargs == {"min_lr_rate": 0.2}
    assert tr.report_to == ["none"]


def test_unknown_key_suggests_closest(run: Path):
    with pytest.raises(ConfigError) as err:
        load_config(run / "run.yaml", ["learnig_rate=1e-4"])
    assert _one_line(err) == ("unknown config key 'learnig_rate'; did you mean "
                              "'training.learning_rate'?")
    with pytest.raises(ConfigError, match="did you mean 'parallel.tensor_model_parallel_size'"):
        load_config(None, ["parallel.tensor_parallel_size=2"])


def test_unknown_key_in_yaml(tmp_path: Path):
    (tmp_path / "bad.yaml").write_text("trainng:\n  seed: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "bad.yaml")
    assert "unknown config key 'trainng'" in _one_line(err)


def test_type_errors_name_the_field():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["per_device_train_batch_size=two"])
    assert _one_line(err) == ("training.per_device_train_batch_size='two' must be an integer")
    with pytest.raises(ConfigError, match="training.bf16='yes please' must be true or false"):
        load_config(None, ["bf16=yes please"])


def test_resolve_derives_dp_accumulation_and_seq_length(run: Path):
    config = load_config(run / "run.yaml", ["global_batch_size=8", "cutoff_len=64"])
    resolved = config.resolve(world_size=4)
    assert resolved.parallel.data_parallel_size == 2
    assert resolved.training.gradient_accumulation_steps == 2  # 8 / (2 micro × 2 DP)
    assert resolved.data.seq_length == 64
    assert resolved.parallel.expert_tensor_parallel_size == 2
    assert config.parallel.data_parallel_size is None  # resolve returns a copy
    again = resolved.resolve(world_size=4)
    assert again == resolved


def test_global_batch_not_divisible_by_micro_times_dp(run: Path):
    config = load_config(run / "run.yaml", ["global_batch_size=6"])
    with pytest.raises(ConfigError) as err:
        config.resolve(world_size=4)  # DP 2, micro 2 -> multiples of 4
    message = _one_line(err)
    assert message.startswith("training.per_device_train_batch_size=2 does not divide "
                              "training.global_batch_size/parallel.data_parallel_size=6/2=3")
    assert message.endswith("valid: 1, 3")


def test_layout_rule_uses_topology_and_model_shape(run: Path):
    config = load_config(run / "run.yaml", ["tensor_model_parallel_size=3"])
    with pytest.raises(ConfigError) as err:
        config.resolve(world_size=6)
    assert _one_line(err).startswith(
        "parallel.tensor_model_parallel_size=3 does not divide num_attention_heads=4")


@pytest.mark.parametrize("override, message", [
    (["stage=ppo"], "finetuning.stage='ppo' is not valid; valid: pt, sft, dpo, kto"),
    (["stage=dpo", "pref_loss=dpop"], "finetuning.pref_loss='dpop' is not valid; valid: "
                                      "sigmoid, ipo, hinge, orpo, simpo"),
    (["stage=dpo", "simpo_gamma=0.3"], "finetuning.simpo_gamma=0.3 acts only with "
                                       "pref_loss='simpo', not 'sigmoid'"),
    (["stage=dpo", "pref_loss=orpo", "use_ref_model=true"],
     "finetuning.use_ref_model=true with pref_loss='orpo': orpo is reference-free"),
    (["stage=dpo", "pref_loss=simpo", "ref_model=/nonexistent"],
     "finetuning.ref_model='/nonexistent' with a reference-free run (pref_loss='simpo'"),
    (["stage=dpo", "use_ref_model=false", "ref_model=/nonexistent"],
     "finetuning.ref_model='/nonexistent' with a reference-free run (pref_loss='sigmoid', "
     "use_ref_model=False)"),
    (["stage=dpo", "ref_model=/nonexistent"],
     "finetuning.ref_model='/nonexistent' has no config.json"),
    (["stage=dpo", "pref_beta=0"], "finetuning.pref_beta=0.0 must be > 0"),
    (["stage=dpo", "pref_loss=ipo", "dpo_label_smoothing=0.1"],
     "finetuning.dpo_label_smoothing=0.1 applies to pref_loss='sigmoid' only, not 'ipo'"),
    (["stage=dpo", "dpo_label_smoothing=0.5"],
     "finetuning.dpo_label_smoothing=0.5 must be in [0, 0.5)"),
    (["stage=dpo", "mtp_num_layers=1"], "model.mtp_num_layers=1 with finetuning.stage='dpo'"),
    (["stage=dpo", "train_on_prompt=true"], "data.train_on_prompt=true with "
                                            "finetuning.stage='dpo'"),
    (["stage=dpo", "sequence_packing=true", "cutoff_len=32", "seq_length=48"],
     "data.seq_length=48 with sequence_packing and finetuning.stage='dpo': a packed row must "
     "hold a whole pair of up to 2 × cutoff_len=64 tokens; valid: data.seq_length >= 64"),
    (["stage=dpo", "dataset_format=text"], "data.dataset_format='text' does not fit "
                                           "finetuning.stage='dpo'; valid: auto, alpaca, sharegpt"),
    (["finetuning_type=lora", "lora_target=[q_proj,attn]"],
     "finetuning.lora_target=['q_proj', 'attn'] names no module of this llama: attn; valid: "
     "all, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
    (["finetuning_type=lora", "lora_target=gate_up_proj"],
     "finetuning.lora_target=['gate_up_proj'] names no module of this llama: gate_up_proj"),
    (["finetuning_type=lora", "lora_rank=0"], "finetuning.lora_rank=0 must be >= 1"),
    (["finetuning_type=lora", "mtp_num_layers=1"],
     "model.mtp_num_layers=1 with finetuning.finetuning_type='lora': MTP layers start untrained"),
    (["export_merged_dir=merged"], "training.export_merged_dir='merged' merges LoRA adapters "
                                   "into the base model; valid with finetuning.finetuning_type"),
    (["finetuning_type=qlora"], "finetuning.finetuning_type='qlora' is not valid; valid: full, "
                                "lora"),
    (["profile_steps=[3,2]"], "training.profile_steps=[3, 2]; valid: [first, last] with "
                              "1 <= first <= last <= max_steps"),
    (["profile_steps=[0,1]"], "training.profile_steps=[0, 1]; valid: [first, last]"),
    (["packed_attention=fast"], "model.packed_attention='fast' is not valid; valid: auto, "
                                "varlen, flex, sdpa"),
    (["context_parallel_size=2", "cp_comm_type=ring"], "parallel.cp_comm_type='ring' is not valid; valid: all_gather, "
                            "a2a, p2p"),
    (["fusions=[swiglu,rmsnorm]"], "model.fusions: 'rmsnorm' is not a fusion; valid: swiglu, "
                                "cross_entropy"),
    (["fusions=swiglu", "use_mca=false", "tensor_model_parallel_size=1"],
     "model.fusions=['swiglu'] with training.use_mca=false"),
    (["context_parallel_size=2", "sequence_packing=true", "pack_alignment=2"],
     "data.pack_alignment=2 is not a multiple of 2·CP=4 (parallel.context_parallel_size=2); "
     "valid: 4, 8, 16, or leave it unset"),
    (["sequence_packing=true", "pack_alignment=0"], "data.pack_alignment=0 must be >= 1"),
    (["mtp_num_layers=-1"], "model.mtp_num_layers=-1 must be >= 0"),
    (["mtp_num_layers=3", "pipeline_model_parallel_size=2"],
     "parallel.pipeline_model_parallel_size=2 leaves 2 decoder layers on the last stage "
     "(num_layers=4), fewer than the model.mtp_num_layers=3 MTP layers that also run there; "
     "valid: 1, or model.mtp_num_layers <= 2"),
    (["mtp_num_layers=1", "pipeline_model_parallel_size=2", "pipeline_layout=[1,3]"],
     "model.mtp_num_layers=1 with parallel.pipeline_layout: MTP layers go on the last stage "
     "of an even split; valid: no parallel.pipeline_layout"),
    (["max_steps=-1", "num_train_epochs=0"], "set max_steps > 0 or num_train_epochs > 0"),
    (["warmup_ratio=1.5"], "training.warmup_ratio=1.5 must be in [0, 1)"),
    (["lr_scheduler_type=cosin"], "training.lr_scheduler_type='cosin' is not a known scheduler; "
                                  "valid: linear, cosine, cosine_with_restarts, polynomial"),
    (["bf16=true", "fp16=true"], "training.bf16 and training.fp16 are both true"),
    (["optim=lion"], "training.optim='lion' is not valid; valid: adam, sgd"),
    (["dataset_format=text"], "data.dataset_format='text' does not fit finetuning.stage='sft'"),
    (["attention_backend=xformers"], "valid: auto, te, flash, torch"),
    (["overlap_param_gather=true"], "needs parallel.use_distributed_optimizer=true"),
    (["recompute_granularity=full"], "parallel.recompute_num_layers=None must be >= 1"),
    (["recompute_granularity=selective", "recompute_modules=[moe]"],
     "parallel.recompute_modules has 'moe': this model has no MoE layers (mlp recomputes its "
     "MLPs); valid: one or more of core_attn, layernorm, mlp"),
    (["recompute_granularity=selective", "recompute_modules=[layernorm,moe_act]"],
     "parallel.recompute_modules has 'moe_act': Megatron-Core recomputes it only in "
     "grouped-GEMM experts, which this trainer does not build"),
    (["recompute_granularity=selective", "recompute_modules=[mla_up_proj]"],
     "parallel.recompute_modules has 'mla_up_proj': this model has no multi-latent attention"),
    (["recompute_granularity=selective", "recompute_modules=[]"],
     "parallel.recompute_modules=[] names no module or one twice; valid: one or more of "
     "core_attn, layernorm, mlp"),
    (["recompute_granularity=selective", "recompute_modules=[mlp,mlp]"],
     "parallel.recompute_modules=['mlp', 'mlp'] names no module or one twice"),
    (["recompute_granularity=selective", "recompute_modules=[layernorm]", "fusions=[layer]"],
     "parallel.recompute_modules has 'layernorm' with model.fusions 'layer': the norms' "
     "output-discarding checkpoint does not run inside compiled layers"),
    (["seq_length=16", "cutoff_len=32"], "data.seq_length=16 is shorter than data.cutoff_len=32"),
    (["output_dir="], "training.output_dir is required"),
    (["gradient_accumulation_steps=3", "global_batch_size=8"],
     "training.gradient_accumulation_steps=3 disagrees"),
])
def test_cross_field_rules(run: Path, override: list[str], message: str):
    with pytest.raises(ConfigError) as err:
        load_config(run / "run.yaml", override).resolve(world_size=4)
    assert message in _one_line(err)


def test_missing_model_config_is_reported(tmp_path: Path):
    config = load_config(None, [f"model_name_or_path={tmp_path}", "dataset=x.jsonl",
                                f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="has no config.json"):
        config.resolve(world_size=1)


def test_sequence_parallel_off_without_tp(run: Path):
    config = load_config(run / "run.yaml", ["tensor_model_parallel_size=1",
                                            "sequence_parallel=true"])
    assert config.resolve(world_size=2).parallel.sequence_parallel is False


def test_save_resolved_round_trips(run: Path, tmp_path: Path):
    resolved = load_config(run / "run.yaml", ["lr_scheduler_type=cosine_with_min_lr",
                                              "lr_scheduler_kwargs={min_lr: 1.0e-5}"]).resolve(2)
    path = resolved.save_resolved(tmp_path / "run_dir")
    assert path.name == "resolved_config.yaml"
    reloaded = load_config(path)
    assert reloaded == resolved
    assert yaml.safe_load(path.read_text())["parallel"]["data_parallel_size"] == 1


def test_total_training_steps(run: Path):
    resolved = load_config(run / "run.yaml", ["max_steps=-1", "num_train_epochs=2"]).resolve(2)
    assert resolved.training.global_batch_size == 2
    assert total_training_steps(resolved.training, num_rows=11) == 12  # 6 batches (1 partial) × 2
    assert total_training_steps(resolved.training, num_rows=1) == 2  # one partial batch × 2
    with pytest.raises(ConfigError, match="the training data has no rows"):
        total_training_steps(resolved.training, num_rows=0)


def test_field_names_are_unique_and_documented():
    import dataclasses
    import inspect

    seen = set()
    for section in dataclasses.fields(TrainConfig):
        cls = section.type if isinstance(section.type, type) else type(getattr(TrainConfig(),
                                                                               section.name))
        source = inspect.getsource(cls)
        for f in dataclasses.fields(cls):
            assert f.name not in seen
            seen.add(f.name)
            # A docstring line directly follows every field declaration.
            lines = source.splitlines()
            at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{f.name}:"))
            assert lines[at + 1].strip().startswith('"""'), f.name


def test_config_import_stays_light():
    code = ("import sys, hpc_mca.config, hpc_mca.config.sections, hpc_mca.config.schedule;"
            "print(sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_packed_attention_kernel_is_checked_before_the_process_group(run: Path):
    """What the run log says about attention, and an explicit kernel this CPU cannot train with
    refused in one line by the pre-process-group check (exit 2 from `hpc-mca train`)."""
    from hpc_mca.launch.run import attention_backend_available
    from hpc_mca.models.errors import ModelLoadError

    config = load_config(run / "run.yaml").resolve(world_size=2)
    assert attention_backend_available(config).startswith(
        "attention: torch backend, packed kernel sdpa (auto (not varlen: needs CUDA; ")
    config = load_config(run / "run.yaml", ["packed_attention=flex"]).resolve(world_size=2)
    with pytest.raises(ModelLoadError) as err:
        attention_backend_available(config)
    assert _one_line(err).startswith("model.packed_attention='flex' cannot run here: needs CUDA")
