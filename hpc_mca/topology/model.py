"""ModelShape: the few numbers of a decoder-only transformer that decide layout and memory.

Read from a Hugging Face ``config.json`` (llama, mistral, qwen2/3, qwen2/3-moe, mixtral, seed_oss,
deepseek_v3 (also Kimi-K2, Moonlight), glm4_moe style keys) with :meth:`ModelShape.from_hf_config`;
nothing here imports transformers, so the defaults its config classes apply to an absent key are
applied here (_FAMILY_DEFAULTS).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import LayoutError, raise_if
from .vision import VisionShape, vision_shape

# model_type values whose MLP is a plain two-matrix MLP (fc1 -> act -> fc2). Everything else in
# the families we train (llama, mistral, qwen, mixtral, gemma) uses a gated (SwiGLU/GeGLU) MLP,
# which has a third matrix and a doubled fc1 output.
BUILDABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "seed_oss",
                         "qwen2_moe", "glm4_moe", "deepseek_v3", "qwen2_vl", "qwen2_5_vl",
                         "qwen3_vl")
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

# What transformers' config classes (DeepseekV3Config, Glm4MoeConfig, Qwen2MoeConfig) put in
# place of an absent key that decides the structure the planner sizes. The base dimensions
# (layers, hidden, heads, vocab) are not defaulted: a config without them is refused.
_DEEPSEEK_DEFAULTS: dict[str, Any] = {
    "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
    "n_shared_experts": 1, "first_k_dense_replace": 3, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
}
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": _DEEPSEEK_DEFAULTS,
    "kimi_k2": _DEEPSEEK_DEFAULTS,  # Kimi-K2's remote config: DeepSeek-V3's architecture
    "glm4_moe": {"n_routed_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 1408, "n_shared_experts": 1,
                 "first_k_dense_replace": 1, "num_nextn_predict_layers": 1},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1},
    "qwen3_moe": {"decoder_sparse_step": 1},
}
# Families whose router adds a learned per-expert bias (``e_score_correction_bias``, fp32) to
# its scores before the top-k: DeepSeek-V3's auxiliary-loss-free balancing.
_EXPERT_BIAS_MODEL_TYPES = frozenset({"deepseek_v3", "kimi_k2", "glm4_moe"})


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
    moe_shared_expert_gate: bool = False
    """The shared expert's output is scaled by a sigmoid of a 1×h projection (Qwen2-MoE)."""
    moe_router_expert_bias: bool = False
    """The router keeps a per-expert score bias (DeepSeek-V3, GLM-4.5 e_score_correction_bias)."""
    dense_layer_ids: tuple[int, ...] = ()
    """MoE models: the layers whose MLP is dense (``ffn_hidden_size`` wide) instead of an MoE
    block: DeepSeek-V3/GLM-4.5 ``first_k_dense_replace``, Qwen-MoE ``mlp_only_layers`` and
    ``decoder_sparse_step``."""
    q_lora_rank: int | None = None
    """MLA: width of the query latent (q_a_proj); None = a plain q_proj (DeepSeek-V2-Lite)."""
    kv_lora_rank: int | None = None
    """MLA: width of the key/value latent (kv_a_proj_with_mqa, less the RoPE part); None =
    ordinary (GQA) attention. Multi-latent attention is on exactly when this is set."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key width with rotary embedding (the key's is shared by the heads)."""
    v_head_dim: int = 0
    """MLA: per-head value width (the attention output is heads · v_head_dim wide)."""
    checkpoint_mtp_layers: int = 0
    """Multi-token-prediction layers the checkpoint holds (``num_nextn_predict_layers``); a run
    trains them only when it sets mtp_num_layers (memory.Workload)."""
    vision_params: int = 0
    """Parameters of a VL model's vision tower (qwen2_vl, qwen2_5_vl, qwen3_vl): whole on every TP rank
    of the first pipeline stage; 0 for a text model."""
    vision: VisionShape | None = None
    """A VL model's vision tower, for its activations (vision.py); None for a text model."""
    name: str = ""
    """Label for reports, e.g. the HF model directory name."""

    def __post_init__(self) -> None:
        raise_if(_shape_violations(self))

    @property
    def kv_channels(self) -> int:
        """Per-head width used by the attention projections. Under MLA a head's query/key and
        value widths differ: the mean of the two, so that the sums network.py forms over Q and
        the output (2 · heads · kv_channels) and over K and V are exact."""
        if self.is_mla:
            return (self.qk_head_dim + self.value_head_dim) // 2
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_mla(self) -> bool:
        """Multi-latent attention (DeepSeek-V2/V3 style low-rank query and key/value)."""
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys (QKᵀ's inner dimension)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.kv_channels

    @property
    def value_head_dim(self) -> int:
        """Per-head width of values and of the attention output."""
        return self.v_head_dim if self.is_mla else self.kv_channels

    @property
    def is_moe(self) -> bool:
        """Any layer is an MoE layer (what EP and the MoE settings apply to)."""
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is an MoE block."""
        return self.num_layers - len(self.dense_layer_ids) if self.is_moe else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has an MoE block rather than a dense MLP."""
        return self.is_moe and layer not in self.dense_layer_ids

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
    lines += _mla_violations(shape) + _moe_structure_violations(shape)
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


def _mla_violations(shape: ModelShape) -> list[str]:
    """MLA's widths: all positive with kv_lora_rank set (qk_nope_head_dim may be 0), none
    without it."""
    dims = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if not shape.is_mla:
        return [f"{f}={getattr(shape, f)!r} needs kv_lora_rank (multi-latent attention); valid: "
                f"{'None' if f == 'q_lora_rank' else 0} without it"
                for f in (*dims, "q_lora_rank") if getattr(shape, f)]
    lines = []
    for field in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        value = getattr(shape, field)
        if not _is_int(value) or value < 1:
            lines.append(f"{field}={value!r} must be a positive integer under multi-latent "
                         f"attention")
    if not _is_int(shape.qk_nope_head_dim) or shape.qk_nope_head_dim < 0:
        lines.append(f"qk_nope_head_dim={shape.qk_nope_head_dim!r} must be 0 or a positive "
                     f"integer")
    if shape.q_lora_rank is not None and (not _is_int(shape.q_lora_rank)
                                          or shape.q_lora_rank < 1):
        lines.append(f"q_lora_rank={shape.q_lora_rank!r} must be a positive integer or None "
                     f"(a plain q_proj)")
    return lines


def _moe_structure_violations(shape: ModelShape) -> list[str]:
    """Dense layers, shared expert, router bias and MTP layers: values a real model can have."""
    lines = []
    ids = shape.dense_layer_ids
    if not isinstance(ids, tuple) or not all(_is_int(i) for i in ids):
        return [f"dense_layer_ids={ids!r} must be a tuple of layer indices"]
    if ids and not shape.is_moe:
        lines.append(f"dense_layer_ids={ids} needs num_experts > 0 (a dense model's layers are "
                     f"all dense); valid: ()")
    elif list(ids) != sorted(set(ids)) or any(not 0 <= i < shape.num_layers for i in ids):
        lines.append(f"dense_layer_ids={ids} must be increasing, each once, within "
                     f"0..{shape.num_layers - 1}")
    elif ids and len(ids) == shape.num_layers:
        lines.append(f"dense_layer_ids={ids} leaves no MoE layer; valid: fewer than "
                     f"num_layers={shape.num_layers}, or num_experts=0")
    fs = shape.moe_shared_expert_ffn_hidden_size
    if not _is_int(fs) or fs < 0:
        lines.append(f"moe_shared_expert_ffn_hidden_size={fs!r} must be 0 (none) or a "
                     f"positive integer")
    elif shape.moe_shared_expert_gate and not fs:
        lines.append("moe_shared_expert_gate=True needs a shared expert; valid: "
                     "moe_shared_expert_ffn_hidden_size > 0, or no gate")
    if shape.moe_router_expert_bias and not shape.is_moe:
        lines.append("moe_router_expert_bias=True needs num_experts > 0")
    if not _is_int(shape.checkpoint_mtp_layers) or shape.checkpoint_mtp_layers < 0:
        lines.append(f"checkpoint_mtp_layers={shape.checkpoint_mtp_layers!r} must be 0 or a "
                     f"positive integer")
    return lines


@lru_cache(maxsize=256)
def layer_view(model: ModelShape, moe: bool) -> ModelShape:
    """``model`` as if every layer were of one kind: its MoE layers (``moe``) or its dense-MLP
    layers. The memory and cost models size one layer from a shape; a model that mixes the two
    (DeepSeek-V3's first three layers) sizes each kind from its view."""
    if moe:
        return model if not model.dense_layer_ids else replace(model, dense_layer_ids=())
    if not model.is_moe:
        return model
    return replace(model, num_experts=0, moe_ffn_hidden_size=None, moe_router_topk=0,
                   moe_shared_expert_ffn_hidden_size=0, moe_shared_expert_gate=False,
                   moe_router_expert_bias=False, dense_layer_ids=())


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
    vision = vision_shape(config)
    # Multimodal checkpoints (Qwen2.5-VL, Llama-4, Gemma-3) nest the language model's config;
    # transformers 5 keeps their tying outside it.
    if _pick(config, "num_layers") is None and isinstance(config.get("text_config"), Mapping):
        config = {"tie_word_embeddings": config.get("tie_word_embeddings", False),
                  **config["text_config"]}
    # The family's defaults under what the config gives (an explicit null stays null).
    config = {**_FAMILY_DEFAULTS.get(str(config.get("model_type")), {}), **config}
    num_experts = int(_pick(config, "num_experts") or 0)
    required = ["num_layers", "hidden_size", "num_attention_heads", "vocab_size"]
    if not (num_experts and _pick(config, "moe_ffn_hidden_size")):
        required.append("ffn_hidden_size")  # MoE configs may give only the expert width
    missing = [_KEYS[name][0] for name in required if _pick(config, name) is None]
    if missing:
        raise LayoutError(f"model config {source} lacks {', '.join(missing)}")
    heads, layers = int(_pick(config, "num_attention_heads")), int(_pick(config, "num_layers"))
    moe_ffn = _pick(config, "moe_ffn_hidden_size")
    ffn = _pick(config, "ffn_hidden_size") or moe_ffn
    mla = _mla_fields(config)
    return ModelShape(
        num_layers=layers,
        hidden_size=int(_pick(config, "hidden_size")),
        num_attention_heads=heads,
        # MLA up-projects a key and a value for every head: no grouping to share.
        num_query_groups=heads if mla else int(_pick(config, "num_query_groups") or heads),
        ffn_hidden_size=int(ffn),
        vocab_size=int(_pick(config, "vocab_size")),
        num_experts=num_experts,
        moe_ffn_hidden_size=int(moe_ffn) if num_experts and moe_ffn else None,
        moe_router_topk=int(_pick(config, "moe_router_topk") or min(2, num_experts))
        if num_experts else 0,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # MLA's head widths are its own (transformers writes head_dim = qk_rope_head_dim).
        head_dim=int(_pick(config, "head_dim")) if _pick(config, "head_dim") and not mla
        else None,
        gated_linear_unit=config.get("model_type") not in _NON_GATED_MODEL_TYPES,
        moe_shared_expert_ffn_hidden_size=_shared_expert_width(config) if num_experts else 0,
        moe_shared_expert_gate=bool(num_experts and config.get("model_type") == "qwen2_moe"
                                    and _shared_expert_width(config)),
        moe_router_expert_bias=bool(num_experts and (
            config.get("model_type") in _EXPERT_BIAS_MODEL_TYPES
            or config.get("topk_method") == "noaux_tc")),
        dense_layer_ids=_dense_layer_ids(config, layers) if num_experts else (),
        checkpoint_mtp_layers=int(config.get("num_nextn_predict_layers")
                                  or config.get("num_mtp_layers") or 0),
        vision_params=vision.params if vision else 0,
        vision=vision,
        name=str(config.get("_name_or_path") or (Path(source).parent.name if source != "config"
                                                    else "")),
        **mla,
    )


def _mla_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Multi-latent attention's widths, when the config has a ``kv_lora_rank``; {} otherwise.
    ``q_lora_rank`` null means a plain q_proj."""
    if config.get("kv_lora_rank") is None:
        return {}
    q_lora = config.get("q_lora_rank")
    return {"q_lora_rank": int(q_lora) if q_lora is not None else None,
            "kv_lora_rank": int(config["kv_lora_rank"]),
            **{key: int(config.get(key) or 0)
               for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}}


def _dense_layer_ids(config: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """Layers of an MoE config whose MLP is dense. DeepSeek/GLM: the first
    ``first_k_dense_replace``, and (DeepSeek-V2's ``moe_layer_freq``) those off the frequency;
    Qwen-MoE: layer i is MoE iff it is not in ``mlp_only_layers`` and (i+1) is a multiple of
    ``decoder_sparse_step``."""
    first_k = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    step = int(config.get("decoder_sparse_step") or 1)
    only = {int(i) for i in config.get("mlp_only_layers") or ()}
    return tuple(i for i in range(layers)
                 if i < first_k or i % freq or i in only or (i + 1) % step)


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
