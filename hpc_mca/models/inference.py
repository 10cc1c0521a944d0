"""Forward-only logits through the pipeline schedule, gathered to the full real vocabulary.

Used for parity checks against transformers and for evaluation: the same call works for any
TP/PP/VP/EP layout because it goes through Megatron's forward-backward schedule (which moves
activations between pipeline stages) with ``forward_only=True``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # megatron is imported lazily, inside the functions that use it
    from collections.abc import Callable, Iterator

    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams

    _Batch = dict[str, torch.Tensor]
    _Collect = Callable[[torch.Tensor], tuple[torch.Tensor, _Batch]]
    _ForwardStep = Callable[[Iterator[_Batch], GPTModel], tuple[torch.Tensor, _Collect]]

__all__ = ["forward_logits", "thd_packed_seq_params"]


def forward_logits(
    chunks: Sequence[torch.nn.Module],
    input_ids: torch.Tensor,
    vocab_size: int,
    *,
    position_ids: torch.Tensor | None = None,
    packed_seq_params: PackedSeqParams | None = None,
    micro_batch_size: int | None = None,
    model_inputs: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Logits ``[batch, seq, vocab_size]`` on the ranks of the last pipeline stage, None on
    the others.

    ``input_ids`` is ``[batch, seq]`` (``[1, tokens]`` with ``packed_seq_params`` in THD
    format; under context parallelism this rank's share of them, and the logits are this
    rank's too), run as micro-batches of ``micro_batch_size`` rows (default: the whole batch, or
    single rows with virtual pipeline chunks, whose interleaved schedule needs at least PP
    micro-batches). Tensor-parallel vocabulary shards are gathered and Megatron's vocabulary
    padding is cut off. ``model_inputs`` are further keyword arguments of every forward (a VL
    model's ``pixel_values`` and ``image_grid_thw``), which belong to the whole batch: one
    micro-batch only. Multimodal rope ``position_ids`` are ``[3, batch, seq]``.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(chunks[0].parameters()).device
    input_ids = input_ids.to(device)
    if position_ids is None:
        position_ids = torch.arange(input_ids.size(1), device=device).expand_as(input_ids)
    size = micro_batch_size or (1 if len(chunks) > 1 and not model_inputs else input_ids.size(0))
    rows = 1 if position_ids.dim() == 3 else 0  # mrope positions: [3, batch, seq]
    batches = [
        {"tokens": tokens, "position_ids": positions}
        for tokens, positions in zip(input_ids.split(size),
                                     position_ids.to(device).split(size, dim=rows))
    ]
    if model_inputs and len(batches) > 1:
        raise ValueError(f"model_inputs {sorted(model_inputs)} belong to the whole batch; valid: "
                         f"one micro-batch (micro_batch_size >= {input_ids.size(0)})")
    iterators: list[Iterator[_Batch]] | Iterator[_Batch] = (
        [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches))
    modes = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()  # no dropout; MoE layers refuse TP without sequence parallel when training
    try:
        with torch.no_grad():
            outputs = get_forward_backward_func()(
                forward_step_func=_logits_step(vocab_size, packed_seq_params, {
                    key: value.to(device) for key, value in (model_inputs or {}).items()}),
                data_iterator=iterators,
                model=list(chunks) if len(chunks) > 1 else chunks[0],
                num_microbatches=len(batches),
                # The schedule divides by CP: under CP the inputs are this rank's share.
                seq_length=input_ids.size(1) * max(1, parallel_state.get_context_parallel_world_size()),
                micro_batch_size=size,
                forward_only=True,
            )
    finally:
        for chunk, mode in zip(chunks, modes):
            chunk.train(mode)
    return torch.cat([out["logits"] for out in outputs]) if outputs else None


def _logits_step(vocab_size: int, packed_seq_params: PackedSeqParams | None,
                 model_inputs: Mapping[str, torch.Tensor] | None = None) -> _ForwardStep:
    """A schedule forward step whose "loss" function hands back the gathered logits."""
    extra = dict(model_inputs or {})
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    def forward_step(data_iterator: Iterator[_Batch], model: GPTModel) -> tuple[torch.Tensor, _Collect]:
        data = next(data_iterator)
        output = model(data["tokens"], data["position_ids"], None,
                       packed_seq_params=packed_seq_params, **extra)

        def collect(logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            full = gather_from_tensor_model_parallel_region(logits, group=model.pg_collection.tp)
            return logits.new_zeros(()), {"logits": full[..., :vocab_size].detach()}

        return output, collect

    return forward_step


def thd_packed_seq_params(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None = None, cp_size: int = 1
) -> PackedSeqParams:
    """``PackedSeqParams`` for one packed row of documents, in THD format.

    ``max_seqlen_*`` is the longest *padded* document: Megatron sizes the RoPE table from it
    (times ``cp_size``) and applies RoPE per padded slot range. Megatron also reads a RoPE
    table exactly as long as the whole pack as absolute positions across documents; under
    context parallelism ``longest · cp_size`` can equal the pack (two equal documents on CP2),
    so the bound is raised by one slot there to keep positions restarting per document.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(torch.int32)
    cu_pad = None if cu_seqlens_padded is None else cu_seqlens_padded.to(torch.int32)
    slots = cu if cu_pad is None else cu_pad
    longest = int((slots[1:] - slots[:-1]).max()) if slots.numel() > 1 else 0
    if slots.numel() > 2 and longest * cp_size == int(slots[-1]):
        longest += 1
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
