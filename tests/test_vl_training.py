"""Vision-language training (issue #63) on the bundled demo (hpc_mca/assets/demo_vl: a tiny
Qwen2-VL, 240 questions about 24 drawn images): a 20-step LoRA sft learns on CPU ranks on both
backends, packed rows give the unpacked step-1 loss, a run resumed from its checkpoint
continues the uninterrupted curve, and ``freeze_vision_tower``/``freeze_multi_modal_projector``/
``freeze_language_model`` decide which parts of the model change (the HF export against the
weights it started from), as LLaMA-Factory's full fine-tuning does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from trainer_fixtures import rewind, same_curve, steps
from vl_fixtures import DEMO, LORA, demo_model_dir, train, write_config

from hpc_mca.config.loading import load_config
from hpc_mca.config.sections import ConfigError


def _weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    tensors: dict = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return demo_model_dir(tmp_path_factory.mktemp("vl_model"))


def _config(root: Path, model_dir: Path, **settings: object) -> Path:
    config = {
        "model_name_or_path": str(model_dir), "stage": "sft", "template": "qwen2_vl",
        "dataset": "shapes", "dataset_dir": str(DEMO / "data"), "cutoff_len": 256,
        "seq_length": 256, "sequence_packing": True, "per_device_train_batch_size": 2,
        "global_batch_size": 4, "learning_rate": 5e-3, "lr_scheduler_type": "constant",
        "max_steps": 20, "logging_steps": 1, "seed": 11, "output_dir": str(root / "run"),
        **settings,
    }
    return write_config(root, config)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["megatron", "standard"])
def test_a_20_step_lora_sft_learns_the_demo_images(tmp_path, model_dir, backend):
    config = _config(tmp_path, model_dir, **LORA, use_mca=backend == "megatron")
    curve = train(config, tmp_path / "run", 2)
    first, last = curve[0]["loss"], sum(s["loss"] for s in curve[-5:]) / 5
    assert len(curve) == 20 and last < first - 0.5, (first, last)
    assert (tmp_path / "run" / "adapter_config.json").is_file()


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory, model_dir) -> dict[tuple[str, str], Path]:
    """One-step LoRA runs (one rank) of each backend over the same eight samples (10 images):
    packed into one row of 1024 slots, or one sample per row. Their run dirs."""
    root = tmp_path_factory.mktemp("vl_first")
    config = _config(root, model_dir, **LORA, max_steps=1, max_samples=8, seq_length=1024)
    batch = {"packed": 1, "rows": 8}
    runs = {}
    for backend in ("megatron", "standard"):
        for mode in ("packed", "rows"):
            run = runs[backend, mode] = root / f"{backend}_{mode}"
            train(config, run, 1, f"training.use_mca={backend == 'megatron'}",
                   f"data.sequence_packing={mode == 'packed'}",
                   f"training.per_device_train_batch_size={batch[mode]}",
                   f"training.global_batch_size={batch[mode]}")
    return runs


@pytest.mark.slow
def test_both_backends_and_packing_give_the_same_first_step(first_steps):
    """The standard backend (transformers' Qwen2-VL, packed attention, M-RoPE rows under the
    text positions) gives the Megatron backend's step-1 loss and gradient norm, and on each
    backend the packed row gives the rows' loss (the same samples, images and answer tokens)."""
    first = {key: steps(run)[0] for key, run in first_steps.items()}
    for mode in ("packed", "rows"):
        megatron, standard = first["megatron", mode], first["standard", mode]
        assert standard["tokens"] == megatron["tokens"], mode
        assert standard["loss"] == pytest.approx(megatron["loss"], abs=1e-5), mode
        assert standard["grad_norm"] == pytest.approx(megatron["grad_norm"], abs=1e-5), mode
    for backend in ("megatron", "standard"):
        packed, rows = first[backend, "packed"], first[backend, "rows"]
        assert packed["tokens"] == rows["tokens"], backend
        assert packed["loss"] == pytest.approx(rows["loss"], abs=1e-5), backend


@pytest.mark.slow
def test_lora_adapts_the_linears_llamafactory_adapts_on_both_backends(first_steps, model_dir):
    """lora_target all on a VL model: LLaMA-Factory's rule (the language model's linears; never
    the merger, not the frozen tower) applied to transformers' model gives the trainable count
    of both backends' PEFT adapters, which hold the same tensors under the same names and load
    into transformers' model with peft."""
    import torch
    from lf_peer import lf_lora_targets
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir)
    targets = lf_lora_targets(model)
    assert targets and not [name for name in targets if "visual" in name]
    rule = get_peft_model(model, LoraConfig(r=8, target_modules=targets)).get_nb_trainable_parameters()[0]
    adapters = {backend: _weights(first_steps[backend, "packed"])
                for backend in ("megatron", "standard")}
    assert set(adapters["megatron"]) == set(adapters["standard"])
    for backend, tensors in adapters.items():
        assert sum(t.numel() for t in tensors.values()) == rule == 16384, backend
        loaded = PeftModel.from_pretrained(Qwen2VLForConditionalGeneration.from_pretrained(model_dir),
                                           first_steps[backend, "packed"])
        state = {name: param for name, param in loaded.named_parameters()
                 if "lora_" in name}
        assert {name.replace(".default", "") for name in state} == set(tensors), backend
        assert all(torch.equal(state[name], tensors[name.replace(".default", "")])
                   for name in state), backend


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["megatron", "standard"])
def test_a_resumed_run_continues_the_uninterrupted_curve(tmp_path, model_dir, backend):
    config = _config(tmp_path, model_dir, finetuning_type="full", max_steps=4, save_steps=2,
                     learning_rate=1e-3, freeze_vision_tower=False, use_mca=backend == "megatron")
    whole = train(config, tmp_path / "whole", 2)
    resumed = rewind(tmp_path / "whole", tmp_path / "resumed", 2)
    (resumed / "steps.jsonl").write_text("".join(
        line + "\n" for line in (resumed / "steps.jsonl").read_text().splitlines()[:2]))
    same_curve(train(config, resumed, 2), whole, 0.0, "resumed at step 2")


FREEZE_CASES = {
    # settings: (vision tower changes, merger changes, language model changes)
    "defaults": ({}, (False, False, True)),
    "tower": ({"freeze_vision_tower": False}, (True, False, True)),
    "vision_only": ({"freeze_vision_tower": False, "freeze_multi_modal_projector": False,
                     "freeze_language_model": True}, (True, True, False)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case,backend", [*((case, "megatron") for case in FREEZE_CASES),
                                          ("tower", "standard")])
def test_the_freeze_settings_decide_which_parts_train(tmp_path, model_dir, case, backend):
    settings, (tower, merger, language) = FREEZE_CASES[case]
    config = _config(tmp_path, model_dir, finetuning_type="full", max_steps=2,
                     export_hf_dir=str(tmp_path / "export"), use_mca=backend == "megatron",
                     **settings)
    train(config, tmp_path / "run", 1)
    before, after = _weights(model_dir), _weights(tmp_path / "export")
    assert set(before) == set(after)
    changed = {name for name in before if not before[name].equal(after[name])}
    parts = {
        "tower": [n for n in before if n.startswith(("visual.patch_embed", "visual.blocks",
                                                     "model.visual.patch_embed", "model.visual.blocks"))],
        "merger": [n for n in before if "visual.merger" in n],
        "language": [n for n in before if "visual" not in n],
    }
    for part, trains in zip(parts, (tower, merger, language)):
        assert parts[part], part
        moved = [n for n in parts[part] if n in changed]
        assert (len(moved) == len(parts[part])) if trains else not moved, (part, moved[:3])


@pytest.mark.parametrize("settings,words", [
    ({"finetuning_type": "lora", "freeze_vision_tower": False}, "finetuning.freeze_vision_tower=False"),
    ({"freeze_language_model": True}, "nothing would train"),
])
def test_vl_freeze_settings_outside_full_or_training_nothing_are_refused(tmp_path, model_dir, settings, words):
    with pytest.raises(ConfigError, match=words):
        load_config(_config(tmp_path, model_dir, **settings)).resolve(1)


def test_vl_freeze_settings_on_a_text_model_are_refused(tmp_path):
    text = Path(__file__).resolve().parent.parent / "hpc_mca" / "assets" / "demo"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": str(text), "dataset": str(text / "train.jsonl"),
                                      "dataset_format": "alpaca", "template": "chat",
                                      "freeze_multi_modal_projector": False,
                                      "output_dir": str(tmp_path / "run")}))
    with pytest.raises(ConfigError, match="has no vision tower"):
        load_config(config).resolve(1)


def test_ulysses_with_a_vl_model_on_the_standard_backend_is_refused(tmp_path, model_dir):
    config = _config(tmp_path, model_dir, **LORA, use_mca=False, sequence_parallel_size=2)
    with pytest.raises(ConfigError) as err:
        load_config(config).resolve(2)
    assert "parallel.sequence_parallel_size=2 with a vision-language model" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def qwen3_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-VL (the demo's language model with qk-norm and interleaved mrope, a tower of
    16-pixel patches whose two deepstack sets join both decoder layers) over the demo's tokenizer,
    with a Qwen3-VL image processor; random weights written out as transformers 5 saves them."""
    import json

    import torch
    from transformers import AutoConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    root = tmp_path_factory.mktemp("qwen3_vl_model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, root / name)
    processor = {**json.loads((DEMO / "preprocessor_config.json").read_text()), "patch_size": 16,
                 "processor_class": "Qwen3VLProcessor"}
    (root / "preprocessor_config.json").write_text(json.dumps(processor))
    demo = AutoConfig.from_pretrained(DEMO)
    text = {**demo.text_config.to_dict(), "head_dim": 16}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
              "out_hidden_size": 64, "patch_size": 16, "num_position_embeddings": 16,
              "deepstack_visual_indexes": [0, 1]}
    tokens = {key: getattr(demo, key) for key in ("image_token_id", "video_token_id",
                                                  "vision_start_token_id", "vision_end_token_id")}
    torch.manual_seed(3)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision,
                                                          tie_word_embeddings=False, **tokens))
    model.save_pretrained(root)
    return root


@pytest.mark.slow
def test_qwen3_vl_first_step_is_the_same_on_both_backends(tmp_path, qwen3_model_dir):
    """Full fine-tuning with the tower training (its deepstack mergers too), one packed row of
    eight samples: transformers' Qwen3-VL on the standard backend gives the Megatron backend's
    step-1 loss and gradient norm."""
    config = _config(tmp_path, qwen3_model_dir, template="qwen3_vl", finetuning_type="full",
                     freeze_vision_tower=False, max_steps=1, max_samples=8, seq_length=1024,
                     per_device_train_batch_size=1, global_batch_size=1)
    first = {backend: train(config, tmp_path / backend, 1,
                             f"training.use_mca={backend == 'megatron'}")[0]
             for backend in ("megatron", "standard")}
    assert first["standard"]["tokens"] == first["megatron"]["tokens"]
    assert first["standard"]["loss"] == pytest.approx(first["megatron"]["loss"], abs=1e-5)
    assert first["standard"]["grad_norm"] == pytest.approx(first["megatron"]["grad_norm"], abs=1e-5)
    print(f"qwen3_vl step 1: {first}")
