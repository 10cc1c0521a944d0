"""Vision-language families (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``): what their
``config.json`` adds to a Qwen2 (Qwen3-VL: Qwen3, with qk-norm) language model.

transformers' own config classes read the file (hub configs are flat, saves of transformers 5
nest ``text_config``; both read the same): :func:`text_config` hands the language model's config
to :mod:`.hf_config`, which makes the usual :class:`~.hf_config.HFModelSpec` of it, and
:func:`vision_spec` describes the vision tower, which the first pipeline stage holds as
transformers' own module (:func:`build_vision_tower`), its tensors listed by building it on the
meta device (no formula to drift from transformers). The language model rotates with
multimodal rope (three position rows, ``mrope_section`` frequencies each); Megatron's
``mrope_section`` takes the same list. Qwen3-VL differs in three ways: its rope bands are
interleaved (band ``i`` turns with the height row when ``i % 3 == 1``, the width row when
``i % 3 == 2``, within ``3 × section`` bands, else with time: :func:`mrope_rows`), its tower also
returns one "deepstack" feature row per image token for each of the first
``len(deepstack_visual_indexes)`` decoder layers (added to their outputs at the image tokens),
and its checkpoints hold the language model under ``model.language_model.`` and the tower under
``model.visual.`` (:mod:`.hf_files` reads either layout under one set of names).

Refused, one line each: Qwen3-VL-MoE, a rope scaling other than the default (transformers'
multimodal rope applies it, Megatron's does not), and mrope sections that do not cover half a
head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpc_mca.models.errors import ModelLoadError

if TYPE_CHECKING:  # torch and transformers are imported where a tower is built
    import torch
    from transformers import PreTrainedConfig

__all__ = ["INTERLEAVED_MROPE_TYPES", "LORA_EXCLUDED", "NESTED_KEY_TYPES", "VL_MODEL_TYPES",
           "VisionSpec", "build_vision_tower", "lora_checkpoint_name", "lora_module_name",
           "mrope_rows", "refuse_unbuilt_vl", "text_config", "vision_spec"]

VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
INTERLEAVED_MROPE_TYPES = frozenset({"qwen3_vl"})
"""Families whose multimodal rope interleaves the three rows' bands (transformers' Qwen3-VL
does for every config; its ``mrope_interleaved`` flag is not read)."""
_DEFAULT_SECTIONS: dict[str, tuple[int, ...]] = {"qwen3_vl": (24, 20, 20)}
"""``mrope_section`` when the config has none (transformers' default of the family)."""
NESTED_KEY_TYPES = frozenset({"qwen3_vl"})
"""Families whose checkpoints transformers 5 saves as ``model.language_model.*`` and
``model.visual.*`` (the Qwen2-VL families it saves as ``model.*`` and ``visual.*``)."""

_TOWERS = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl",
                 "Qwen2VisionTransformerPretrainedModel", "Qwen2VLVisionConfig"),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                   "Qwen2_5_VisionTransformerPretrainedModel", "Qwen2_5_VLVisionConfig"),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl",
                 "Qwen3VLVisionModel", "Qwen3VLVisionConfig"),
}
"""Per family: transformers' vision module and its config class."""

VISION_PREFIX = "visual."
"""Where the vision tower's tensors live, in the checkpoint and in the chunk."""

LORA_EXCLUDED = r"(.*\.)?visual\..*"
"""peft's ``exclude_modules`` for a VL model: no LoRA adapter anywhere in the vision side (tower
and merger), as LLaMA-Factory's LoRA with the tower frozen (the only LoRA the config rules let
through) and the Megatron backend, whose adapters are on its language model's linears only:
Qwen2.5-VL's tower has MLPs named as the language model's (``gate_proj``, ``up_proj``,
``down_proj``), which the target names alone would match."""


_LANGUAGE_MODULES = "model.language_model."
"""Where transformers' VL classes (Qwen2-VL since transformers 4.52, as LLaMA-Factory's LoRA
names them in its adapters) hold the language model: the checkpoint's ``model.`` tensors."""


def lora_module_name(checkpoint_name: str, vl: bool) -> str:
    """The module path in transformers' model (what peft's adapter tensors are named after) of
    a language-model tensor the checkpoint names ``checkpoint_name`` (``model.layers.3...``)."""
    if vl and checkpoint_name.startswith("model."):
        return _LANGUAGE_MODULES + checkpoint_name.removeprefix("model.")
    return checkpoint_name


def lora_checkpoint_name(module_name: str) -> str:
    """:func:`lora_module_name`'s inverse (a text model's names are both)."""
    if module_name.startswith(_LANGUAGE_MODULES):
        return "model." + module_name.removeprefix(_LANGUAGE_MODULES)
    return module_name


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower of a VL model and its image placeholder token."""

    model_type: str
    """The family (a key of the towers transformers provides)."""
    config: Mapping[str, Any] = field(compare=False, repr=False)
    """The vision config as transformers reads it (``to_dict``)."""
    image_token_id: int
    video_token_id: int | None
    spatial_merge_size: int
    tensors: tuple[tuple[str, tuple[int, ...]], ...] = field(repr=False)
    """Every tensor of the tower (``visual.`` names, as the checkpoint holds them) and its shape."""
    deepstack_layers: int = 0
    """Decoder layers (the first ones) whose outputs get the tower's deepstack features at the
    image tokens (Qwen3-VL: ``len(deepstack_visual_indexes)``); 0: none."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.tensors)


def refuse_unbuilt_vl(model_type: object, where: str) -> None:
    """One line for a VL family this backend does not build."""
    if model_type == "qwen3_vl_moe":
        raise ModelLoadError(
            f"{where}: model_type {model_type!r} (a mixture-of-experts Qwen3-VL) is not "
            f"supported; valid vision-language types: {', '.join(VL_MODEL_TYPES)}")


def text_config(cfg: PreTrainedConfig, model_type: str, where: str
                ) -> tuple[PreTrainedConfig, tuple[int, ...]]:
    """(the language model's config, its mrope sections) of a VL config."""
    text = cfg.text_config
    params = dict(getattr(text, "rope_parameters", None) or {})
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in ("default", "mrope"):
        raise ModelLoadError(f"{where}: rope type {rope_type!r} with multimodal rope is not "
                             "supported (supported: 'default')")
    given = params.get("mrope_section") or _DEFAULT_SECTIONS.get(model_type) or ()
    section = tuple(int(n) for n in given)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    if len(section) != 3 or 2 * sum(section) != head_dim:
        raise ModelLoadError(f"{where}: mrope_section {list(section)} must be three sizes summing "
                             f"to half the head dimension ({head_dim // 2})")
    return text, section


def _tower_classes(model_type: str) -> tuple[type[torch.nn.Module], type[PreTrainedConfig]]:
    import importlib

    module, model_class, config_class = _TOWERS[model_type]
    loaded = importlib.import_module(module)
    config_module = importlib.import_module(module.replace(".modeling_", ".configuration_"))
    return getattr(loaded, model_class), getattr(config_module, config_class)


def vision_spec(cfg: PreTrainedConfig, model_type: str) -> VisionSpec:
    """The tower of ``cfg`` (a VL config), its tensors listed from a meta-device build."""
    import torch

    vision = cfg.vision_config.to_dict()
    tower_class, _ = _tower_classes(model_type)
    with torch.device("meta"):
        tower = tower_class(cfg.vision_config)
    tensors = tuple((VISION_PREFIX + name, tuple(param.shape))
                    for name, param in tower.named_parameters())
    video = getattr(cfg, "video_token_id", None)
    deepstack = len(getattr(cfg.vision_config, "deepstack_visual_indexes", None) or ())
    return VisionSpec(model_type=model_type, config=vision, image_token_id=int(cfg.image_token_id),
                      video_token_id=None if video is None else int(video),
                      spatial_merge_size=int(cfg.vision_config.spatial_merge_size),
                      tensors=tensors, deepstack_layers=deepstack)


def mrope_rows(section: tuple[int, ...] | list[int], interleaved: bool) -> list[int]:
    """Which position row (0 time, 1 height, 2 width) turns each of the ``sum(section)`` rotary
    bands. Qwen2-VL: consecutive blocks of ``section`` bands; interleaved (Qwen3-VL): band ``i``
    turns with row ``i % 3`` while ``i < 3 × section[i % 3]`` for rows 1 and 2, else with time."""
    if not interleaved:
        return [row for row, size in enumerate(section) for _ in range(size)]
    return [i % 3 if i % 3 and i < 3 * section[i % 3] else 0 for i in range(sum(section))]


def build_vision_tower(vision: VisionSpec, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """transformers' vision module of the family, in ``dtype``, with sdpa attention; its random
    initialisation is drawn from ``seed`` so that every rank holding a replica (each TP rank of
    the first stage, each data-parallel replica) starts from the same tower."""
    import torch

    tower_class, config_class = _tower_classes(vision.model_type)
    config = config_class.from_dict(dict(vision.config))
    config._attn_implementation = "sdpa"  # eager's twin on every device; no flash-attn needed
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tower = tower_class(config)
    return tower.to(dtype)
