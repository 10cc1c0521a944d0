"""ModelShape: the few numbers of a decoder-only transformer that decide layout and memory.

Read from a Hugging Face ``config.json`` (llama, mistral, qwen2/3, qwen2/3-moe, mixtral, seed_oss style
keys) with :meth:`ModelShape.from_hf_config`; nothing here imports transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import LayoutError, raise_if

# model_type values whose MLP is a plain two-matrix MLP (fc1 -> act -> fc2). Everything else in
# the families we train (llama, mistral, qwen, mixtral, gemma) uses a gated (SwiGLU/GeGLU) MLP,
# which has a third matrix and a doubled fc1 output.
BUILDABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "seed_oss")
"""The HF ``model_type``s the trainer builds (hpc_mca.models.hf_config reads their configs):
the planner plans nothing else, so it never proposes a job the trainer cannot run."""

_NON_GATED_MODEL_TYPES = frozenset({"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi"})

# HF spells the same quantity differently across families; first key present wins.
_KEYS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_query_groups": ("num_key_value_heads", "num_query_groups"),
    "ffn_hidden_size": ("intermediate_size", "n_inner", "ffn_hidden_size"),
    "vocab_size": ("vocab_size",),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_router_topk": ("num_experts_per_tok", "moe_topk"),
    "head_dim": ("head_dim",),
}


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a decoder-only (optionally MoE) transformer, in Megatron-Core's terms."""

    num_layers: int
    """Transformer blocks (HF ``num_hidden_layers``); what pipeline parallelism splits."""
    hidden_size: int
    """Width of the residual stream (h)."""
    num_attention_heads: int
    """Query heads; tensor parallelism must divide them."""
    num_query_groups: int
    """Key/value heads (GQA groups); equals ``num_attention_heads`` without GQA."""
    ffn_hidden_size: int
    """Dense MLP inner width (HF ``intermediate_size``)."""
    vocab_size: int
    """Tokenizer vocabulary; Megatron pads it to a multiple of 128·TP."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 means a dense model."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of one expert; None means ``ffn_hidden_size`` (Mixtral style)."""
    moe_router_topk: int = 0
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    tie_word_embeddings: bool = False
    """Output layer shares the input embedding (no separate output matrix)."""
    head_dim: int | None = None
    """Per-head width (Megatron ``kv_channels``); None means hidden_size / num_attention_heads."""
    gated_linear_unit: bool = True
    """SwiGLU-style MLP (three matrices); False for GPT-2 style two-matrix MLPs."""
    moe_shared_expert_ffn_hidden_size: int = 0
    """Inner width of the always-active shared expert(s) (Qwen2-MoE, DeepSeek); 0 = none."""
    name: str = ""
    """Label for reports, e.g. the HF model directory name."""

    def __post_init__(self) -> None:
        raise_if(_shape_violations(self))

    @property
    def kv_channels(self) -> int:
        """Per-head width used by the attention projections."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def tp_mlp_ffn_hidden_size(self) -> int:
        """Inner width of the MLP that TP splits and its collectives feed: the dense MLP, or an
        MoE layer's shared expert (0 without one: routed experts run on the expert grid, on
        the tokens sequence parallelism left each rank)."""
        return self.moe_shared_expert_ffn_hidden_size if self.is_moe else self.ffn_hidden_size

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Inner width of one routed expert."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> ModelShape:
        """Build from an HF config: a dict, a ``config.json`` path, or a model directory.

        A missing file or a config lacking a required key raises LayoutError naming it.
        """
        if isinstance(config, Mapping):
            return _shape_from_dict(config, source="config")
        path = _config_path(Path(config))
        return _shape_from_dict(_read_json(path), source=str(path))


def _shape_violations(shape: ModelShape) -> list[str]:
    """One line per field that cannot describe a real transformer."""
    lines = []
    for field in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                  "ffn_hidden_size", "vocab_size"):
        value = getattr(shape, field)
        if not _is_int(value) or value < 1:
            lines.append(f"{field}={value!r} must be a positive integer")
    if lines:
        return lines
    if shape.num_attention_heads % shape.num_query_groups:
        lines.append(
            f"num_query_groups={shape.num_query_groups} must divide "
            f"num_attention_heads={shape.num_attention_heads} (each KV head serves whole groups)"
        )
    if not _is_int(shape.num_experts) or shape.num_experts < 0:
        lines.append(f"num_experts={shape.num_experts!r} must be 0 (dense) or a positive integer")
    elif shape.num_experts and not 1 <= shape.moe_router_topk <= shape.num_experts:
        lines.append(
            f"moe_router_topk={shape.moe_router_topk} must be between 1 and "
            f"num_experts={shape.num_experts}"
        )
    for field in ("moe_ffn_hidden_size", "head_dim"):
        value = getattr(shape, field)
        if value is not None and (not _is_int(value) or value < 1):
            lines.append(f"{field}={value!r} must be a positive integer or None")
    return lines


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _config_path(path: Path) -> Path:
    """The config.json a user-supplied path points at (the file itself or inside a directory)."""
    candidate = path / "config.json" if path.is_dir() else path
    if not candidate.is_file():
        raise LayoutError(
            f"model config not found: {candidate} (give a config.json or a directory holding one)"
        )
    return candidate


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise LayoutError(f"model config {path} is not readable JSON: {err}") from None
    if not isinstance(data, dict):
        raise LayoutError(f"model config {path} is not a JSON object")
    return data


def _pick(config: Mapping[str, Any], name: str) -> Any:
    """First non-null value among the HF spellings of ``name``, or None."""
    for key in _KEYS[name]:
        if config.get(key) is not None:
            return config[key]
    return None


def _shape_from_dict(config: Mapping[str, Any], source: str) -> ModelShape:
    # Multimodal checkpoints (Qwen2.5-VL, Llama-4, Gemma-3) nest the language model's config.
    if _pick(config, "num_layers") is None and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    num_experts = int(_pick(config, "num_experts") or 0)
    required = ["num_layers", "hidden_size", "num_attention_heads", "vocab_size"]
    if not (num_experts and _pick(config, "moe_ffn_hidden_size")):
        required.append("ffn_hidden_size")  # MoE configs may give only the expert width
    missing = [_KEYS[name][0] for name in required if _pick(config, name) is None]
    if missing:
        raise LayoutError(f"model config {source} lacks {', '.join(missing)}")
    heads = int(_pick(config, "num_attention_heads"))
    moe_ffn = _pick(config, "moe_ffn_hidden_size")
    ffn = _pick(config, "ffn_hidden_size") or moe_ffn
    return ModelShape(
        num_layers=int(_pick(config, "num_layers")),
        hidden_size=int(_pick(config, "hidden_size")),
        num_attention_heads=heads,
        num_query_groups=int(_pick(config, "num_query_groups") or heads),
        ffn_hidden_size=int(ffn),
        vocab_size=int(_pick(config, "vocab_size")),
        num_experts=num_experts,
        moe_ffn_hidden_size=int(moe_ffn) if num_experts and moe_ffn else None,
        moe_router_topk=int(_pick(config, "moe_router_topk") or min(2, num_experts))
        if num_experts else 0,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=int(_pick(config, "head_dim")) if _pick(config, "head_dim") else None,
        gated_linear_unit=config.get("model_type") not in _NON_GATED_MODEL_TYPES,
        moe_shared_expert_ffn_hidden_size=_shared_expert_width(config) if num_experts else 0,
        name=str(config.get("_name_or_path") or (Path(source).parent.name if source != "config"
                                                    else "")),
    )


def _shared_expert_width(config: Mapping[str, Any]) -> int:
    """Qwen2-MoE gives the shared expert's width; DeepSeek gives a count of expert-sized ones."""
    if config.get("shared_expert_intermediate_size"):
        return int(config["shared_expert_intermediate_size"])
    count = int(config.get("n_shared_experts") or 0)
    return count * int(config.get("moe_intermediate_size") or 0)


def check_buildable(model: str | os.PathLike[str]) -> None:
    """LayoutError (one line) unless the config.json at ``model`` (a file or a directory) names a
    ``model_type`` the trainer builds (:data:`BUILDABLE_MODEL_TYPES`)."""
    path = _config_path(Path(model))
    model_type = _read_json(path).get("model_type")
    if model_type not in BUILDABLE_MODEL_TYPES:
        raise LayoutError(f"model config {path}: model_type {model_type!r} is not one the trainer "
                          f"builds; valid: {', '.join(BUILDABLE_MODEL_TYPES)}")
