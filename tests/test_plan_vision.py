"""The planner's vision-tower activations (issue #63, topology/vision.py): what transformers'
own Qwen2-VL and Qwen2.5-VL vision modules keep for their backward (every saved tensor's
storage, parameters left out, measured with saved-tensor hooks on a bf16 forward on the CPU)
equals the planner's bytes within 15% for what trains; an image of ``image_max_pixels``
becomes as many patches as transformers' smart_resize gives; and a plan of Qwen2-VL-7B shows
the term (in the first stage's activations and the report) when the tower trains, and none
when it is frozen, LLaMA-Factory's default."""

from __future__ import annotations

import math

import pytest
import torch

from hpc_mca.topology.layout import Layout
from hpc_mca.topology.planner import plan
from hpc_mca.topology.report import format_plan_table
from hpc_mca.topology.vision import vision_shape

TINY = {
    "qwen2_vl": {"depth": 2, "embed_dim": 64, "hidden_size": 96, "num_heads": 4, "mlp_ratio": 4},
    "qwen2_5_vl": {"depth": 4, "hidden_size": 64, "out_hidden_size": 96, "num_heads": 4,
                   "intermediate_size": 120, "window_size": 56, "fullatt_block_indexes": [1, 3]},
}
# Qwen2-VL-7B-Instruct's config.json: the language model and its vision_config.
QWEN2_VL_7B = {
    "model_type": "qwen2_vl", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "tie_word_embeddings": False, "_name_or_path": "Qwen2-VL-7B",
    "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4,
                      "num_heads": 16, "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "hidden_act": "quick_gelu"},
}


def _tower(family: str) -> torch.nn.Module:
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig as Config
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Tower
    else:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as Tower
    config = Config(**TINY[family])
    config._attn_implementation = "sdpa"  # as the trainer builds it (models/vl_config.py)
    torch.manual_seed(0)
    return Tower(config).to(torch.bfloat16)


def _saved_bytes(tower: torch.nn.Module, trains: frozenset[str], grids: list[list[int]]) -> int:
    """Bytes of the distinct storages the forward saves for backward, parameters left out."""
    for name, param in tower.named_parameters():
        part = "projector" if name.startswith("merger.") else "tower"
        param.requires_grad_(part in trains)
    params = {p.untyped_storage().data_ptr() for p in tower.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    patches = sum(math.prod(g) for g in grids)
    pixels = torch.randn(patches, 3 * 2 * 14 * 14, dtype=torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = tower(pixels, grid_thw=torch.tensor(grids)).pooler_output
    if out.requires_grad:  # the measurement is the one a backward would use
        out.float().sum().backward()
    return sum(saved.values())


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("trains", [{"tower", "projector"}, {"tower"}, {"projector"}, set()])
def test_the_planners_bytes_match_what_transformers_tower_saves(family, trains):
    vision = vision_shape({"model_type": family, "vision_config": TINY[family]})
    assert vision is not None
    max_pixels = 224 * 224  # 16 × 16 patches
    patches = vision.image_patches(max_pixels)
    side = math.isqrt(patches)
    grids = [[1, side, side]] * 2  # two images in one forward
    measured = _saved_bytes(_tower(family), frozenset(trains), grids)
    planned = 2 * patches * vision.saved_bytes_per_patch(frozenset(trains), 2)
    assert patches == 256
    if not trains:
        assert measured == planned == 0
    else:
        assert planned == pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize("max_pixels", [768 * 768, 200 * 200, 1280 * 28 * 28, 3136, 1000 * 1000])
def test_patches_per_image_follow_the_image_processors_resize(max_pixels):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    vision = vision_shape(QWEN2_VL_7B)
    assert vision is not None
    side = math.isqrt(max_pixels)
    height, width = smart_resize(side, side, factor=28, min_pixels=28 * 28, max_pixels=max_pixels)
    assert vision.image_patches(max_pixels) == (height // 14) * (width // 14)


def test_a_plan_of_qwen2_vl_7b_shows_the_vision_towers_activations():
    request = {"model": QWEN2_VL_7B, "nodes": 1, "seq_length": 4096, "global_batch_size": 32,
               "stage": "sft", "gpu": "H100-80GB", "micro_batch_size": 1, "layout": Layout(tp=4)}
    frozen = plan(**request)
    trained = plan(**request, vision_trains=frozenset({"tower", "projector"}))
    vision = vision_shape(QWEN2_VL_7B)
    assert vision is not None
    # 589824 px → 54 × 54 patches, 729 tokens; 5 images fit a 4096-token row.
    assert vision.image_patches(589824) == 2916
    per_patch = vision.saved_bytes_per_patch(frozenset({"tower", "projector"}), 2)
    assert 1.8e6 < per_patch < 2.0e6  # 32 blocks × (11·1280 + 3·5120) · 2 B, and the rest
    first = trained.memory  # PP1: the first stage is the only one
    assert frozen.memory.vision_activations == 0
    assert first.vision_activations == 5 * 2916 * per_patch
    assert first.activations > first.vision_activations > 20 * 2 ** 30
    table = format_plan_table(trained)
    assert "images of 589824 px: 2916 patches, 729 tokens each, up to 5 a row" in table
    assert f"{first.vision_activations / 2 ** 30:.1f} GiB of activations on the first stage" in table
    assert "tower and projector frozen: no activations kept" in format_plan_table(frozen)
