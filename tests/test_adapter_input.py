"""PEFT adapters as input (``model.adapter_name_or_path``): what a user checks against peft.

Two adapters made with peft's ``get_peft_model`` on the transformers model (random non-zero
B, other ranks, alphas and targets than the run's defaults) load onto the Megatron chunks:

* alone on TP2, the adapter trains on (LLaMA-Factory's ``create_new_adapter: false``): the
  logits equal ``PeftModel.from_pretrained``'s;
* both on PP2: the first is merged into the base, the second trains on, which equals peft
  loading the first, ``merge_and_unload``, then the second (LLaMA-Factory's order);
* both on TP2 with ``create_new_adapter``: both merged, a fresh adapter (B = 0) on top.

The runs train one step at learning rate 0, so the recorded logits are the loaded model's.

An adapter exported by a LoRA run after step 3 continues that run: the optimizer state is not
in an adapter, so the honest comparison is the first step after loading, whose loss and
gradient norm are computed from the adapter alone: every step sees the same whole dataset (8
examples, one micro-batch), so a run started from the export computes at its step 1 what the
resumed run computes at step 4. Both backends continue the same curve from the same adapter
(each with a fresh optimizer). dpo's LoRA reference is the base with the merged adapters, and
``ref_model_adapters`` are merged onto ``ref_model`` (both backends). The config rules refuse
what an adapter cannot be in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_fixtures import (
    config_only_run,
    make_model_dir,
    make_sft_data,
    rewind,
    run_ranks,
    run_train,
    steps,
    write_config,
    write_pairs,
)

from hpc_mca.config.loading import load_config
from hpc_mca.config.sections import ConfigError

WORKER = Path(__file__).with_name("lora_worker.py")
IDS = [[(i + 12 * row) % 40 + 3 for i in range(12)] for row in range(2)]  # lora_worker's input
ONE_STEP = {"learning_rate": 0.0, "max_steps": 1, "warmup_steps": 0, "lr_scheduler_type": "constant"}


def _peft_adapter(model_dir: Path, out: Path, seed: int, **lora) -> Path:
    """An adapter made with peft on the transformers model, B drawn non-zero."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(task_type="CAUSAL_LM", **lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    model.save_pretrained(str(out))
    return out


def _peft_logits(model_dir: Path, merged: list[Path], trained: Path | None):
    """LLaMA-Factory's loading with peft: ``merged`` merged in order, ``trained`` on top."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for path in merged:
        model = PeftModel.from_pretrained(model, path).merge_and_unload()
    if trained is not None:
        model = PeftModel.from_pretrained(model, trained)
    with torch.no_grad():
        return model.eval()(torch.tensor(IDS)).logits


def _ours(out: Path, vocab: int):
    import torch

    return torch.load(out / "logits.pt")[..., :vocab]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    model = make_model_dir(root)
    first = _peft_adapter(model, root / "first", 1, r=4, lora_alpha=16,
                          target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    second = _peft_adapter(model, root / "second", 2, r=2, lora_alpha=4,
                           target_modules=["k_proj", "o_proj", "up_proj"])
    config = write_config(root, model, make_sft_data(root, 64, 1, "train"),
                          finetuning={"finetuning_type": "lora"}, training=ONE_STEP)
    return root, model, config, first, second


@pytest.mark.slow
@pytest.mark.parametrize("name, adapters, extra, merged, trained", [
    ("tp2_one", ["first"], ["parallel.tensor_model_parallel_size=2"], [], "first"),
    ("pp2_two", ["first", "second"], ["parallel.pipeline_model_parallel_size=2"], ["first"], "second"),
    ("tp2_new", ["second", "first"], ["parallel.tensor_model_parallel_size=2",
                                      "finetuning.create_new_adapter=true"], ["second", "first"], None),
])
def test_peft_adapters_load_onto_megatron_layouts(made, name, adapters, extra, merged, trained):
    root, model, config, *_ = made
    paths = ",".join(str(root / a) for a in adapters)
    proc = run_ranks(2, [WORKER, root / f"out_{name}", config, f"training.output_dir={root / name}",
                         f"model.adapter_name_or_path={paths}", *extra])
    assert proc.returncode == 0, proc.stderr[-4000:]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ours = _ours(root / f"out_{name}", vocab)
    want = _peft_logits(model, [root / m for m in merged], trained and root / trained)
    diff = float((want - ours).abs().max())
    print(f"{name}: max |ours - peft| = {diff:.3g}")
    assert diff < 1e-5
    assert float((_peft_logits(model, [], None) - ours).abs().max()) > 0.1  # the adapters act
    result = json.loads((root / f"out_{name}" / "result.json").read_text())
    assert result["frozen_unchanged"]
    # What trains: the continued adapter with its own shape, or a new one of the run's shape.
    assert result["trainable"] == _peft_trainable(model, trained and root / trained)


@pytest.fixture(scope="module")
def dpo_steps(made):
    """Step 1 of one-step LoRA dpo runs on the made adapters (see the tests below)."""
    root, model, *_ = made
    (root / "dpo").mkdir()
    config = write_config(root / "dpo", model, write_pairs(root / "dpo" / "pairs.jsonl", 16, 1),
                          finetuning={"stage": "dpo", "finetuning_type": "lora"},
                          training={**ONE_STEP, "global_batch_size": 4})
    first, second = root / "first", root / "second"
    both = f"model.adapter_name_or_path={first},{second}"
    reference = ["finetuning.finetuning_type=full", f"finetuning.ref_model={model}",
                 f"finetuning.ref_model_adapters={first}"]
    runs = {"continued": [both], "standard": [both, "training.use_mca=false"],
            "merged": [f"model.adapter_name_or_path={first}", "finetuning.create_new_adapter=true"],
            "ref_adapters": reference, "ref_adapters_standard": [*reference, "training.use_mca=false"]}
    for name, extra in runs.items():
        proc = run_train(config, root / "dpo" / name, 1, *extra)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: steps(root / "dpo" / name)[0] for name in runs}


def _reference_logps(step: dict, side: str) -> float:
    return step[f"logps/{side}"] - step[f"rewards/{side}"] / 0.1  # rewards = β (policy - reference)


@pytest.mark.slow
def test_dpo_reference_is_the_base_with_the_merged_adapters(dpo_steps):
    """dpo with LoRA: the reference is the policy with its adapters off, so with adapters as
    input it is the base with the merged ones, as in LLaMA-Factory (TRL disables the trained
    adapter): a run continuing ``second`` on ``first`` has for reference log-probabilities the
    policy log-probabilities of a run with ``first`` merged under a new (zero) adapter. The
    standard backend (peft's merge and load) computes the same step."""
    continued, merged, standard = dpo_steps["continued"], dpo_steps["merged"], dpo_steps["standard"]
    for key in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert standard[key] == pytest.approx(continued[key], abs=1e-5), key
    assert abs(continued["rewards/margins"]) > 1e-3 and merged["rewards/chosen"] == 0.0
    for side in ("chosen", "rejected"):
        reference = _reference_logps(continued, side)
        print(f"dpo reference logps/{side}: {reference:.6f}, merged policy {merged[f'logps/{side}']:.6f}")
        assert reference == pytest.approx(merged[f"logps/{side}"], abs=1e-4)


@pytest.mark.slow
def test_ref_model_adapters_are_merged_onto_the_reference(dpo_steps):
    """``ref_model`` with ``ref_model_adapters`` (a full run, so a separate reference): the
    reference is that model with the adapter merged: its log-probabilities are those of the
    policy of a run that starts from the same merge; both backends."""
    merged = dpo_steps["merged"]
    for name in ("ref_adapters", "ref_adapters_standard"):
        step = dpo_steps[name]
        assert abs(step["rewards/chosen"]) > 1e-3, name  # the policy is the plain base
        for side in ("chosen", "rejected"):
            reference = _reference_logps(step, side)
            print(f"{name} reference logps/{side}: {reference:.6f}, merged policy {merged[f'logps/{side}']:.6f}")
            assert reference == pytest.approx(merged[f"logps/{side}"], abs=1e-4), (name, side)


@pytest.mark.slow
def test_moe_expert_adapters_on_expert_parallel(tmp_path):
    """Adapters on a Qwen3-MoE's experts (peft's target_parameters, experts stacked in one
    factor) on EP2: the first merged into each rank's experts, the second trained on."""
    model = make_model_dir(tmp_path, moe=True)
    merged = _peft_adapter(model, tmp_path / "merged", 2, r=2, lora_alpha=8, target_modules=["o_proj"],
                           target_parameters=["mlp.experts.down_proj"])
    trained = _peft_adapter(model, tmp_path / "trained", 1, r=4, lora_alpha=8, target_modules=["q_proj"],
                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    config = write_config(tmp_path, model, make_sft_data(tmp_path, 64, 1, "train"),
                          finetuning={"finetuning_type": "lora"}, training=ONE_STEP)
    proc = run_ranks(2, [WORKER, tmp_path / "out", config, f"training.output_dir={tmp_path / 'run'}",
                         f"model.adapter_name_or_path={merged},{trained}",
                         "parallel.expert_model_parallel_size=2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    diff = float((_peft_logits(model, [merged], trained) - _ours(tmp_path / "out", vocab)).abs().max())
    print(f"moe ep2: max |ours - peft| = {diff:.3g}")
    assert diff < 1e-5
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["trainable"] == _peft_trainable(model, trained) and result["frozen_unchanged"]


def _peft_trainable(model_dir: Path, trained: Path | None) -> int:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if trained is None:  # the run's defaults: r=8 on every linear
        peft = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    else:
        peft = PeftModel.from_pretrained(model, trained, is_trainable=True)
    return peft.get_nb_trainable_parameters()[0]


CONTINUE = {"learning_rate": 5e-3, "lr_scheduler_type": "constant", "warmup_steps": 0,
            "per_device_train_batch_size": 8, "global_batch_size": 8, "max_steps": 3,
            "save_steps": 3, "logging_steps": 1, "export_hf_dir": "adapter"}
"""8 examples, one micro-batch of 8: every step's batch is the whole dataset."""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 3-step LoRA run (its step-3 checkpoint and its exported adapter) and its resume to
    step 4."""
    root = tmp_path_factory.mktemp("continue")
    model = make_model_dir(root)
    config = write_config(root, model, make_sft_data(root, 8, 3, "train"),
                          finetuning={"finetuning_type": "lora", "lora_rank": 4}, training=CONTINUE)
    proc = run_train(config, root / "first", 1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = rewind(root / "first", root / "resumed", 3)
    proc = run_train(config, resumed, 1, "training.max_steps=4")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout
    return root, config


@pytest.mark.slow
def test_an_exported_adapter_continues_its_run_on_both_backends(exported):
    root, config = exported
    step4 = steps(root / "resumed")[-1]
    assert step4["step"] == 4
    curves = {}
    for backend in ("true", "false"):
        run = root / f"continued_{backend}"
        proc = run_train(config, run, 1, f"model.adapter_name_or_path={root / 'first' / 'adapter'}",
                         f"training.use_mca={backend}", "training.export_hf_dir=null")
        assert proc.returncode == 0, proc.stderr[-4000:]
        curves[backend] = steps(run)
        first = curves[backend][0]
        print(f"use_mca={backend}: step 1 after loading {first['loss']:.7f} / grad_norm "
              f"{first['grad_norm']:.7f}; resumed step 4 {step4['loss']:.7f} / {step4['grad_norm']:.7f}")
        for key in ("loss", "grad_norm"):
            assert first[key] == pytest.approx(step4[key], abs=1e-5), (backend, key)
    # Both backends continue the same curve from the adapter (each with a fresh optimizer).
    for mega, std in zip(curves["true"], curves["false"], strict=True):
        for key in ("loss", "grad_norm"):
            assert mega[key] == pytest.approx(std[key], abs=1e-5), (mega, std)
    assert curves["true"][-1]["loss"] < curves["true"][0]["loss"]  # it trains on


def _tiny_adapter(directory: Path, config: dict | None = None, extra: tuple[str, ...] = ()) -> Path:
    """A PEFT LoRA adapter (q_proj of layer 0, r=2, alpha 4) for the config-only Llama;
    ``config`` adds adapter_config.json keys, ``extra`` more tensors."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], **(config or {})}))
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{name}.lora_A.weight": torch.zeros(2, 64), f"{name}.lora_B.weight": torch.zeros(64, 2)}
    tensors.update({key: torch.zeros(2, 2) for key in extra})
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def _resolve(run: Path, *overrides: str):
    return load_config(run / "run.yaml", ["finetuning_type=lora", *overrides]).resolve(1)


def test_the_adapter_that_trains_on_keeps_its_shape(tmp_path):
    run = config_only_run(tmp_path)
    adapter = _tiny_adapter(run / "adapter", {"lora_dropout": 0.1})
    with (run / "run.yaml").open("a") as yaml_file:  # a relative path: from the file's directory
        yaml_file.write("adapter_name_or_path: adapter\n")
    ft = _resolve(run).finetuning
    assert (ft.lora_rank, ft.lora_alpha, ft.lora_dropout, ft.lora_target) == (2, 4.0, 0.1, ["q_proj"])
    ft = _resolve(run, f"adapter_name_or_path={adapter}", "create_new_adapter=true").finetuning
    assert (ft.lora_rank, ft.lora_alpha, ft.lora_target) == (8, 16.0, ["all"])  # a new adapter: the run's


@pytest.mark.parametrize("make, overrides, message", [
    (None, ["finetuning_type=full"], "model.adapter_name_or_path=['{a}'] with finetuning.finetuning_type="
                                     "'full': adapters load only under LoRA"),
    ("empty", [], "model.adapter_name_or_path entry '{a}' is not a PEFT adapter directory (no "
                  "adapter_config.json or adapter_model.safetensors there)"),
    ({"modules_to_save": ["lm_head"]}, [], "has modules_to_save=['lm_head'], which the Megatron LoRA"),
    ({"use_dora": True}, [], "has use_dora=True"),
    ({"target_modules": ".*q_proj"}, [], "target_modules='.*q_proj' (a regular expression)"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, [], "target_modules=['embed_tokens', 'q_proj'] names "
                                                         "no module of this model: embed_tokens"),
    (("base_model.model.model.embed_tokens.lora_embedding_A",), [],
     "holds tensors outside the decoder layers' linears, which no Megatron LoRA layer holds: "
     "base_model.model.model.embed_tokens.lora_embedding_A"),
    (None, ["lora_rank=16"], "finetuning.lora_rank=16 differs from the adapter that trains on ('{a}': 2)"),
    (None, ["lora_target=q_proj,v_proj"], "finetuning.lora_target=['q_proj', 'v_proj'] differs"),
    (None, ["stage=dpo", "ref_model_adapters={a}"], "finetuning.ref_model_adapters=['{a}'] without "
                                                    "finetuning.ref_model"),
])
def test_what_an_adapter_cannot_be_is_one_line(tmp_path, make, overrides, message):
    run = config_only_run(tmp_path)
    adapter = run / "adapter"
    if make == "empty":
        adapter.mkdir()
    else:
        _tiny_adapter(adapter, make if isinstance(make, dict) else None,
                      make if isinstance(make, tuple) else ())
    with pytest.raises(ConfigError) as err:
        _resolve(run, f"adapter_name_or_path={adapter}", *(o.format(a=adapter) for o in overrides))
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and message.format(a=adapter) in lines[0], lines


def test_merged_adapters_are_part_of_the_base_a_resume_must_match(tmp_path):
    """A LoRA checkpoint holds only the adapter that trains; the adapters merged into the base
    join its fingerprint, so a resume over other merged adapters is refused in one line."""
    from hpc_mca.checkpoint.compat import incompatibilities
    from hpc_mca.checkpoint.store import CheckpointInfo
    from hpc_mca.config.sections import FinetuningArguments
    from hpc_mca.models.converters import converter_for

    model = make_model_dir(tmp_path)
    one, two = _tiny_adapter(tmp_path / "one"), _tiny_adapter(tmp_path / "two", {"r": 2, "lora_alpha": 8})
    ft = FinetuningArguments(finetuning_type="lora")
    plain = converter_for(ft).resume_record(str(model))
    trained_on = converter_for(ft, [str(one)]).resume_record(str(model))  # nothing merged
    assert trained_on == plain
    merged = converter_for(ft, [str(one), str(two)]).resume_record(str(model))
    other = converter_for(ft, [str(two), str(one)]).resume_record(str(model))
    new = converter_for(FinetuningArguments(finetuning_type="lora", create_new_adapter=True),
                        [str(one), str(two)]).resume_record(str(model))  # both merged
    fingerprints = {r["base_model"]["fingerprint"] for r in (plain, merged, other, new)}
    assert len(fingerprints) == 4
    info = CheckpointInfo(step=3, consumed_samples=24, training=merged)
    reasons = incompatibilities(info, {}, {}, other)
    assert len(reasons) == 1 and "has other weights than the base model" in reasons[0]
    assert not incompatibilities(info, {}, {}, merged)
