"""Build the Megatron-Core GPT model chunks of this rank from a Hugging Face model.

``build_model`` runs on every rank after ``init_distributed``, in this order:

1. parse ``config.json`` and refuse unsupported models/options (:mod:`.hf_config`);
2. pre-check the safetensors headers against the config (:mod:`.checkpoint`) and the layout
   against the model (``topology.check_layout``) - all before anything is allocated, so every
   rank fails alone with the same one-line error instead of hanging in a collective;
3. build one GPTModel per virtual pipeline chunk with the local layer spec and the selected
   core attention, HF's RoPE frequencies, and padded vocabulary logits masked (a
   vision-language model: :class:`~hpc_mca.models.vl.McaVLModel`, its tower on the first stage);
4. load the weights each rank owns (:mod:`.weights`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpc_mca.models import layer_compile, mtp, rope
from hpc_mca.models.attention import core_attention_class
from hpc_mca.models.attention_backend import check_context_parallel, select_attention_backend
from hpc_mca.models.checkpoint import inspect_checkpoint
from hpc_mca.models.errors import ModelLoadError
from hpc_mca.models.hf_config import HFModelSpec, check_sequence_length, read_hf_config
from hpc_mca.models.mapping import padded_vocab_size
from hpc_mca.models.megatron_config import (
    LayerSpecs,
    block_spec,
    layer_specs,
    rope_inv_freq,
    transformer_config,
)
from hpc_mca.models.packed_kernels import resolve_packed_kernel
from hpc_mca.models.weights import load_hf_weights
from hpc_mca.runtime.distributed import RankContext
from hpc_mca.topology import LayoutError, ModelShape, check_layout

if TYPE_CHECKING:  # megatron is imported lazily, inside the functions that use it
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["build_model"]


def build_model(
    source: str | Path | Mapping[str, Any],
    ctx: RankContext,
    *,
    seq_length: int | None = None,
    load_weights: bool | None = None,
    attention_backend: str = "auto",
    packed_attention: str = "auto",
    dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    config_overrides: Mapping[str, Any] | None = None,
    compile_layers: bool = False,
) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks (one per virtual pipeline stage) for an HF model.

    ``source`` is an HF model directory (config.json + safetensors), a config.json path or a
    config dict. Weights are loaded when ``load_weights`` is True, or None and ``source`` is a
    path; otherwise parameters are randomly initialised (identically for every TP size).
    ``seq_length`` (default: the config's max_position_embeddings) is the longest sequence the
    model will see; it only matters for refusing sliding windows shorter than that.
    ``compile_layers`` puts each decoder layer under torch.compile (:mod:`.layer_compile`).

    Raises ModelLoadError / LayoutError (one line) before allocating anything.
    """
    spec = read_hf_config(source)
    check_sequence_length(spec, seq_length or spec.max_position_embeddings)
    load = load_weights if load_weights is not None else not isinstance(source, Mapping)
    if load and spec.directory is None:
        raise ModelLoadError("load_weights=True needs an HF model directory, not a config dict")
    checkpoint = inspect_checkpoint(spec.stored()) if load else None  # the files: before any growth
    _check_layout(spec, ctx, bool((config_overrides or {}).get("sequence_parallel")))
    backend = select_attention_backend(attention_backend)
    check_context_parallel(backend, ctx.layout.cp, (config_overrides or {}).get("cp_comm_type"))
    kernel = packed_kernel(spec, backend, packed_attention, cuda=ctx.device.type == "cuda",
                           dtype=dtype, cp=ctx.layout.cp)[0]
    config = transformer_config(spec, ctx.layout, dtype=dtype, gloo=ctx.backend == "gloo",
                                loading=load, overrides=rope.configure(config_overrides, spec))
    layers = layer_specs(spec, core_attention_class(backend, kernel or "sdpa"))
    vocab = padded_vocab_size(spec.vocab_size, ctx.layout.tp, make_vocab_size_divisible_by)
    max_len = seq_length or spec.max_position_embeddings
    _check_vl(spec, ctx, config.mtp_num_layers, config.recompute_granularity)
    if config.mtp_num_layers:
        mtp.check_checkpoint(spec, config.mtp_num_layers, loading=load)
        mtp.install()
    chunks = [
        _build_chunk(spec, config, layers, vocab, max_len, stage, ctx, backend)
        for stage in range(ctx.layout.vp or 1)
    ]
    if checkpoint is not None:
        load_hf_weights(chunks, spec, checkpoint=checkpoint)
    if config.mtp_num_layers and not (checkpoint is not None and spec.mtp_layers):
        mtp.initialise(chunks, ctx.seed)  # no MTP module to load; the same for every layout
    if compile_layers:
        layer_compile.compile_layers(chunks)
    return chunks


def packed_kernel(spec: HFModelSpec, backend: str, preference: str, *, cuda: bool,
                  dtype: torch.dtype, cp: int) -> tuple[str | None, str]:
    """(kernel, why) of packed attention on the torch backend (None for TE/flash, which have
    their own); an explicit kernel this machine cannot train with raises ModelLoadError."""
    if backend != "torch":
        if preference != "auto":
            raise ModelLoadError(f"model.packed_attention={preference!r} applies to the 'torch' "
                                 f"attention backend, this run uses {backend!r}; valid: auto")
        return None, f"the {backend} backend's own"
    return resolve_packed_kernel(preference, cuda=cuda, dtype=dtype,
                                 dropout=spec.attention_dropout, cp=cp)


def _check_layout(spec: HFModelSpec, ctx: RankContext, sequence_parallel: bool) -> None:
    """The layout rules of the planner, for this model (TP divides heads and groups, EP
    divides experts, PP fits the layers, ...)."""
    shape = ModelShape.from_hf_config(spec.raw)
    violations = check_layout(ctx.layout, ctx.env.world_size, shape,
                              sequence_parallel=sequence_parallel and ctx.layout.tp > 1)
    if violations:
        raise LayoutError(violations)


def _build_chunk(
    spec: HFModelSpec,
    config: TransformerConfig,
    layers: LayerSpecs,
    padded_vocab: int,
    max_len: int,
    stage: int,
    ctx: RankContext,
    backend: str,
) -> torch.nn.Module:
    from megatron.core import parallel_state

    vp_stage = stage if ctx.layout.vp else None
    model = _chunk_class(spec, ctx)(
        config=config,
        transformer_layer_spec=block_spec(layers, config, vp_stage),
        # MTP layers are built like the model's last layer (with experts in an MoE model)
        mtp_block_spec=mtp.mtp_block_spec(config, layers.moe, backend, vp_stage),
        vocab_size=padded_vocab,
        max_sequence_length=max_len,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope.theta,
        rotary_percent=spec.rope.partial_rotary_factor,
        vp_stage=vp_stage,
    )
    if spec.mla is None:  # multi-latent attention computes its own rope
        rotary = model.rotary_pos_emb
        rotary.inv_freq = rope_inv_freq(spec.rope, spec.head_dim).to(rotary.inv_freq.device)
    if model.post_process:
        _mask_padded_vocab(model, spec.vocab_size)
    return model.to(ctx.device)


def _chunk_class(spec: HFModelSpec, ctx: RankContext) -> Callable[..., GPTModel]:
    """McaGPTModel, or for a vision-language model McaVLModel with its tower (seeded with the
    run's seed: every replica starts from the same random tower)."""
    if spec.vision is None:
        from hpc_mca.models.gpt import McaGPTModel

        return McaGPTModel
    from hpc_mca.models.vl import McaVLModel

    return functools.partial(McaVLModel, vision=spec.vision, seed=ctx.seed,
                             mrope_interleaved=spec.mrope_interleaved)


def _check_vl(spec: HFModelSpec, ctx: RankContext, mtp_layers: int | None,
              recompute: str | None) -> None:
    """What a vision-language model cannot run with here, one line each. Deepstack features
    (Qwen3-VL) are made on the first stage and added there (:mod:`.vl`): its first virtual
    stage must hold every layer that takes them."""
    if spec.vision is None:
        return
    levels, layout = spec.vision.deepstack_layers, ctx.layout
    first = layout.pipeline_layout[0] if layout.pipeline_layout else \
        spec.num_layers // layout.num_virtual_stages
    if levels > first:
        raise ModelLoadError(f"{spec.source}: {spec.model_type} adds deepstack features to its "
                             f"first {levels} decoder layers, but the first pipeline stage holds "
                             f"{first} ({layout.describe()}); valid: a layout whose first stage "
                             f"holds at least {levels} layers")
    if recompute == "full":
        # The recomputed layers get detached copies of their inputs: the packed rope's
        # per-token mark on the M-RoPE angles (and Qwen3-VL's deepstack features riding on
        # them) would be lost, and the recomputation would differ from the forward.
        raise ModelLoadError(f"{spec.source}: {spec.model_type} with "
                             "parallel.recompute_granularity='full' is not supported; valid: "
                             "selective or none")
    if ctx.layout.cp > 1:
        raise ModelLoadError(f"{spec.source}: {spec.model_type} with context parallelism "
                             f"(cp={ctx.layout.cp}) is not supported; valid: cp 1")
    if mtp_layers:
        raise ModelLoadError(f"{spec.source}: {spec.model_type} with MTP layers "
                             f"(mtp_num_layers={mtp_layers}) is not supported; valid: none")


def _mask_padded_vocab(model: GPTModel, vocab_size: int) -> None:
    """Make logits of Megatron's vocabulary padding the dtype's minimum, so that they take no
    probability in softmax/cross-entropy and can never be sampled or argmax-ed.

    The output layer is vocabulary-parallel: TP rank r produces columns
    ``[r*Vp/tp, (r+1)*Vp/tp)``, and only the columns at or past ``vocab_size`` are padding.
    """
    tp = model.pg_collection.tp
    rank, size = (tp.rank(), tp.size()) if tp is not None else (0, 1)
    width = model.vocab_size // size
    real = min(max(vocab_size - rank * width, 0), width)
    if real == width:
        return

    def hook(module: torch.nn.Module, args: tuple[object, ...], output: tuple[torch.Tensor, torch.Tensor | None]
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # In place: no second logits-sized tensor. Autograd allows it because the matmul
        # saves its inputs, not its output, and index_fill's backward zeroes those gradients.
        logits, bias = output
        padding = torch.arange(real, width, device=logits.device)
        return logits.index_fill_(-1, padding, torch.finfo(logits.dtype).min), bias

    model.output_layer.register_forward_hook(hook)
