"""LLaMA-Factory's common keys (issue #39): each honoured, mapped onto this config's own fields,
or refused in one line that names the key and what replaces it; every problem of a config in
one message; and LLaMA-Factory's example YAMLs load with only the model, the data directory and
the output directory changed. README.md's "LLaMA-Factory keys" table points here (the keys with
a runtime effect: tests/test_lf_runtime.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from lf_examples import EXAMPLES
from trainer_fixtures import CONFIG_ONLY_LLAMA, config_only_run

from hpc_mca.config.lf_keys import LF_KEYS
from hpc_mca.config.loading import load_config, load_resolved
from hpc_mca.config.sections import ConfigError, TrainConfig


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return config_only_run(tmp_path)


def _load(run: Path, *overrides: str) -> TrainConfig:
    return load_config(run / "run.yaml", list(overrides))


def _refusal(run: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        _load(run, *overrides)
    lines = str(err.value).splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _resolve_refusal(run: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        _load(run, *overrides).resolve(1)
    return str(err.value)


def test_do_train(run: Path):
    assert _load(run, "do_train=true") == _load(run)
    line = _refusal(run, "do_train=false")
    assert line.startswith("do_train=false: hpc-mca train always trains") and "valid: true" in line


def test_trust_remote_code(run: Path):
    for value in ("true", "false"):
        _load(run, f"trust_remote_code={value}").resolve(1)
    # A model whose architecture is the directory's own Python is refused whatever the key says.
    config = json.loads((run / "model" / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (run / "model" / "config.json").write_text(json.dumps(config))
    for value in ("true", "false"):
        message = _resolve_refusal(run, f"trust_remote_code={value}")
        assert "auto_map asks for the model's own Python code, which never runs here" in message


@pytest.mark.parametrize("key", ["packing", "neat_packing"])
def test_packing(run: Path, key: str):
    assert _load(run, f"{key}=true").data.sequence_packing is True
    assert _load(run, f"data.{key}=true").data.sequence_packing is True  # under its section
    assert _load(run, "sequence_packing=true", f"{key}=false").data.sequence_packing is False
    # this config's own key written after it wins
    assert _load(run, f"{key}=true", "sequence_packing=false").data.sequence_packing is False
    assert _refusal(run, f"{key}=sometimes") == f"{key}='sometimes' must be true or false"


def test_neat_packing(run: Path):
    """neat_packing is packing here: packed documents never attend to each other."""
    assert _load(run, "neat_packing=true") == _load(run, "packing=true")


@pytest.mark.parametrize("value, backend", [("auto", "auto"), ("disabled", "torch"),
                                            ("sdpa", "torch"), ("fa2", "flash")])
def test_flash_attn(run: Path, value: str, backend: str):
    config = _load(run, f"flash_attn={value}")
    assert config.model.attention_backend == backend
    config.resolve(1)


def test_flash_attn_refusals(run: Path):
    line = _refusal(run, "flash_attn=fa3")
    assert line.startswith("flash_attn='fa3': no attention backend here runs FlashAttention-3")
    assert "valid: auto, disabled, sdpa, fa2" in line
    assert _refusal(run, "flash_attn=eager").startswith("flash_attn='eager' is not valid; valid: "
                                                         "auto, disabled, sdpa, fa2")
    # The standard backend's attention is the torch backend's kernel: sdpa names it, fa2 is refused.
    _load(run, "use_mca=false", "flash_attn=sdpa").resolve(1)
    message = _resolve_refusal(run, "use_mca=false", "flash_attn=fa2")
    assert message.startswith("model.attention_backend='flash' with training.use_mca=false: the "
                              "standard backend's attention is the torch backend's packed kernel")


def test_gradient_checkpointing(run: Path):
    par = _load(run, "gradient_checkpointing=true").resolve(1).parallel
    assert (par.recompute_granularity, par.recompute_method, par.recompute_num_layers) == (
        "full", "uniform", 1)
    par = _load(run, "recompute_granularity=selective", "gradient_checkpointing=false").parallel
    assert (par.recompute_granularity, par.recompute_method, par.recompute_num_layers) == (
        None, None, None)
    # The standard backend recomputes every layer or none: a partial recompute is refused.
    message = _resolve_refusal(run, "use_mca=false", "gradient_checkpointing=true",
                               "recompute_num_layers=2")
    assert "the standard backend recomputes every decoder layer" in message


@pytest.mark.parametrize("finetuning_type", ["full", "lora"])
def test_gradient_checkpointing_on_the_standard_backend(tmp_path: Path, finetuning_type: str):
    """transformers' gradient checkpointing is on (the run log says so, read from the model)
    and, recomputing the same forward, changes no loss."""
    from trainer_fixtures import run_ranks, steps

    from hpc_mca.data.addition import DEMO_DIR

    losses = {}
    for on in (False, True):
        run_dir = tmp_path / f"gc-{on}"
        # No evaluation: the demo's pass over its 512 eval problems asserts nothing here.
        done = run_ranks(1, ["train", str(DEMO_DIR / "sft_addition.yaml"), "max_steps=3",
                             "logging_steps=1", f"output_dir={run_dir}", "use_mca=false",
                             "eval_dataset=null", "eval_steps=null",
                             f"finetuning_type={finetuning_type}", f"gradient_checkpointing={on}"])
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert ("activation recompute: every decoder layer" in done.stdout) is on
        losses[on] = [row["loss"] for row in steps(run_dir)]
    assert losses[True] == losses[False] and len(losses[True]) == 3


def test_gradient_checkpointing_reaches_megatron(run: Path):
    """What Megatron-Core builds from it: every layer recomputed, accepted by its own checks."""
    from hpc_mca.config.layout import layout_of
    from hpc_mca.trainer.megatron_settings import check_megatron_settings, model_overrides

    config = _load(run, "gradient_checkpointing=true").resolve(1)
    check_megatron_settings(config, layout_of(config.parallel))
    overrides = model_overrides(config.model, config.parallel, config.training)
    assert (overrides["recompute_granularity"], overrides["recompute_method"],
            overrides["recompute_num_layers"]) == ("full", "uniform", 1)


@pytest.mark.parametrize("key", ["eval_strategy", "evaluation_strategy"])
def test_eval_strategy(run: Path, key: str):
    # steps: eval_steps, or transformers' default (logging_steps) when there is eval data
    assert _load(run, "val_size=0.5", f"{key}=steps", "eval_steps=7").training.eval_steps == 7
    assert _load(run, "val_size=0.5", "logging_steps=3", f"{key}=steps").training.eval_steps == 3
    assert _load(run, f"{key}=steps").training.eval_steps is None  # no eval data: nothing to set
    # no: eval_steps does not count, whatever the order (still one evaluation after the last step)
    assert _load(run, "val_size=0.5", "eval_steps=7", f"{key}=no").training.eval_steps is None
    assert _load(run, "val_size=0.5", f"{key}=no", "eval_steps=7").training.eval_steps is None
    line = _refusal(run, f"{key}=epoch")
    assert line.startswith(f"{key}='epoch': an epoch's length in steps is known only once the "
                           "data is tokenized; valid: steps, with training.eval_steps")


def test_save_strategy(run: Path):
    assert _load(run, "save_strategy=steps", "save_steps=20").training.save_steps == 20
    assert _load(run, "save_strategy=steps").training.save_steps == 500  # transformers' default
    # no: only the final checkpoint (and one on a stop signal), whatever save_steps says
    assert _load(run, "save_strategy=no", "save_steps=20").training.save_steps is None
    assert "valid: steps, with training.save_steps" in _refusal(run, "save_strategy=epoch")
    assert _refusal(run, "save_strategy=best") == "save_strategy='best' is not valid; valid: steps, no"


def test_save_strategy_no_from_yaml(run: Path, tmp_path: Path):
    """YAML reads a bare ``no`` as false: still LLaMA-Factory's "no"."""
    (run / "run.yaml").write_text((run / "run.yaml").read_text()
                                  + "save_steps: 5\nsave_strategy: no\neval_strategy: no\n")
    assert _load(run).training.save_steps is None


def test_logging_strategy(run: Path):
    assert _load(run, "logging_strategy=steps", "logging_steps=4").training.logging_steps == 4
    line = _refusal(run, "logging_strategy=no")
    assert line.startswith("logging_strategy='no': the loss is always logged") and "valid: steps" in line
    assert "training.logging_steps" in _refusal(run, "logging_strategy=epoch")


@pytest.mark.parametrize("name, fused", [("adamw_torch", False), ("adamw_hf", False),
                                         ("adamw_torch_fused", True)])
def test_optim(run: Path, name: str, fused: bool):
    tr = _load(run, f"optim={name}").resolve(1).training
    assert (tr.optim, tr.fused_optimizer) == ("adam", fused)
    # this config's own key written after it wins
    assert _load(run, f"optim={name}", f"fused_optimizer={not fused}").training.fused_optimizer is not fused


def test_optim_refusal(run: Path):
    assert _refusal(run, "optim=adafactor") == (
        "training.optim='adafactor' is not valid; valid: adam, sgd, or transformers' adamw_torch, "
        "adamw_hf, adamw_torch_fused (adam)")


def test_tokenized_path(run: Path, tmp_path: Path):
    """Mapped to the tokenization cache: saved there once, read from there when present (the
    cache key also covers the data and settings, so a changed dataset is tokenized again)."""
    assert _load(run, f"tokenized_path={tmp_path / 'tok'}").data.preprocessing_cache_dir == str(
        tmp_path / "tok")
    assert _load(run, "tokenized_path=null").data.preprocessing_cache_dir is None


def test_tokenized_path_saves_once_and_loads_when_present(tmp_path: Path):
    from hpc_mca.data.addition import DEMO_DIR
    from hpc_mca.data.dataset import build_datasets

    config = load_config(None, [
        f"model_name_or_path={DEMO_DIR}", f"output_dir={tmp_path / 'out'}",
        f"dataset=[{DEMO_DIR / 'eval.jsonl'}]", "max_samples=8", "cutoff_len=32", "max_steps=2",
        f"tokenized_path={tmp_path / 'tokenized'}"]).resolve(1)
    first = build_datasets(config.data, config.data_run()).train.samples.stats["cache_hits"]
    saved = sorted(path.name for path in (tmp_path / "tokenized").iterdir())
    again = build_datasets(config.data, config.data_run()).train.samples.stats["cache_hits"]
    assert (first, again) == (0, 1) and saved
    assert sorted(path.name for path in (tmp_path / "tokenized").iterdir()) == saved


def test_streaming(run: Path):
    assert _load(run, "streaming=false") == _load(run)
    line = _refusal(run, "streaming=true")
    assert line.startswith("streaming=true: datasets are tokenized once into memory-mapped Arrow "
                           "files") and "valid: false" in line


@pytest.mark.parametrize("key", ["enable_liger_kernel", "use_liger_kernel"])
def test_liger_kernel(run: Path, key: str):
    """LLaMA-Factory's (and transformers') liger switch: false is what runs; true is refused in
    one line pointing at model.fusions, since liger measured no faster than the kernels in use."""
    assert _load(run, f"{key}=false") == _load(run)
    line = _refusal(run, f"{key}=true")
    assert line.startswith(f"{key}=true: liger-kernel is not used here") and "model.fusions" in line
    assert line.endswith("valid: false") and "\n" not in line
    assert _refusal(run, f"{key}=maybe") == f"{key}='maybe' must be true or false"


def test_export_dir(run: Path, tmp_path: Path):
    full = _load(run, "export_dir=exported").training
    assert full.export_hf_dir == os.path.abspath("exported") and full.export_merged_dir is None
    # LoRA: LLaMA-Factory's export merges the adapters (the key may come before finetuning_type)
    lora = _load(run, f"export_dir={tmp_path / 'merged'}", "finetuning_type=lora").training
    # (the adapter's own export, export_hf_dir, keeps its default)
    assert lora.export_merged_dir == str(tmp_path / "merged")
    assert lora.export_hf_dir == TrainConfig().training.export_hf_dir


def test_refused_keys(run: Path):
    """LLaMA-Factory's quantization_bit: its default (null) is accepted, a number refused in one
    line (tests/test_key_answers.py walks every such key)."""
    assert _load(run, "quantization_bit=null") == _load(run)
    line = _refusal(run, "quantization_bit=4")
    assert line.startswith("quantization_bit=4 is not supported: no quantized training (QLoRA) here")
    assert line.endswith("valid: null (its default), or remove the key")
    assert "quantization_bit" not in LF_KEYS


@pytest.mark.parametrize("value, distributed", [
    ("examples/deepspeed/ds_z3_config.json", True), ("ds_z2_offload_config.json", True),
    ("zero1.json", True), ("ds_z0_config.json", False), (None, False)])
def test_deepspeed_by_name(run: Path, value: str | None, distributed: bool):
    """A DeepSpeed config that is not on this machine (LLaMA-Factory's examples name theirs
    relative to its checkout): the ZeRO stage in its name decides."""
    config = _load(run, f"deepspeed={'null' if value is None else value}")
    assert config.parallel.use_distributed_optimizer is distributed


def test_deepspeed_reads_the_json(run: Path, tmp_path: Path):
    """A DeepSpeed JSON that exists is read: its zero_optimization.stage decides, not its name."""
    for stage, distributed in ((3, True), (1, True), (0, False)):
        path = tmp_path / f"ds_z3_config_{stage}.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": stage}, "bf16": {"enabled": "auto"}}))
        assert _load(run, f"deepspeed={path}").parallel.use_distributed_optimizer is distributed
    (tmp_path / "bad.json").write_text(json.dumps({"zero_optimization": {"stage": 4}}))
    assert _refusal(run, f"deepspeed={tmp_path / 'bad.json'}") == (
        "deepspeed: zero_optimization.stage=4; valid: 0, 1, 2 or 3")
    assert _refusal(run, "deepspeed=my_ds.json").startswith(
        "deepspeed='my_ds.json': no such file here and its name gives no ZeRO stage; valid:")


def test_report_to(run: Path):
    assert _load(run, "report_to=none").training.report_to == ["none"]
    assert _load(run, "report_to=[tensorboard]").training.report_to == ["tensorboard"]
    assert _refusal(run, "report_to=swanlab") == (
        "training.report_to='swanlab': SwanLab is not a tracker here; valid: tensorboard, wandb, "
        "mlflow, none")
    assert _refusal(run, "report_to=tensorbord").endswith("did you mean 'tensorboard'?")


def test_template_is_checked_at_load(run: Path):
    from hpc_mca.data.templates import TEMPLATE_NAMES

    assert _load(run, "template=qwen3_nothink").data.template == "qwen3_nothink"
    line = _refusal(run, "template=qwen3_nothnik")
    assert line.startswith("data.template='qwen3_nothnik' is not valid; valid: " + ", ".join(TEMPLATE_NAMES))
    assert line.endswith("did you mean 'qwen3_nothink'?")


def test_every_problem_of_a_config_in_one_message(run: Path):
    """Unknown keys, bad values and refused LLaMA-Factory keys, one line each in the order
    written, each with its suggestion; load_resolved adds the rules' lines to the same message."""
    (run / "bad.yaml").write_text(
        "model_name_or_path: model\ndataset: train.jsonl\n"
        f"output_dir: {run / 'out'}\n"
        "do_train: false\n"
        "use_dora: true\n"
        "flash_attn: fa3\n"
        "template: qwen3_nothnik\n"
        "optim: adamw_8bit\n"
        "report_to: swanlab\n"
        "learnig_rate: 1.0e-4\n"
        "save_strategy: epoch\n"
        "quantization_bit: 4\n"
        "streaming: true\n"
        "bf16: maybe\n"
        "max_steps: 0\n")
    with pytest.raises(ConfigError) as err:
        load_config(run / "bad.yaml")
    lines = str(err.value).splitlines()
    assert [line.split("=")[0].split(":")[0].split(" ")[0] for line in lines] == [
        "do_train", "use_dora", "flash_attn", "data.template", "training.optim",
        "training.report_to", "unknown", "save_strategy", "quantization_bit", "streaming", "training.bf16"]
    assert lines[1].startswith("use_dora=True is not supported: no DoRA here")
    assert lines[3].endswith("did you mean 'qwen3_nothink'?")
    assert lines[6].endswith("did you mean 'training.learning_rate'?")
    # with the rules: the load lines, then the rules' (max_steps=0 is a rule's)
    with pytest.raises(ConfigError) as err:
        load_resolved(run / "bad.yaml", [], 1)
    both = str(err.value).splitlines()
    assert both[:len(lines)] == lines
    assert [line.split("=")[0] for line in both[len(lines):]] == ["training.max_steps"]


def test_load_resolved_is_resolve_when_all_is_well(run: Path):
    assert load_resolved(run / "run.yaml", ["bf16=true"], 1) == _load(run, "bf16=true").resolve(1)


# --- LLaMA-Factory's example YAMLs -----------------------------------------------------------

def _example(name: str, tmp_path: Path) -> Path:
    """The example with only model_name_or_path, dataset_dir and output_dir changed."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(CONFIG_ONLY_LLAMA))
    (tmp_path / "data").mkdir()
    config = dict(EXAMPLES[name])
    config.update(model_name_or_path="model", dataset_dir="data", output_dir=str(tmp_path / "out"))
    path = tmp_path / "example.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.parametrize("use_mca", ["true", "false"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_llama_factory_examples_load(tmp_path: Path, name: str, use_mca: str):
    path = _example(name, tmp_path)
    if "deepspeed" in EXAMPLES[name] and use_mca == "false":
        with pytest.raises(ConfigError) as err:  # the standard backend has no ZeRO sharding
            load_resolved(path, [f"use_mca={use_mca}"], 1)
        assert str(err.value).startswith("deepspeed='examples/deepspeed/ds_z3_config.json' (ZeRO-3) "
                                         "with training.use_mca=false"), str(err.value)
        assert len(str(err.value).splitlines()) == 1
        path.write_text("\n".join(line for line in path.read_text().splitlines()
                                  if not line.startswith("deepspeed:")))
    world = 1
    if EXAMPLES[name]["stage"] == "kto":
        # one example per device: on one rank its KL row would be its own answer (refused, as
        # TRL refuses it); on two data-parallel ranks the example runs as written
        with pytest.raises(ConfigError) as err:
            load_resolved(path, [f"use_mca={use_mca}"], 1)
        assert str(err.value).startswith("training.per_device_train_batch_size=1 on 1 "
                                         "data-parallel rank(s) with finetuning.stage='kto'")
        assert len(str(err.value).splitlines()) == 1
        world = 2
    config = load_resolved(path, [f"use_mca={use_mca}"], world)
    tr, data = config.training, config.data
    assert (tr.overwrite_output_dir, tr.plot_loss, tr.save_only_model) == (True, True, False)
    assert (tr.ddp_timeout, tr.dataloader_num_workers) == (180000000, 4)
    assert tr.resume_from_checkpoint == "auto" and tr.report_to == ["none"]
    assert data.preprocessing_num_workers == 16
    assert data.template == ("qwen3_nothink" if "pretrain" not in name else "chat")
    if config.finetuning.finetuning_type == "lora" and use_mca == "true":
        # bf16 LoRA keeps float32 adapters, which only the distributed optimizer keeps
        assert config.parallel.use_distributed_optimizer is True
    if "deepspeed" in EXAMPLES[name] and use_mca == "true":  # ds_z3_config.json, not here: by its name
        assert config.parallel.use_distributed_optimizer is True
