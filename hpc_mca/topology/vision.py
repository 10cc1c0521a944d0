"""The vision tower of a vision-language model (qwen2_vl, qwen2_5_vl, qwen3_vl) in the planner.

Its parameters sit whole on every TP rank of the first pipeline stage (params.py counts them
there). Its activations are sized here: what the tower's forward keeps for its backward for the
images of one micro-batch, counted tensor by tensor from transformers' vision modules as the
trainer builds them (sdpa attention, a fused kernel that keeps no score matrix), per patch:

* the patch embedding keeps its input pixels (C·T·P² values a patch) for its weight gradient;
* a block keeps its norms' tensors (Qwen2-VL's LayerNorm: its input; Qwen2.5-VL's RMSNorm: an
  fp32 copy of its input and its input-dtype product before the weight), the QKV input, the
  QKV output (the value is a view of it), the rotated query and key, the attention output and
  its fp32 log-sum-exp per head, the output projection's input, and the MLP's tensors:
  Qwen2-VL's quick-GELU keeps fc1's output, its sigmoid and fc2's input; Qwen2.5-VL's gated
  SiLU the gate and up outputs, the SiLU output and the down projection's input. Window
  attention (Qwen2.5-VL) keeps the same per token as full attention under a fused kernel;
* the rotary cos and sin (fp32, head_dim wide) once for all blocks;
* the merger keeps its norm's tensors, the GELU input and output (its fc1's input is the
  norm's output).

What is kept depends on what trains (``finetuning.freeze_vision_tower`` and
``freeze_multi_modal_projector``, LLaMA-Factory's defaults: both frozen): with the tower
frozen nothing upstream of it needs a gradient, so its blocks keep nothing and only a training
merger keeps its own tensors; a frozen tower's forward is transient (one block's tensors at a
time, less than the micro-batch's own layer activations that follow it), so it never sets the
stage's peak. A frozen merger under a training tower keeps what its input gradient needs: its
norm's statistics input and the GELU input; a training merger under a frozen tower keeps of an
RMSNorm only the product its weight's gradient reads.

The images of a micro-batch are bounded by its token budget: an image of ``image_max_pixels``
pixels (square: LLaMA-Factory scales larger images down to that many, keeping their aspect)
becomes, after the image processor's rounding of each side to whole merged patches,
``patches`` patches and ``patches / merge²`` image tokens, and a row of ``seq_length`` tokens
holds at most ``seq_length // tokens`` of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_IMAGE_MAX_PIXELS = 768 * 768
"""LLaMA-Factory's ``image_max_pixels`` default (data.image_max_pixels)."""
VISION_PARTS = ("tower", "projector")
"""What of the vision side may train: the patch embedding and blocks, and the merger."""

_DEFAULTS: dict[str, dict[str, Any]] = {
    # transformers' Qwen2VLVisionConfig / Qwen2_5_VLVisionConfig defaults
    "qwen2_vl": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4,
                 "num_heads": 16, "in_channels": 3, "patch_size": 14, "temporal_patch_size": 2,
                 "spatial_merge_size": 2, "hidden_act": "quick_gelu"},
    "qwen2_5_vl": {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420,
                   "out_hidden_size": 3584, "num_heads": 16, "in_channels": 3, "patch_size": 14,
                   "temporal_patch_size": 2, "spatial_merge_size": 2, "hidden_act": "silu"},
    # transformers' Qwen3VLVisionConfig defaults
    "qwen3_vl": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                 "out_hidden_size": 3584, "num_heads": 16, "in_channels": 3, "patch_size": 16,
                 "temporal_patch_size": 2, "spatial_merge_size": 2,
                 "hidden_act": "gelu_pytorch_tanh", "num_position_embeddings": 2304,
                 "deepstack_visual_indexes": [8, 16, 24]},
}


@dataclass(frozen=True)
class VisionShape:
    """Sizes of a Qwen2-VL / Qwen2.5-VL vision tower."""

    family: str
    """qwen2_vl (LayerNorm, a two-matrix MLP) or qwen2_5_vl (RMSNorm, a gated MLP)."""
    depth: int
    width: int
    """The blocks' width (Qwen2-VL ``embed_dim``, Qwen2.5-VL ``hidden_size``)."""
    heads: int
    mlp_width: int
    """Qwen2-VL ``embed_dim · mlp_ratio``; Qwen2.5-VL ``intermediate_size``."""
    out_width: int
    """The merger's output: the language model's hidden size."""
    channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    quick_gelu: bool
    """Qwen2-VL's default activation, which keeps its sigmoid too."""
    position_embeddings: int = 0
    """Qwen3-VL: learned position embeddings (rows of ``width``)."""
    deepstack: int = 0
    """Qwen3-VL: deepstack levels, each a merger of its own (normed after the patches merge)
    whose features are added to an early decoder layer."""

    @property
    def rms_norm(self) -> bool:
        return self.family == "qwen2_5_vl"

    @property
    def patch_values(self) -> int:
        """Pixel values of one patch (C·T·P²), the patch embedding's input width."""
        return self.channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def params(self) -> int:
        """A patch convolution (a bias on Qwen3-VL's), ``depth`` blocks (two norms, qkv and
        output projections and an MLP, all with biases) and the merger (a norm and a two-layer
        MLP over merge² patches); Qwen3-VL adds its position embeddings and one merger per
        deepstack level."""
        e, f, out, merge = self.width, self.mlp_width, self.out_width, self.merge_size ** 2
        norm = 1 if self.rms_norm else 2
        mlp = 3 * e * f + 2 * f + e if self.family == "qwen2_5_vl" else 2 * e * f + f + e
        block = 2 * norm * e + 4 * e * e + 4 * e + mlp
        projection = (e * merge) ** 2 + e * merge + e * merge * out + out
        merger = norm * e + projection
        tower = e * self.patch_values + self.depth * block + merger
        if self.family == "qwen3_vl":
            tower += e + self.position_embeddings * e + self.deepstack * (norm * e * merge + projection)
        return tower

    def image_patches(self, max_pixels: int) -> int:
        """Patches of a square image of ``max_pixels`` pixels after the image processor's
        resize: each side rounded to whole merged patches (at least one), scaled down a step
        where rounding up overshoots ``max_pixels``."""
        factor = self.patch_size * self.merge_size
        side = math.sqrt(max_pixels)
        units = max(1, round(side / factor))
        if (units * factor) ** 2 > max_pixels:
            units = max(1, math.floor(side / factor))
        return (units * self.merge_size) ** 2

    def saved_bytes_per_patch(self, trains: frozenset[str], element: int) -> int:
        """Bytes one patch keeps for the backward, ``element`` bytes a value (fp32 statistics
        4), with ``trains`` (a subset of VISION_PARTS) training."""
        e, f, h = self.width, self.mlp_width, self.heads
        # A norm whose weight trains keeps its input (LayerNorm) or an fp32 copy and the
        # product before the weight (RMSNorm); its statistics are fp32.
        norm = (4 * e + element * e + 4) if self.rms_norm else element * e + 8
        frozen_norm = (4 * e + 4) if self.rms_norm else element * e + 8
        # Under a frozen tower the RMSNorm's arithmetic before its weight needs no gradient:
        # only the product its weight's gradient reads is kept.
        alone_norm = element * e if self.rms_norm else norm
        merger = ((norm if "tower" in trains else alone_norm) + 3 * element * e
                  if "projector" in trains
                  else frozen_norm + element * e if "tower" in trains else 0)
        if "tower" not in trains:
            return merger
        mlp = 4 * f if self.rms_norm else (3 if self.quick_gelu else 2) * f
        # The QKV input (the first norm's output), the QKV output (3e), the rotated query and
        # key, the attention output, the projection's input and the MLP's (the second norm's
        # output), and the log-sum-exp.
        attention = element * (e + 3 * e + 2 * e + e + e + e) + 4 * h
        block = 2 * norm + attention + element * mlp
        rope = 2 * 4 * (e // h)
        # Qwen3-VL's deepstack mergers (on merged patches, a quarter as many) keep a norm's
        # input and their GELU's input and output, like the merger, per level.
        deepstack = self.deepstack * (norm + 3 * element * e)
        return element * self.patch_values + self.depth * block + rope + merger + deepstack

    def microbatch_bytes(self, *, seq_length: int, rows: int, max_pixels: int,
                         trains: frozenset[str], element: int) -> int:
        """What one micro-batch of ``rows`` rows of ``seq_length`` tokens keeps, each row
        holding as many images of ``max_pixels`` as its tokens allow."""
        patches = self.image_patches(max_pixels)
        images = rows * (seq_length // (patches // self.merge_size ** 2))
        return images * patches * self.saved_bytes_per_patch(trains, element)


def vision_shape(config: Mapping[str, Any]) -> VisionShape | None:
    """The vision tower of a qwen2_vl / qwen2_5_vl / qwen3_vl HF config; None for other model
    types."""
    family = str(config.get("model_type"))
    if family not in _DEFAULTS:
        return None
    v = {**_DEFAULTS[family], **(config.get("vision_config") or {})}
    if family == "qwen2_vl":
        width, out = int(v["embed_dim"]), int(v["hidden_size"])
        mlp = width * int(v["mlp_ratio"])
    else:
        width, out, mlp = int(v["hidden_size"]), int(v["out_hidden_size"]), int(v["intermediate_size"])
    return VisionShape(
        family=family, depth=int(v["depth"]), width=width, heads=int(v["num_heads"]),
        mlp_width=mlp, out_width=out, channels=int(v.get("in_chans") or v["in_channels"]),
        patch_size=int(v["patch_size"]), temporal_patch_size=int(v["temporal_patch_size"]),
        merge_size=int(v["spatial_merge_size"]), quick_gelu=v.get("hidden_act") == "quick_gelu",
        position_embeddings=int(v.get("num_position_embeddings") or 0),
        deepstack=len(v.get("deepstack_visual_indexes") or ()))
