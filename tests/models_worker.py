"""Rank program of tests/test_models.py: build HF models in Megatron layouts and report.

Usage (every rank, under torchrun or as a single process):
    python tests/models_worker.py MODELS_DIR OUT_DIR JOBS_JSON

``MODELS_DIR`` holds one HF directory per model and ``inputs.pt`` (token ids); ``JOBS_JSON`` is a
list of ``{"name", "layout": {...Layout fields}, "models": [...], "export": bool,
"packed": bool, "opened": bool, "shard_bytes": int, "dtype": "float32" | "bfloat16"}``. For each
job and model the rank holding the full logits
(last pipeline stage, TP rank 0, first data-parallel replica) saves
``OUT_DIR/<job>/<model>.logits.pt`` (and ``.loss.pt``, Megatron's per-token loss, where one
stage holds the whole model); with ``export`` the model is written back to
``OUT_DIR/<job>/<model>.export``; ``packed`` saves per-document vs packed logits; ``opened``
records which shard files each rank read. Rank 0 writes ``OUT_DIR/<job>/timings.json``.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def _save_if_holder(tensor: torch.Tensor | dict[str, torch.Tensor] | None, path: Path) -> None:
    from megatron.core import parallel_state

    first_replica = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    if tensor is not None and first_replica and parallel_state.get_tensor_model_parallel_rank() == 0:
        # the test reads it on the host, whatever ran it
        torch.save(tensor.cpu() if isinstance(tensor, torch.Tensor)
                   else {key: value.cpu() for key, value in tensor.items()}, path)


def packed_vs_alone(chunks, vocab: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Three documents packed in one row, without and with per-document padding, against
    each document run alone. Padding slots hold random tokens that must not leak."""
    from hpc_mca.models.inference import forward_logits, thd_packed_seq_params

    device = next(chunks[0].parameters()).device
    lengths, padded = [5, 7, 4], [8, 8, 4]
    docs = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
    result = {"alone": torch.cat([forward_logits(chunks, d[None], vocab)[0] for d in docs])}
    cu = torch.tensor([0, *lengths]).cumsum(0)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    result["packed"] = forward_logits(chunks, ids, vocab, position_ids=pos,
                                      packed_seq_params=thd_packed_seq_params(cu.to(device)))[0]
    cu_pad = torch.tensor([0, *padded]).cumsum(0)
    slots = [torch.cat([d, torch.randint(0, vocab, (p - len(d),), generator=generator)])
             for d, p in zip(docs, padded)]
    pos = torch.cat([torch.arange(p) for p in padded])[None]
    out = forward_logits(chunks, torch.cat(slots)[None], vocab, position_ids=pos,
                         packed_seq_params=thd_packed_seq_params(cu.to(device),
                                                                 cu_pad.to(device)))[0]
    real = torch.cat([torch.arange(start, start + n) for start, n in zip(cu_pad[:-1], lengths)])
    result = {key: value.cpu() for key, value in result.items()}
    result["packed_padded"] = out.cpu()[real]
    return result


def per_token_loss(chunks, inputs: torch.Tensor) -> torch.Tensor | None:
    """Megatron's (vocab-parallel) cross-entropy of next-token prediction, [batch, seq - 1];
    single-stage layouts only. It sums over the padded vocabulary, so it equals transformers'
    loss only if the padding logits take no probability."""
    from megatron.core import parallel_state

    chunk = chunks[0]
    if len(chunks) > 1 or not (chunk.pre_process and chunk.post_process):
        return None
    if parallel_state.get_context_parallel_world_size() > 1:
        return None  # whole sequences only
    inputs = inputs.to(next(chunk.parameters()).device)
    tokens, labels = inputs[:, :-1], inputs[:, 1:]
    positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
    chunk.eval()
    with torch.no_grad():
        return chunk(tokens, positions, None, labels=labels)


def context_parallel_logits(chunks, inputs: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """Logits of the whole sequences under context parallelism: each rank runs its two
    load-balanced chunks of 2·CP (Megatron's split), and the ranks' logits are put back in
    sequence order."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from hpc_mca.models.inference import forward_logits

    cp = parallel_state.get_context_parallel_world_size()
    positions = torch.arange(inputs.size(1)).expand_as(inputs)
    local = get_batch_on_this_cp_rank({"tokens": inputs, "position_ids": positions},
                                      is_hybrid_cp=False)
    logits = forward_logits(chunks, local["tokens"], vocab, position_ids=local["position_ids"])
    if logits is None:
        return None
    parts = [torch.empty_like(logits) for _ in range(cp)]
    dist.all_gather(parts, logits.contiguous(), group=parallel_state.get_context_parallel_group())
    chunks_in_order: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=1)
        chunks_in_order[rank], chunks_in_order[2 * cp - 1 - rank] = first, second
    return torch.cat(chunks_in_order, dim=1)


def attention_grads(chunks) -> dict[str, torch.Tensor] | None:
    """Gradients of the first layer's attention weights (TP shards gathered in HF row order)
    for a fixed input and a fixed linear loss, in training mode; first pipeline stage only."""
    from megatron.core import parallel_state

    chunk = chunks[0]
    if not chunk.pre_process:
        return None
    attention = chunk.decoder.layers[0].self_attention
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(16, 2, chunk.config.hidden_size, generator=gen)
    weights = torch.randn(16, 2, chunk.config.hidden_size, generator=gen)
    attention.train()
    output, bias = attention(hidden.requires_grad_(), None)
    (output * weights).sum().backward()
    group = parallel_state.get_tensor_model_parallel_group()
    grads = {}
    for name, param in attention.named_parameters():
        grad = param.grad
        dim = getattr(param, "partition_dim", 0) if getattr(param, "tensor_model_parallel", False) else None
        if dim is not None and group.size() > 1:
            parts = [torch.empty_like(grad) for _ in range(group.size())]
            dist.all_gather(parts, grad.contiguous(), group=group)
            grad = torch.cat(parts, dim=dim)
        grads[name] = grad.detach().clone()
    grads["input"] = hidden.grad.detach().clone()
    return grads


def run_model(job: dict, model: str, models: Path, out: Path, ctx) -> float:
    from hpc_mca.models.build import build_model
    from hpc_mca.models.export import DEFAULT_MAX_SHARD_BYTES, save_hf_checkpoint
    from hpc_mca.models.hf_config import read_hf_config
    from hpc_mca.models.inference import forward_logits
    from hpc_mca.models.weights import load_hf_weights

    start = time.perf_counter()
    source = models / model
    vocab = read_hf_config(source).vocab_size
    chunks = build_model(source, ctx, dtype=getattr(torch, job.get("dtype", "float32")))
    layers = [[layer.layer_number for layer in chunk.decoder.layers] for chunk in chunks]
    (out / f"{model}.layers.rank{dist.get_rank()}.json").write_text(json.dumps(layers))
    inputs = torch.load(models / "inputs.pt")
    if ctx.layout.cp > 1:
        logits = context_parallel_logits(chunks, inputs % vocab, vocab)
    else:
        logits = forward_logits(chunks, inputs % vocab, vocab)
    _save_if_holder(logits, out / f"{model}.logits.pt")
    _save_if_holder(per_token_loss(chunks, inputs % vocab), out / f"{model}.loss.pt")
    if job.get("packed"):  # single pipeline stage only: every rank gets logits
        result = packed_vs_alone(chunks, vocab, torch.Generator().manual_seed(7))
        _save_if_holder(torch.stack([result[k] for k in ("alone", "packed", "packed_padded")]),
                        out / f"{model}.packed.pt")
    if job.get("attention_grads"):
        _save_if_holder(attention_grads(chunks), out / f"{model}.attention_grads.pt")
    if job.get("opened"):
        opened = load_hf_weights(chunks, source)
        (out / f"{model}.opened.rank{dist.get_rank()}.json").write_text(json.dumps(opened))
    if job.get("export"):
        shard_bytes = job.get("shard_bytes") or DEFAULT_MAX_SHARD_BYTES
        save_hf_checkpoint(chunks, out / f"{model}.export", source, max_shard_bytes=shard_bytes)
    return time.perf_counter() - start


def main(models: Path, out_root: Path, jobs: list[dict]) -> None:
    from hpc_mca.runtime.distributed import init_distributed, shutdown
    from hpc_mca.topology import Layout

    for job in jobs:
        ctx = init_distributed(Layout(**job["layout"]))
        out = out_root / job["name"]
        out.mkdir(parents=True, exist_ok=True)
        timings = {model: run_model(job, model, models, out, ctx) for model in job["models"]}
        if ctx.is_main:
            (out / "timings.json").write_text(json.dumps(timings))
    shutdown()


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]))
