"""Multi-token prediction (MTP) on Megatron-Core's MTP block, with two parts replaced.

Megatron-Core 0.19.2 builds the MTP block after the decoder, on the last pipeline stage
(:func:`mtp_block_spec`). Its MTP loss is left unchanged except for two functions of
``megatron.core.transformer.multi_token_prediction``, replaced by :func:`install` (idempotent,
on every rank, GPU or CPU):

1. ``roll_tensor``. Upstream rolls packed streams one document at a time and reads the
   unpadded ``cu_seqlens_q``, which is wrong when documents sit at padded offsets (hpc-mca's
   packing, and every CP run). Packed streams now go through :mod:`hpc_mca.models.roll`.
   Unpacked rows keep upstream's roll.
2. ``process_mtp_loss``. The gradients get the main loss's per-token normalisation: depth k
   adds ``scale/K · Σ masked token losses`` to the backward, and ``finalize_model_grads``
   divides it, like the main loss, by the global count of main-loss tokens. So the MTP term is
   ``scale/K · Σ_k loss_sum_k / N`` whatever the packing, micro-batching or layout. (Upstream
   rescales per micro-batch by its own token ratio, so the result depends on how the batch
   is cut.) The summed loss and token count of each depth go to :data:`MTP_LOSSES`, for the
   trainer to reduce and log. Upstream's logging tracker is not fed.

The MTP layers' weights come from the checkpoint where it holds MTP modules (deepseek_v3 and
glm4_moe: module k at HF layer ``num_hidden_layers + k``, mapped by
:mod:`hpc_mca.models.mapping`), else from :func:`initialise`; :func:`check_checkpoint` refuses
a checkpoint that holds some modules but fewer than the run builds.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import TYPE_CHECKING, Any, Callable, Optional, overload

import torch
from torch import Tensor

from hpc_mca.models.norm import TorchNorm
from hpc_mca.models.roll import roll_left, roll_plan

if TYPE_CHECKING:  # megatron is imported lazily, inside the functions that use it
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.distributed import ProcessGroup

    from hpc_mca.models.hf_config import HFModelSpec

__all__ = ["MTP_LOSSES", "MtpLosses", "check_checkpoint", "initialise", "install",
           "mtp_block_spec"]


class MtpLosses:
    """Per-depth (summed token loss, token count) of the micro-batches run since the last
    :meth:`take`, on this rank (the last pipeline stage)."""

    def __init__(self) -> None:
        self._parts: list[list[Tensor]] = []

    def add(self, depth: int, loss_sum: Tensor, count: Tensor) -> None:
        while len(self._parts) <= depth:
            self._parts.append([])
        self._parts[depth].append(torch.stack([loss_sum.detach().double(),
                                               count.detach().double()]))

    def take(self, depths: int, device: torch.device) -> Tensor:
        """[depths, 2] sums since the last call (zeros where nothing ran), and reset."""
        out = torch.zeros(depths, 2, dtype=torch.float64, device=device)
        for depth, parts in enumerate(self._parts[:depths]):
            if parts:
                out[depth] = torch.stack(parts).sum(dim=0).to(device)
        self._parts = []
        return out


MTP_LOSSES = MtpLosses()
"""Filled by the replaced ``process_mtp_loss``; read by the trainer's objective each step."""


def mtp_block_spec(config: TransformerConfig, layer: ModuleSpec, backend: str,
                   vp_stage: int | None) -> MultiTokenPredictionBlockSubmodules | None:
    """Megatron's MTP block spec for this chunk (None where it holds no MTP layer). Off the
    TE backend its three norms per layer are the decoder's :class:`TorchNorm` (Megatron's
    local provider gives its torch norm, which refuses sequence parallelism); TE's norms
    handle it themselves."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    if not config.mtp_num_layers:
        return None
    block = get_gpt_mtp_block_spec(config, layer, use_transformer_engine=backend == "te",
                                   vp_stage=vp_stage)
    if block is not None and backend != "te":
        for mtp_layer in block.layer_specs:
            parts = mtp_layer.submodules
            parts.enorm = parts.hnorm = parts.layer_norm = TorchNorm
    return block


_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def check_checkpoint(spec: HFModelSpec, depths: int, *, loading: bool) -> None:
    """Refuse (one line, before anything is allocated) a run of ``depths`` MTP layers over a
    checkpoint that holds some MTP modules but fewer: its layers would mix loaded and fresh
    weights. A checkpoint with none gets :func:`initialise`'s weights."""
    from hpc_mca.models.errors import ModelLoadError

    if loading and 0 < spec.mtp_layers < depths:
        raise ModelLoadError(f"model.mtp_num_layers={depths} but {spec.source} holds "
                             f"{spec.mtp_layers} MTP module(s) (num_nextn_predict_layers); "
                             f"valid: model.mtp_num_layers 0..{spec.mtp_layers}")


def initialise(chunks: list[GPTModel], seed: int) -> None:
    """Fresh MTP weights that do not depend on the parallel layout.

    For checkpoints without MTP modules (the build loads those it holds). Megatron's random
    init depends on the pipeline split (each stage draws its own layers). Here every MTP parameter is drawn whole
    (as one rank would hold it) from a generator seeded by ``seed`` and its name, global expert
    number included. Each rank then keeps its tensor-parallel share, chunked the way Megatron
    shards it (``partition_dim``, ``partition_stride``: fc1 holds [gate_r; up_r]). Init
    follows Megatron's: N(0, init_method_std) for matrices, scaled by 1/sqrt(2·layers) for the
    residual projections, ones for norms, zeros for biases.
    """
    from megatron.core import parallel_state as mpu

    tp = (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size())
    etp = (mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size())
    for chunk in chunks:
        block = getattr(chunk, "mtp", None)
        if block is None:
            continue
        config = chunk.config
        per_rank = (config.num_moe_experts or 0) // max(1, mpu.get_expert_model_parallel_world_size())
        first_expert = mpu.get_expert_model_parallel_rank() * per_rank
        for name, param in block.named_parameters():
            key = _LOCAL_EXPERT.sub(lambda m: f"experts.{first_expert + int(m.group(1))}.",
                                    f"mtp.{name}")
            rank, size = etp if "local_experts" in name else tp
            if not getattr(param, "tensor_model_parallel", False):
                rank, size = 0, 1
            whole = _draw(key, param, size, seed, config)
            dim, stride = getattr(param, "partition_dim", 0), getattr(param, "partition_stride", 1)
            mine = torch.cat(whole.chunk(size * stride, dim=dim)[rank::size], dim=dim)
            with torch.no_grad():
                param.copy_(mine.to(param.dtype))


def _draw(key: str, param: Tensor, tp_size: int, seed: int,
          config: TransformerConfig) -> Tensor:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[getattr(param, "partition_dim", 0)] *= tp_size
    if key.endswith("bias"):
        return torch.zeros(shape)
    if param.dim() == 1:
        return torch.ones(shape)
    std = config.init_method_std
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std /= math.sqrt(2.0 * config.num_layers)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.randn(shape, generator=generator) * std


@overload
def packed_aware_roll(tensor: Tensor, shifts: int = -1, dims: int = -1,
                      cp_group: Optional[ProcessGroup] = None,
                      packed_seq_params: Optional[PackedSeqParams] = None) -> tuple[Tensor, Tensor]: ...


@overload
def packed_aware_roll(tensor: None, shifts: int = -1, dims: int = -1,
                      cp_group: Optional[ProcessGroup] = None,
                      packed_seq_params: Optional[PackedSeqParams] = None) -> tuple[None, None]: ...


def packed_aware_roll(tensor: Optional[Tensor], shifts: int = -1, dims: int = -1,
                      cp_group: Optional[ProcessGroup] = None,
                      packed_seq_params: Optional[PackedSeqParams] = None
                      ) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Megatron's ``roll_tensor`` contract; packed THD streams roll within their (padded)
    documents through :func:`hpc_mca.models.roll.roll_left`."""
    if tensor is None or packed_seq_params is None:
        return _UPSTREAM["roll_tensor"](tensor, shifts, dims, cp_group, packed_seq_params)
    if shifts != -1 or dims not in (-1, tensor.dim() - 1):
        raise ValueError(f"packed MTP roll shifts by -1 along the last dim, got {shifts}/{dims}")
    cp_size = cp_group.size() if cp_group is not None else 1
    cp_rank = cp_group.rank() if cp_group is not None else 0
    # One micro-batch rolls labels, loss mask, input and position ids at every depth with the
    # same params object: plan once per micro-batch, not once per roll.
    plan = getattr(packed_seq_params, "_hpc_mca_roll_plan", None)
    if plan is None:
        plan = roll_plan(packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded,
                         cp_size, cp_rank)
        packed_seq_params._hpc_mca_roll_plan = plan
    return roll_left(tensor, plan, cp_group if cp_size > 1 else None)


def process_mtp_loss(hidden_states: Tensor, labels: Optional[Tensor],
                     loss_mask: Optional[Tensor], output_layer: ColumnParallelLinear,
                     output_weight: Optional[Tensor], runtime_gather_output: Optional[bool],
                     is_training: bool, compute_language_model_loss: Callable,
                     config: TransformerConfig,
                     cp_group: Optional[ProcessGroup] = None, tp_group: Optional[ProcessGroup] = None,
                     packed_seq_params: Optional[PackedSeqParams] = None,
                     scale_logits_fn: Optional[Callable[[Tensor], Tensor]] = None,
                     input_ids: Optional[Tensor] = None) -> Tensor:
    """Upstream's signature (``gpt_model`` calls it by keyword); see the module docstring.

    Returns the main hidden states (the first of the 1+K stacked chunks). Without labels
    (logits-only forward passes) no MTP loss is formed.
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    depths = config.mtp_num_layers
    chunks = torch.chunk(hidden_states, 1 + depths, dim=0)
    hidden_states = chunks[0]
    if labels is None:
        return hidden_states
    if config.mtp_detach_heads:
        output_weight = (output_weight if output_weight is not None
                         else output_layer.weight).detach()
    mask = torch.ones_like(labels) if loss_mask is None else loss_mask
    scale = config.mtp_loss_scaling_factor / depths
    for depth in range(depths):
        logits, _ = output_layer(chunks[depth + 1], weight=output_weight,
                                 runtime_gather_output=runtime_gather_output)
        if scale_logits_fn is not None:
            logits = scale_logits_fn(logits)
        labels, _ = packed_aware_roll(labels, cp_group=cp_group,
                                      packed_seq_params=packed_seq_params)
        mask, count = packed_aware_roll(mask, cp_group=cp_group,
                                        packed_seq_params=packed_seq_params)
        losses = compute_language_model_loss(labels, logits) * mask
        MTP_LOSSES.add(depth, losses.float().sum(), count.float())
        hidden_states = MTPLossAutoScaler.apply(hidden_states, scale * losses)
    return hidden_states


_UPSTREAM: dict[str, Callable[..., Any]] = {}


def install() -> None:
    """Put :func:`packed_aware_roll` and :func:`process_mtp_loss` where Megatron's MTP code
    looks them up (its own module, and ``gpt_model``'s imported name)."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_token_prediction as mtp

    if _UPSTREAM:
        return
    _UPSTREAM["roll_tensor"] = mtp.roll_tensor
    _UPSTREAM["process_mtp_loss"] = mtp.process_mtp_loss
    mtp.roll_tensor = packed_aware_roll
    mtp.process_mtp_loss = process_mtp_loss
    gpt_model.process_mtp_loss = process_mtp_loss
