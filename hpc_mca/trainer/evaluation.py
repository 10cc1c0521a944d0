"""Task accuracy at evaluation: teacher-forced exact match of the response tokens.

A sample counts as correct when the argmax prediction at every trained (response) position
equals the label. Under teacher forcing that is exactly the condition for greedy decoding to
reproduce the whole answer, so this is greedy exact-match accuracy computed in one forward pass.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from hpc_mca.data.arguments import DataRun
from hpc_mca.data.batch import PackedBatch
from hpc_mca.data.dataset import eval_dataloader
from hpc_mca.data.rows import RowDataset
from hpc_mca.loop.exact_match import response_exact_match
from hpc_mca.models.inference import forward_logits
from hpc_mca.models.weights import unwrap

from .step import model_inputs


def exact_match_accuracy(model: list[torch.nn.Module], eval_rows: RowDataset, run: DataRun,
                         vocab_size: int, device: torch.device) -> dict[str, float]:
    """``{"eval/accuracy": correct / samples}`` over the eval rows, the same on every rank."""
    from megatron.core import parallel_state as mpu

    chunks = [unwrap(m) for m in model]  # DDP and, with bf16/fp16, Float16Module around each
    loader = eval_dataloader(eval_rows, run, data_parallel_rank=mpu.get_data_parallel_rank())
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    cp, cp_rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    for batch in loader:
        share = batch.cp_shard(cp, cp_rank)
        logits = _logits(chunks, share, vocab_size)
        if logits is not None:
            predictions = logits.argmax(dim=-1).reshape(share.labels.shape)
            predictions = _whole_batch(predictions, batch, mpu.get_context_parallel_group())
            counts += response_exact_match(predictions.cpu(), batch.labels,
                                           batch.documents).to(device)
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        # The CP ranks of a replica counted the same (whole) batch: reduce over DP alone.
        dist.all_reduce(counts, group=mpu.get_data_parallel_group())
    else:
        counts.zero_()
    dist.all_reduce(counts, group=mpu.get_pipeline_model_parallel_group())
    return {"eval/accuracy": float(counts[0] / counts[1]) if counts[1] else 0.0}


def eval_predictions(model: list[torch.nn.Module], eval_rows: RowDataset, run: DataRun,
                     vocab_size: int, device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """``(predictions, label_ids)`` over the eval rows of every data-parallel rank, the same
    on every rank: ``[rows, seq]`` int64, the greedy (argmax) token at each slot and the token
    it is trained to predict there (-100 where nothing is), in the eval loader's order, rank
    after rank. What transformers' ``compute_metrics`` gets as ``EvalPrediction``."""
    from megatron.core import parallel_state as mpu

    chunks = [unwrap(m) for m in model]
    loader = eval_dataloader(eval_rows, run, data_parallel_rank=mpu.get_data_parallel_rank())
    cp, cp_rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    predictions, labels = [], []
    for batch in loader:
        share = batch.cp_shard(cp, cp_rank)
        logits = _logits(chunks, share, vocab_size)
        whole = torch.zeros(batch.labels.shape, dtype=torch.long, device=device)
        if logits is not None:
            whole = _whole_batch(logits.argmax(dim=-1).reshape(share.labels.shape), batch,
                                 mpu.get_context_parallel_group()).to(device)
        predictions.append(whole)
        labels.append(batch.labels.to(device))
    mine = torch.stack([torch.cat(predictions), torch.cat(labels)])  # [2, rows, seq]
    # The last pipeline stage has the predictions: every stage gets them from it (a sum: the
    # others hold zeros), then every data-parallel rank gets every rank's rows.
    if not last:
        mine[0].zero_()
    dist.all_reduce(mine[0], group=mpu.get_pipeline_model_parallel_group())
    shares = [torch.empty_like(mine) for _ in range(mpu.get_data_parallel_world_size())]
    dist.all_gather(shares, mine, group=mpu.get_data_parallel_group())
    every = torch.cat(shares, dim=1).cpu().numpy()
    return every[0], every[1]


def _whole_batch(share: torch.Tensor, batch: PackedBatch, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Per-slot values of every CP rank's share (``share`` is this rank's) put back in
    ``batch``'s [B, S] order; ``share`` itself without context parallelism."""
    size = dist.get_world_size(group)
    if size == 1:
        return share
    shares = [torch.empty_like(share) for _ in range(size)]
    dist.all_gather(shares, share.contiguous(), group=group)
    whole = share.new_empty(batch.labels.shape)
    for rank, part in enumerate(shares):
        slots = batch.cp_slots(size, rank).to(share.device)
        if batch.packed:
            whole.view(-1)[slots] = part.reshape(-1)
        else:
            whole[:, slots] = part
    return whole


def _logits(chunks: list[torch.nn.Module], batch: PackedBatch, vocab_size: int) -> torch.Tensor | None:
    # A vision-language batch: its images and multimodal rope positions ([3, B, S]), as the
    # training forward gets them (step.model_inputs).
    inputs = model_inputs(batch, next(chunks[0].parameters()).device)
    return forward_logits(chunks, inputs["input_ids"], vocab_size, position_ids=inputs["position_ids"],
                          packed_seq_params=inputs["packed_seq_params"],
                          model_inputs=inputs["vision"] or None)
