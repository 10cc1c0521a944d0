"""Hugging Face ``config.json`` -> the facts hpc-mca needs to build the same model in Megatron.

:func:`read_hf_config` parses the config with the ``transformers`` class of its ``model_type``
(so missing keys take exactly the defaults transformers itself would use, and configs written by
transformers 4.x and 5.x read the same) and returns an :class:`HFModelSpec`: a frozen,
family-independent description. Anything Megatron's local layer spec would compute differently
from transformers is refused here with one :class:`ModelLoadError` line that names the config
file, the option and what is supported, before anything is allocated.

Supported families and what distinguishes them:

=========== ======================================================================
llama       RMSNorm, SwiGLU, RoPE (default, linear or llama3 scaling), GQA
mistral     as llama; a sliding window is refused only when it is shorter than the
            sequence length (then it changes nothing)
qwen2       as llama plus biases on the q/k/v projections
qwen3       as llama plus RMSNorm on each query/key head (qk-norm), explicit head_dim
qwen3_moe   qwen3 attention, every layer a softmax top-k MoE (norm_topk_prob honoured)
mixtral     mistral attention, every layer a softmax top-k MoE (renormalised top-k)
seed_oss    as llama plus explicit head_dim and, with attention_bias, biases on q/k/v
            only; a bias on o_proj (attention_out_bias) and residual_dropout are refused
qwen2_moe   qwen2 attention (qkv_bias), softmax top-k MoE plus a shared expert behind a
            sigmoid gate; dense layers where mlp_only_layers / decoder_sparse_step say
glm4_moe    partial rotary, optional q/k/v biases and qk-norm, first_k_dense_replace dense
            layers, then sigmoid-routed experts with e_score_correction_bias, group-limited
            top-k, routed_scaling_factor, and shared experts
deepseek_v3 multi-latent attention (q/kv low-rank projections with their norms, a decoupled
            rope head; rope interleaved as DeepSeek's checkpoints store it), the glm4_moe
            routing and dense first layers, default or yarn rope with DeepSeek's mscale
qwen2_vl    a qwen2 language model with multimodal rope (``mrope_section``) and a vision
qwen2_5_vl  tower (transformers' own module, on the first stage): :mod:`.vl_config`
qwen3_vl    a qwen3 language model (qk-norm) with interleaved multimodal rope and a tower
            whose deepstack features join the first decoder layers' outputs
=========== ======================================================================

RoPE is read by :mod:`hpc_mca.models.hf_rope` (default, linear, llama3, yarn).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_mca.models.errors import ModelLoadError
from hpc_mca.models.hf_files import HFCheckpoint
from hpc_mca.models.hf_rope import SUPPORTED_ROPE_TYPES, RopeSpec, read_rope
from hpc_mca.models.vl_config import (
    INTERLEAVED_MROPE_TYPES,
    VL_MODEL_TYPES,
    VisionSpec,
    refuse_unbuilt_vl,
    text_config,
    vision_spec,
)
from hpc_mca.models.vocab_growth import vocab_growth
from hpc_mca.topology.lora import LoraModel
from hpc_mca.topology.model import BUILDABLE_MODEL_TYPES

if TYPE_CHECKING:  # transformers is imported lazily, where a config is parsed
    from transformers import PreTrainedConfig

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "HFModelSpec",
    "RopeSpec",
    "check_sequence_length",
    "read_hf_config",
]

SUPPORTED_MODEL_TYPES = BUILDABLE_MODEL_TYPES  # one list, the planner's too (topology.model)

_QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_vl", "qwen2_5_vl"})
_QKV_BIAS_OPTION_TYPES = {"seed_oss": "attention_bias", "glm4_moe": "attention_bias",
                          "qwen2_moe": "qkv_bias"}
"""Families whose option (the value) puts biases on q/k/v only (o_proj has none)."""
_QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "qwen3_vl"})
_QK_NORM_OPTION_TYPES = {"glm4_moe": "use_qk_norm"}
_MOE_TYPES = frozenset({"qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3"})
_SIGMOID_ROUTER_TYPES = frozenset({"glm4_moe", "deepseek_v3"})
"""Families whose router scores experts with a sigmoid plus ``e_score_correction_bias``."""
_MLA_TYPES = frozenset({"deepseek_v3"})
MTP_TYPES = frozenset({"deepseek_v3", "glm4_moe"})
"""Families whose checkpoints may hold MTP modules after the last decoder layer."""
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
"""Copies of the main embedding and head an MTP module may hold, in checkpoint order."""
_ALWAYS_WINDOWED_TYPES = frozenset({"mistral", "mixtral"})
"""Families where a non-null ``sliding_window`` applies to every layer (no layer_types)."""


@dataclass(frozen=True)
class MlaSpec:
    """Multi-latent attention (DeepSeek-V2/V3): queries through an optional low-rank
    projection, keys and values through a shared low-rank latent, plus one rope head of keys."""

    q_lora_rank: int | None
    """Width of the query latent (``q_a_proj``); None: a plain ``q_proj``."""
    kv_lora_rank: int
    """Width of the key/value latent (``kv_a_proj_with_mqa`` less the rope head)."""
    qk_nope_head_dim: int
    """Per-head query/key dimensions without rope."""
    qk_rope_head_dim: int
    """Per-head query/key dimensions with rope (the key's are shared by all heads)."""
    v_head_dim: int
    """Per-head value dimensions."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class HFModelSpec:
    """A supported HF causal LM, described independently of its family's key names."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (GQA groups)."""
    head_dim: int
    ffn_hidden_size: int
    """Dense MLP width (HF ``intermediate_size``); unused when every layer is MoE."""
    vocab_size: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    """Window of the layers that use sliding-window attention; None when all attend fully."""
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_renormalize_topk: bool = False
    """True: top-k probabilities are renormalised to sum to 1 (Mixtral, norm_topk_prob)."""
    router_aux_loss_coef: float = 0.0
    dense_layers: tuple[int, ...] = ()
    """0-based layers of an MoE model whose MLP is dense, ``ffn_hidden_size`` wide
    (qwen2_moe ``mlp_only_layers``/``decoder_sparse_step``, glm4_moe ``first_k_dense_replace``)."""
    shared_expert_ffn_hidden_size: int = 0
    """Width of the MoE layers' always-on shared expert MLP; 0: none."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(x @ gate) (qwen2_moe)."""
    moe_score_function: str = "softmax"
    """"softmax" or "sigmoid" (with ``e_score_correction_bias`` added for the choice only)."""
    moe_num_groups: int = 0
    """Group-limited routing: experts in this many groups (0: no groups)."""
    moe_group_topk: int = 0
    """Groups a token may pick experts from (0: no groups)."""
    moe_topk_scaling_factor: float = 1.0
    """Routing weights are multiplied by this (``routed_scaling_factor``)."""
    mla: MlaSpec | None = None
    """Multi-latent attention (deepseek_v3); None: multi-head / grouped-query attention."""
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    dtype: str | None = None
    """The checkpoint's declared dtype ("bfloat16", "float32", ...), if the config names one."""
    source: str = "config"
    """Where the config came from, for error messages (a config.json path or "config")."""
    directory: Path | None = None
    """The HF model directory, when the config was read from one."""
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The config.json contents as read, written back (updated) on export."""
    stored_vocab_size: int | None = None
    """Rows of the checkpoint's embedding when ``vocab_size`` was grown past them
    (``model.resize_vocab``, :func:`hpc_mca.models.vocab_growth.record_vocab_growth`); None: not grown."""
    mtp_layers: int = 0
    """Multi-token-prediction modules the checkpoint holds after its decoder layers, at HF
    layers ``num_layers .. num_layers + mtp_layers - 1`` (deepseek_v3 and glm4_moe:
    ``num_nextn_predict_layers``, counted in the files, which transformers' saves leave
    without them); 0 for the other families (:func:`_held_mtp`)."""
    mtp_copies: tuple[str, ...] = ()
    """What each MTP module also holds of the main vocabulary matrices (``embed_tokens.weight``,
    ``shared_head.head.weight``: copies in DeepSeek's checkpoints)."""
    vision: VisionSpec | None = None
    """The vision tower of a vision-language model (:mod:`.vl_config`); None: text only."""
    mrope_section: tuple[int, ...] = ()
    """Multimodal rope: the rotary frequencies each position row (time, height, width) turns;
    empty: one position per token."""
    mrope_interleaved: bool = False
    """The rows' bands are interleaved (Qwen3-VL), not consecutive (:func:`.vl_config.mrope_rows`)."""

    def stored(self) -> HFModelSpec:
        """The spec of the checkpoint's files (its own vocab_size, before any growth)."""
        if self.stored_vocab_size is None:
            return self
        return replace(self, vocab_size=self.stored_vocab_size, stored_vocab_size=None,
                       raw={**self.raw, "vocab_size": self.stored_vocab_size})

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether 0-based ``layer`` has routed experts (not one of ``dense_layers``)."""
        return self.is_moe and layer not in self.dense_layers

    def lora_model(self) -> LoraModel:
        """What decides this model's LoRA targets (:mod:`hpc_mca.topology.lora`)."""
        latent = None if self.mla is None else self.mla.q_lora_rank is not None
        return LoraModel(is_moe=self.is_moe, mla_query_latent=latent)

    @property
    def moe_expert_bias(self) -> bool:
        """The router has an ``e_score_correction_bias`` (sigmoid routers)."""
        return self.moe_score_function == "sigmoid"

    @property
    def shared_expert_prefix(self) -> str:
        """HF module name of the shared expert MLP inside a layer's MoE block."""
        return "shared_expert" if self.model_type == "qwen2_moe" else "shared_experts"

    @property
    def moe_prefix(self) -> str:
        """HF module name of the MoE block inside a layer."""
        return "block_sparse_moe" if self.model_type == "mixtral" else "mlp"


def read_hf_config(source: str | Path | Mapping[str, Any]) -> HFModelSpec:
    """Parse an HF model directory, a ``config.json`` path, or a config dict.

    Raises ModelLoadError (one line naming the file) for a missing/unreadable config, an
    unsupported ``model_type``, or an option Megatron's local spec would not reproduce.
    """
    if isinstance(source, Mapping):
        raw, where, directory = dict(source), "config", None
    else:
        path = Path(source)
        config_path = path / "config.json" if path.is_dir() else path
        raw, where = _read_json(config_path), str(config_path)
        directory = config_path.parent
    model_type = raw.get("model_type")
    refuse_unbuilt_vl(model_type, where)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{where}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    cfg = _transformers_config(model_type, raw, where)
    text, section = text_config(cfg, model_type, where) if model_type in VL_MODEL_TYPES \
        else (cfg, ())
    _refuse_unsupported_options(text, model_type, where)
    spec = _spec_from_config(text, model_type, raw, where, directory)
    if section:  # a VL model: the tower, and the outer config's tying and dtype
        spec = replace(spec, vision=vision_spec(cfg, model_type), mrope_section=section,
                       mrope_interleaved=model_type in INTERLEAVED_MROPE_TYPES,
                       tie_word_embeddings=bool(cfg.tie_word_embeddings),
                       dtype=_dtype_name(cfg) or spec.dtype)
    if model_type in MTP_TYPES:
        spec = _held_mtp(spec, int(getattr(cfg, "num_nextn_predict_layers", 0) or 0))
    growth = vocab_growth(directory) if directory is not None else None
    if growth is None or growth.size <= spec.vocab_size:
        return spec
    return replace(spec, vocab_size=growth.size, stored_vocab_size=spec.vocab_size,
                   raw={**spec.raw, "vocab_size": growth.size})


def _held_mtp(spec: HFModelSpec, declared: int) -> HFModelSpec:
    """``spec`` with the MTP modules its checkpoint holds, of the ``declared`` ones
    (``num_nextn_predict_layers``; transformers writes 1 whether or not it saved any): module k
    is held when any tensor of HF layer ``num_layers + k`` is listed (inspect_checkpoint then
    checks all of them), counting from the first; the copies of the vocabulary matrices are
    those module 0 lists. Reads the index or the single file's header only; no checkpoint (a
    config alone): none held."""
    if declared <= 0 or spec.directory is None:
        return spec
    try:
        names = set(HFCheckpoint.open(spec.directory).weight_map)
    except ModelLoadError:
        return spec  # no weights: a config for a random init; building with weights says why
    prefixes = {name[: name.index(".", len("model.layers.")) + 1] for name in names
                if name.startswith("model.layers.")}
    held = 0
    while held < declared and f"model.layers.{spec.num_layers + held}." in prefixes:
        held += 1
    first = f"model.layers.{spec.num_layers}."
    copies = tuple(c for c in MTP_COPIES if held and first + c in names)
    return replace(spec, mtp_layers=held, mtp_copies=copies)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path}: config file not found (give an HF model directory)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: not readable JSON: {err}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return data


def _transformers_config(model_type: str, raw: Mapping[str, Any], where: str) -> PreTrainedConfig:
    """The transformers config object, which fills defaults and normalises rope keys."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(raw))
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds on bad configs
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ModelLoadError(f"{where}: transformers rejects this config: {message}") from None


def _refuse_unsupported_options(cfg: PreTrainedConfig, model_type: str, where: str) -> None:
    """Options of these families that Megatron's local spec does not compute the same way."""
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{where}: hidden_act={act!r} is not supported (supported: 'silu')")
    if getattr(cfg, "attention_bias", False) and model_type not in (
        _QKV_BIAS_TYPES | set(_QKV_BIAS_OPTION_TYPES)
    ):
        raise ModelLoadError(
            f"{where}: attention_bias=true (a bias on o_proj too) is not supported for "
            f"{model_type} (supported: false; q/k/v-only biases as in qwen2)"
        )
    if getattr(cfg, "mlp_bias", False):
        raise ModelLoadError(f"{where}: mlp_bias=true is not supported (supported: false)")
    if getattr(cfg, "attention_out_bias", False):
        raise ModelLoadError(
            f"{where}: attention_out_bias=true (a bias on o_proj) is not supported (supported: false)"
        )
    residual_dropout = getattr(cfg, "residual_dropout", 0.0) or 0.0
    if residual_dropout:
        raise ModelLoadError(
            f"{where}: residual_dropout={residual_dropout} is not supported (supported: 0.0; "
            "Megatron's hidden_dropout would drop the embeddings too)"
        )
    jitter = getattr(cfg, "router_jitter_noise", 0.0) or 0.0
    if jitter:
        # transformers scales the MoE block's input by noise in training only; Megatron's
        # router would add it to the router's input alone, in evaluation too.
        raise ModelLoadError(
            f"{where}: router_jitter_noise={jitter} is not supported (supported: 0.0; "
            "Megatron's router jitter is not transformers' and would also act outside training)"
        )
    if model_type in _MLA_TYPES and not getattr(cfg, "rope_interleave", True):
        # Megatron's multi-latent attention always takes interleaved rope rows.
        raise ModelLoadError(f"{where}: rope_interleave=false is not supported for {model_type} "
                             "(supported: true, DeepSeek's own checkpoints)")
    if model_type in _MOE_TYPES and _num_experts(cfg) < 1:
        raise ModelLoadError(f"{where}: {model_type} config has no experts (num_experts)")


def _dense_layers(cfg: PreTrainedConfig, model_type: str) -> tuple[int, ...]:
    """Layers of an MoE family that keep a dense MLP, by transformers' own rule per family."""
    layers = range(int(cfg.num_hidden_layers))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        only = set(getattr(cfg, "mlp_only_layers", None) or [])
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        return tuple(i for i in layers if i in only or (i + 1) % step != 0)
    if model_type in ("glm4_moe", "deepseek_v3"):
        return tuple(i for i in layers if i < int(cfg.first_k_dense_replace))
    return ()


def _moe_fields(cfg: PreTrainedConfig, model_type: str, where: str) -> dict[str, Any]:
    """The MoE part of an :class:`HFModelSpec` (empty for dense families)."""
    if model_type not in _MOE_TYPES:
        return {}
    experts, topk = _num_experts(cfg), int(cfg.num_experts_per_tok)
    # Mixtral's experts are intermediate_size wide; the Qwen/GLM MoEs have their own width.
    width = cfg.intermediate_size if model_type == "mixtral" else cfg.moe_intermediate_size
    fields: dict[str, Any] = {
        "num_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": int(width),
        "moe_renormalize_topk": bool(model_type == "mixtral" or getattr(cfg, "norm_topk_prob", False)),
        "dense_layers": _dense_layers(cfg, model_type),
    }
    if model_type == "qwen2_moe":
        fields |= {"shared_expert_ffn_hidden_size": int(cfg.shared_expert_intermediate_size),
                   "shared_expert_gate": True}
    if model_type in _SIGMOID_ROUTER_TYPES:
        fields |= {"shared_expert_ffn_hidden_size": int(cfg.moe_intermediate_size * cfg.n_shared_experts),
                   "moe_score_function": "sigmoid",
                   "moe_topk_scaling_factor": float(cfg.routed_scaling_factor),
                   **_router_groups(cfg, experts, topk, where)}
        if not fields["moe_renormalize_topk"] or topk < 2:
            # Megatron renormalises sigmoid top-k weights exactly when top-k > 1.
            raise ModelLoadError(
                f"{where}: norm_topk_prob={cfg.norm_topk_prob} with num_experts_per_tok={topk} is "
                "not supported for a sigmoid router (supported: norm_topk_prob true, top-k >= 2)")
    return fields


def _router_groups(cfg: PreTrainedConfig, experts: int, topk: int, where: str) -> dict[str, int]:
    """Group-limited routing (n_group, topk_group); transformers ranks a group by the sum of its
    two best scores, Megatron by its top (top-k / groups picked): equal only when that is 2."""
    groups, picked = int(cfg.n_group or 1), int(cfg.topk_group or 1)
    if groups <= 1:
        return {}
    if experts % groups or not 0 < picked <= groups or topk != 2 * picked:
        raise ModelLoadError(
            f"{where}: n_group={groups}, topk_group={picked} with {experts} experts and "
            f"num_experts_per_tok={topk} is not supported (supported: n_group dividing the "
            "experts and num_experts_per_tok = 2 * topk_group, or n_group 1)")
    return {"moe_num_groups": groups, "moe_group_topk": picked}


def _mla_spec(cfg: PreTrainedConfig) -> MlaSpec:
    q_rank = getattr(cfg, "q_lora_rank", None)
    return MlaSpec(q_lora_rank=int(q_rank) if q_rank else None,
                   kv_lora_rank=int(cfg.kv_lora_rank), qk_nope_head_dim=int(cfg.qk_nope_head_dim),
                   qk_rope_head_dim=int(cfg.qk_rope_head_dim), v_head_dim=int(cfg.v_head_dim))


def _num_experts(cfg: PreTrainedConfig) -> int:
    return int(getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0)


def _sliding_window(cfg: PreTrainedConfig, model_type: str) -> int | None:
    """The window that some layer actually uses, or None when every layer attends fully."""
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if model_type in _ALWAYS_WINDOWED_TYPES or getattr(cfg, "use_sliding_window", False):
        return int(window)
    return None


def _dtype_name(cfg: PreTrainedConfig) -> str | None:
    value = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if value is None:
        return None
    return str(value).removeprefix("torch.")


def _spec_from_config(
    cfg: PreTrainedConfig, model_type: str, raw: Mapping[str, Any], where: str, directory: Path | None
) -> HFModelSpec:
    heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return HFModelSpec(
        model_type=model_type,
        num_layers=int(cfg.num_hidden_layers),
        hidden_size=int(cfg.hidden_size),
        num_attention_heads=heads,
        num_query_groups=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        ffn_hidden_size=int(cfg.intermediate_size),
        vocab_size=int(cfg.vocab_size),
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope=read_rope(cfg, where, mla=model_type in _MLA_TYPES),
        max_position_embeddings=int(cfg.max_position_embeddings),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=model_type in _QKV_BIAS_TYPES
        or bool(getattr(cfg, _QKV_BIAS_OPTION_TYPES.get(model_type, "-"), False)),
        qk_norm=model_type in _QK_NORM_TYPES
        or bool(getattr(cfg, _QK_NORM_OPTION_TYPES.get(model_type, "-"), False)),
        sliding_window=_sliding_window(cfg, model_type),
        **_moe_fields(cfg, model_type, where),
        mla=_mla_spec(cfg) if model_type in _MLA_TYPES else None,
        # transformers' sigmoid-routed families have no balancing loss (their bias balances)
        router_aux_loss_coef=0.0 if model_type in _SIGMOID_ROUTER_TYPES
        else float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0),
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        initializer_range=float(getattr(cfg, "initializer_range", 0.02)),
        dtype=_dtype_name(cfg),
        source=where,
        directory=directory,
        raw=dict(raw),
    )


def check_sequence_length(spec: HFModelSpec, seq_length: int) -> None:
    """Refuse a sliding window shorter than the sequences the model will see.

    A window at least as long as the sequence masks nothing, so Mistral-style configs with a
    4k window run unchanged at seq_length <= 4k; beyond that the torch/local attention would
    silently attend further back than the checkpoint was trained to.
    """
    if not isinstance(seq_length, int) or isinstance(seq_length, bool) or seq_length < 1:
        raise ModelLoadError(f"{spec.source}: seq_length={seq_length!r} must be a positive integer")
    if spec.sliding_window is not None and spec.sliding_window < seq_length:
        raise ModelLoadError(
            f"{spec.source}: sliding_window={spec.sliding_window} is shorter than "
            f"seq_length={seq_length}; sliding-window attention is not supported "
            f"(supported: seq_length <= {spec.sliding_window}, or full attention)"
        )
