"""Vision-language models (qwen2_vl, qwen2_5_vl, qwen3_vl) on Megatron against transformers, with real
ranks: logits equal transformers' at TP1, TP2 (also with sequence parallelism) and PP2; the two
rows packed into one THD stream equal the rows run apart; the export loads in transformers'
own class with the same logits and round-trips every tensor; the vision tower's gradients on
TP2 equal one process's.

Tiny random models (text: 2 layers, hidden 64, vocab 200; vision: depth 2, patch 14, merge 2;
qwen3_vl: 4 layers with qk-norm, interleaved mrope, deepstack sets added after layers 0 and 1)
made with transformers' config classes and ``save_pretrained``; every weight is randomised. The
batch holds 3 images of 3 sizes in 2 rows (two in the first row), so the features' row-major
order across rows is exercised; mrope positions come from transformers' ``get_rope_index``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from trainer_fixtures import run_jobs

WORKER = Path(__file__).with_name("vl_models_worker.py")
TOL = 1e-5

TEXT = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3]})
TOKENS = dict(image_token_id=190, video_token_id=191, vision_start_token_id=192,
              vision_end_token_id=193)
VISION = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
FAMILIES = {
    # name: (config class, vision config, tie_word_embeddings, text config changes)
    "qwen2_vl": ("Qwen2VLConfig", dict(VISION, embed_dim=32, hidden_size=64), False, {}),
    # windowed attention in block 0 (window 56 px = 2 merged tokens), full in block 1
    "qwen2_5_vl": ("Qwen2_5_VLConfig", dict(VISION, hidden_size=32, intermediate_size=48,
                                            out_hidden_size=64, window_size=56,
                                            fullatt_block_indexes=[1]), True, {}),
    # two deepstack sets (after blocks 0 and 1) join decoder layers 0 and 1: PP2's first stage
    # holds both
    "qwen3_vl": ("Qwen3VLConfig", dict(VISION, hidden_size=32, intermediate_size=48,
                                       out_hidden_size=64, num_position_embeddings=16,
                                       deepstack_visual_indexes=[0, 1]), False,
                 dict(num_hidden_layers=4, head_dim=16, rope_parameters={
                     **TEXT["rope_parameters"], "mrope_interleaved": True})),
}
GRIDS = [[1, 4, 6], [1, 2, 4], [1, 4, 4]]  # 6, 2 and 4 image tokens
SINGLE_JOBS = [{"name": "tp1", "layout": {}, "models": list(FAMILIES), "packed": True,
                "export": True, "grads": True}]
TORCHRUN_JOBS = [
    {"name": "tp2", "layout": {"tp": 2}, "models": list(FAMILIES), "export": True, "grads": True},
    {"name": "tp2sp", "layout": {"tp": 2}, "models": list(FAMILIES),
     "overrides": {"sequence_parallel": True}},
    {"name": "pp2", "layout": {"pp": 2}, "models": list(FAMILIES), "export": True, "packed": True},
]


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm = any(part in name for part in ("norm", "ln_q")) and name.endswith("weight")
            param.copy_(1.0 + 0.2 * noise if is_norm else 0.1 * noise)


def _inputs(model) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    grids = torch.tensor(GRIDS)

    def text(n: int) -> torch.Tensor:
        return torch.randint(0, 180, (n,), generator=gen)

    def image(i: int) -> torch.Tensor:
        tokens = int(grids[i].prod()) // 4
        return torch.tensor([TOKENS["vision_start_token_id"]] + [TOKENS["image_token_id"]] * tokens
                            + [TOKENS["vision_end_token_id"]])

    rows = [torch.cat([text(2), image(0), text(2), image(1), text(4)]),
            torch.cat([text(3), image(2), text(11)])]
    ids = torch.stack(rows)
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 14 * 14, generator=gen)
    positions, _ = model.model.get_rope_index(ids, (ids == TOKENS["image_token_id"]).int(), grids)
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grids,
            "position_ids": positions}


def _hf_logits(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = inputs["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=inputs["pixel_values"],
                     image_grid_thw=inputs["image_grid_thw"],
                     mm_token_type_ids=(ids == TOKENS["image_token_id"]).int()).logits


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """HF directories, ``inputs.pt`` and transformers' logits ``<name>.ref.pt``."""
    import transformers

    root = tmp_path_factory.mktemp("hf_vl")
    for seed, (name, (config_class, vision, tie, text)) in enumerate(FAMILIES.items()):
        config = getattr(transformers, config_class)(text_config={**TEXT, **text},
                                                     vision_config=vision,
                                                     tie_word_embeddings=tie, **TOKENS)
        torch.manual_seed(seed)
        model = transformers.AutoModelForImageTextToText.from_config(config)
        _randomise(model, seed)
        model.save_pretrained(root / name)
        hf = transformers.AutoModelForImageTextToText.from_pretrained(root / name,
                                                                       dtype=torch.float32)
        inputs = _inputs(hf)
        if seed == 0:
            torch.save(inputs, root / "inputs.pt")
        torch.save(_hf_logits(hf, inputs), root / f"{name}.ref.pt")
    return root


@pytest.fixture(scope="module")
def single(models, tmp_path_factory) -> Path:
    return run_jobs(WORKER, models, tmp_path_factory.mktemp("vl_single"), SINGLE_JOBS, 1)


@pytest.fixture(scope="module")
def ranks2(models, tmp_path_factory) -> Path:
    return run_jobs(WORKER, models, tmp_path_factory.mktemp("vl_ranks2"), TORCHRUN_JOBS, 2)


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got.float() - want.float()).abs().max().item()


def _record(request, key: str, value: float) -> None:
    """Figures for the report: ``-rA --junitxml`` or the terminal summary shows them."""
    request.node.user_properties.append((key, value))
    print(f"{request.node.name} {key}={value:.3g}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp1_logits_match_transformers(request, models, single, family):
    diff = _max_diff(torch.load(single / "tp1" / f"{family}.logits.pt"),
                     torch.load(models / f"{family}.ref.pt"))
    _record(request, "max_abs_diff", diff)
    assert diff < TOL


def test_the_images_decide_the_logits(models):
    """The reference itself depends on the pixels and on the mrope rows (so equal logits are
    no accident of features that change nothing)."""
    import transformers

    hf = transformers.AutoModelForImageTextToText.from_pretrained(models / "qwen2_vl")
    inputs = torch.load(models / "inputs.pt")
    ref = torch.load(models / "qwen2_vl.ref.pt")
    assert _max_diff(_hf_logits(hf, {**inputs, "pixel_values": inputs["pixel_values"] * 0.5}),
                     ref) > 0.05


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_rows_equal_the_rows_apart(request, models, single, family):
    """One THD stream of both rows (each row's mrope positions as they are), without and with
    padding slots between the documents, against the unpacked batch."""
    unpacked = torch.load(single / "tp1" / f"{family}.logits.pt")
    packed, padded = torch.load(single / "tp1" / f"{family}.packed.pt")
    diffs = _max_diff(packed, unpacked), _max_diff(padded, unpacked)
    _record(request, "packed_diff", max(diffs))
    assert max(diffs) < TOL


def _read(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _assert_export(models: Path, export: Path, family: str) -> None:
    import transformers

    original, exported = _read(models / family), _read(export)
    assert sorted(exported) == sorted(original)
    assert [n for n in original if not torch.equal(original[n], exported[n])] == []
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == family and config["tie_word_embeddings"] == FAMILIES[family][2]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
    assert type(hf).__name__ == json.loads((models / family / "config.json").read_text())[
        "architectures"][0]
    logits = _hf_logits(hf, torch.load(models / "inputs.pt"))
    assert torch.equal(logits, torch.load(models / f"{family}.ref.pt"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp1_export_loads_in_transformers_with_the_same_logits(models, single, family):
    _assert_export(models, single / "tp1" / f"{family}.export", family)


MULTI = [(job["name"], family) for job in TORCHRUN_JOBS for family in job["models"]]


@pytest.mark.slow
@pytest.mark.parametrize("job,family", MULTI, ids=[f"{j}-{f}" for j, f in MULTI])
def test_multi_rank_logits_match_transformers(request, models, ranks2, job, family):
    diff = _max_diff(torch.load(ranks2 / job / f"{family}.logits.pt"),
                     torch.load(models / f"{family}.ref.pt"))
    _record(request, "max_abs_diff", diff)
    assert diff < TOL


EXPORTS = [(job["name"], f) for job in TORCHRUN_JOBS if job.get("export") for f in job["models"]]


@pytest.mark.slow
@pytest.mark.parametrize("job,family", EXPORTS, ids=[f"{j}-{f}" for j, f in EXPORTS])
def test_multi_rank_export_loads_in_transformers_with_the_same_logits(models, ranks2, job, family):
    _assert_export(models, ranks2 / job / f"{family}.export", family)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_pp2_packed_rows_equal_the_rows_apart(models, ranks2, single, family):
    packed, padded = torch.load(ranks2 / "pp2" / f"{family}.packed.pt")
    unpacked = torch.load(single / "tp1" / f"{family}.logits.pt")
    assert max(_max_diff(packed, unpacked), _max_diff(padded, unpacked)) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_vision_tower_gradients_on_tp2_equal_one_process(request, single, ranks2, family):
    """The tower is whole on each TP rank; its gradients (through the replaced embeddings and
    TP-split layers) equal one process's on every rank that holds them."""
    one = torch.load(single / "tp1" / f"{family}.grads.pt")
    two = torch.load(ranks2 / "tp2" / f"{family}.grads.pt")
    assert sorted(one) == sorted(two) and len(one) > 10
    # relative to each tensor's largest gradient (the summed loss makes them large: ~10)
    diff = max(_max_diff(two[name], one[name]) / one[name].abs().max().item() for name in one)
    _record(request, "grad_rel_diff", diff)
    assert diff < 1e-5


# --- config, planner and refusals (one process, no ranks) -------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_spec_and_planner_sizes_of_a_vl_config(models, family):
    """The language model reads as qwen2's (q/k/v biases; qwen3_vl: qwen3's qk-norm, interleaved
    mrope, two deepstack layers) with the mrope sections; the planner counts the vision tower as
    transformers builds it (its tensors in the saved file, nested under ``model.`` for
    qwen3_vl)."""
    import math

    from safetensors import safe_open

    from hpc_mca.models.hf_config import read_hf_config
    from hpc_mca.topology.model import ModelShape

    spec = read_hf_config(models / family)
    qwen3 = family == "qwen3_vl"
    assert (spec.qkv_bias, spec.qk_norm, spec.mrope_section, spec.num_layers) == \
        (not qwen3, qwen3, (2, 3, 3), 4 if qwen3 else 2)
    assert spec.tie_word_embeddings == FAMILIES[family][2]
    assert spec.vision is not None and spec.vision.deepstack_layers == (2 if qwen3 else 0)
    assert spec.mrope_interleaved == qwen3
    prefix = "model.visual." if qwen3 else "visual."
    with safe_open(str(models / family / "model.safetensors"), "pt") as handle:
        tower = {"visual." + name.removeprefix(prefix): tuple(handle.get_slice(name).get_shape())
                 for name in handle.keys() if name.startswith(prefix)}
    assert spec.vision.shapes() == tower
    shape = ModelShape.from_hf_config(models / family)
    assert shape.vision_params == sum(math.prod(s) for s in tower.values())
    assert shape.tie_word_embeddings == FAMILIES[family][2]


def _config(models: Path, family: str, **changes) -> dict:
    raw = json.loads((models / family / "config.json").read_text())
    return {**raw, **changes}


def test_unbuilt_vl_families_and_options_are_refused_in_one_line(models):
    from hpc_mca.models.errors import ModelLoadError
    from hpc_mca.models.hf_config import read_hf_config

    text = _config(models, "qwen2_vl")["text_config"]
    cases = {
        "qwen3_vl_moe": ({"model_type": "qwen3_vl_moe"}, "mixture-of-experts Qwen3-VL"),
        "yarn": ({"text_config": {**text, "rope_parameters": {
            "rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3]}}}, "rope type 'yarn'"),
        "sections": ({"text_config": {**text, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]}}},
            "mrope_section [2, 2, 2]"),
    }
    for case, (changes, words) in cases.items():
        with pytest.raises(ModelLoadError) as err:
            read_hf_config(_config(models, "qwen2_vl", **changes))
        assert words in str(err.value) and "\n" not in str(err.value), case


@pytest.mark.parametrize("layout,overrides,words", [
    ({"cp": 2}, {}, "context parallelism (cp=2)"),
    ({}, {"mtp_num_layers": 1}, "MTP layers (mtp_num_layers=1)"),
    ({}, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
     "recompute_granularity='full' is not supported"),
])
def test_vl_with_context_parallel_or_mtp_is_refused_before_building(models, layout, overrides,
                                                                    words):
    from types import SimpleNamespace

    from hpc_mca.models.build import build_model
    from hpc_mca.models.errors import ModelLoadError
    from hpc_mca.topology import Layout

    ctx = SimpleNamespace(layout=Layout(**layout), env=SimpleNamespace(world_size=2),
                          device=torch.device("cpu"), backend="gloo", seed=0)
    with pytest.raises(ModelLoadError, match=words.replace("(", r"\(").replace(")", r"\)")):
        build_model(models / "qwen2_vl", ctx, config_overrides=overrides, load_weights=False)


@pytest.mark.parametrize("layout,overrides,words", [
    ({"pp": 4}, {}, "adds deepstack features to its first 2 decoder layers, but the first "
                    "pipeline stage holds 1"),
    ({}, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
     "recompute_granularity='full' is not supported"),
])
def test_qwen3_vl_deepstack_outside_the_first_stage_or_with_full_recompute_is_refused(
        models, layout, overrides, words):
    from types import SimpleNamespace

    from hpc_mca.models.build import build_model
    from hpc_mca.models.errors import ModelLoadError
    from hpc_mca.topology import Layout

    ctx = SimpleNamespace(layout=Layout(**layout), env=SimpleNamespace(world_size=4),
                          device=torch.device("cpu"), backend="gloo", seed=0)
    with pytest.raises(ModelLoadError) as err:
        build_model(models / "qwen3_vl", ctx, config_overrides=overrides, load_weights=False)
    assert words in str(err.value) and "\n" not in str(err.value)
