"""One micro-batch through a Megatron model chunk: inputs, per-token loss, reporting.

The loss contract is Megatron's per-token one (``TransformerConfig.calculate_per_token_loss``):
each micro-batch's loss function returns the *sum* of token losses and the number of real
(loss-masked-in) tokens; the schedule does not average, and ``finalize_model_grads`` divides
every gradient by the token count summed over micro-batches and data-parallel ranks. A step's
loss is therefore the mean over every real token of the global batch, whatever the packing,
micro-batch size or DP size — which is what makes packed and unpacked runs, and any layouts,
comparable step by step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist

from hpc_mca.data.batch import PackedBatch
from hpc_mca.models.inference import thd_packed_seq_params

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

    from .objective import ForwardStep, LossOutput


class ModelInputs(TypedDict):
    """Megatron GPTModel's arguments for one micro-batch (:func:`model_inputs`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    packed_seq_params: PackedSeqParams | None
    """The THD stream's document boundaries; None for unpacked rows."""
    vision: dict[str, torch.Tensor]
    """A vision-language batch's images (``pixel_values``, ``image_grid_thw``) for the chunk's
    vision tower; empty for text. ``position_ids`` is then the multimodal rope's ``[3, ...]``."""


def model_inputs(batch: PackedBatch, device: torch.device) -> ModelInputs:
    """Megatron GPTModel arguments for a micro-batch.

    Packed rows are flattened into one THD stream ``[1, B*S]`` described by ``cu_seqlens``
    (a context-parallel share holds its chunks of that stream, described by the whole one's);
    unpacked rows stay ``[B, S]`` and rely on the causal mask (padding is loss-masked and sits
    after the real tokens, so it never influences them). Labels are already shifted by the data
    pipeline; ignored positions (-100) become token 0 and carry loss weight 0.
    """
    inputs = {
        "input_ids": batch.input_ids,
        "labels": batch.labels.clamp(min=0),
        "loss_mask": batch.loss_mask.float(),
    }
    mrope = batch.mrope_position_ids
    positions = batch.position_ids if mrope is None else mrope
    packed = None
    if batch.packed:
        inputs = {key: value.reshape(1, -1) for key, value in inputs.items()}
        positions = positions.reshape(*positions.shape[:-2], 1, -1)
        cu_seqlens = batch.cu_seqlens
        assert cu_seqlens is not None  # collate_rows gives a packed batch both boundaries
        packed = thd_packed_seq_params(cu_seqlens, batch.cu_seqlens_padded, batch.cp_size)
    out = {key: value.to(device, non_blocking=True) for key, value in inputs.items()}
    vision = {}
    if batch.pixel_values is not None and batch.image_grid_thw is not None:
        vision = {"pixel_values": batch.pixel_values.to(device, non_blocking=True),
                  "image_grid_thw": batch.image_grid_thw.to(device, non_blocking=True)}
    return ModelInputs(input_ids=out["input_ids"], position_ids=positions.to(device, non_blocking=True),
                       labels=out["labels"], loss_mask=out["loss_mask"], packed_seq_params=packed,
                       vision=vision)


def make_forward_step(device: torch.device) -> ForwardStep:
    """The ``forward_step_func`` handed to Megatron's forward-backward schedule."""

    def forward_step(data_iterator: Iterator[PackedBatch], model: torch.nn.Module
                     ) -> tuple[torch.Tensor, Callable[[torch.Tensor], LossOutput]]:
        inputs = model_inputs(next(data_iterator), device)
        return forward_with_loss(model, inputs), partial(token_loss, inputs["loss_mask"])

    return forward_step


def forward_with_loss(model: torch.nn.Module, inputs: ModelInputs) -> torch.Tensor:
    """The chunk's per-token loss of one micro-batch (its output tensor on other stages)."""
    return model(inputs["input_ids"], inputs["position_ids"], None, labels=inputs["labels"],
                 loss_mask=inputs["loss_mask"], packed_seq_params=inputs["packed_seq_params"],
                 **inputs["vision"])


def token_loss(loss_mask: torch.Tensor, per_token: torch.Tensor) -> LossOutput:
    """(sum of masked token losses, real token count, {"lm loss": [sum, count]})."""
    mask = loss_mask.reshape(-1).float()
    total = (per_token.float().reshape(-1) * mask).sum()
    count = mask.sum()
    report = torch.stack([total.detach().clone(), count.detach().clone()])
    return total, count.to(torch.int), {"lm loss": report}


def reduce_step_loss(outputs: list[dict[str, torch.Tensor]], dp_group: dist.ProcessGroup | None,
                     pp_group: dist.ProcessGroup | None,
                     last_stage: bool, device: torch.device, input_tokens: int = 0) -> tuple[float, int, int]:
    """(mean loss per real token, loss tokens, input tokens) of a whole global batch, the same
    on every rank. ``input_tokens`` is this rank's count of non-padding input tokens.

    The losses exist on the last pipeline stage only; they are summed over micro-batches and
    the ``dp_group`` there (data- and context-parallel ranks: each CP rank holds its own share
    of the tokens, so each token is counted once), then summed over the pipeline group (other
    stages add zeros).
    """
    summed = torch.zeros(3, dtype=torch.float64, device=device)
    if last_stage:
        if outputs:
            summed[:2] += torch.stack([out["lm loss"] for out in outputs]).double().sum(dim=0)
        summed[2] = input_tokens
        dist.all_reduce(summed, group=dp_group)
    dist.all_reduce(summed, group=pp_group)
    loss_sum, tokens, inputs = summed.tolist()
    return (loss_sum / tokens if tokens else float("nan")), int(tokens), int(inputs)
