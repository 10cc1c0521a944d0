"""Packed (THD) vs padded attention throughput of the torch attention backend.

Draws documents with long-tailed (log-normal) lengths until ``--tokens`` real tokens, then times
the same documents two ways through hpc_mca.models.attention.TorchCoreAttention:

* packed: one ``[t, heads, dim]`` stream with cu_seqlens (per-document causal attention);
* padded: a ``[max_len, n_docs, heads, dim]`` batch, right-padded, plain causal SDPA.

Both count only real tokens, forward + backward unless ``--forward-only``.

Usage:
    .venv/bin/python benchmarks/attention_packed.py                    # small CPU run
    .venv/bin/python benchmarks/attention_packed.py --device cuda --tokens 65536 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="real tokens in the batch")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA if fewer)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--log-mean", type=float, default=5.0, help="mean of log(document length)")
    parser.add_argument("--log-std", type=float, default=1.0, help="std of log(document length)")
    parser.add_argument("--max-len", type=int, default=2048, help="longest document")
    parser.add_argument("--segment-tokens", type=int, default=None, help="packed segment size")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def document_lengths(args: argparse.Namespace) -> list[int]:
    generator = torch.Generator().manual_seed(args.seed)
    lengths: list[int] = []
    while sum(lengths) < args.tokens:
        draw = math.exp(args.log_mean + args.log_std * torch.randn((), generator=generator).item())
        lengths.append(max(1, min(int(draw), args.max_len, args.tokens - sum(lengths))))
    return lengths


def init_megatron() -> None:
    """World-size-1 gloo group + parallel_state, which TransformerConfig-based modules expect."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="attn-bench-"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


def build_module(args: argparse.Namespace):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hpc_mca.models.attention import DEFAULT_SEGMENT_TOKENS, TorchCoreAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.heads * args.head_dim,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        kv_channels=args.head_dim,
        attention_dropout=0.0,
    )
    return TorchCoreAttention(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        segment_tokens=args.segment_tokens or DEFAULT_SEGMENT_TOKENS,
    )


def timed(step, args: argparse.Namespace) -> float:
    """Seconds per call, best of ``--iters`` after ``--warmup``."""
    for _ in range(args.warmup):
        step()
    best = float("inf")
    for _ in range(args.iters):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    args = parse_args()
    from megatron.core.packed_seq_params import PackedSeqParams

    init_megatron()
    module = build_module(args)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lengths = document_lengths(args)
    total = sum(lengths)
    grad = not args.forward_only

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    packed = (
        tensor(total, args.heads, args.head_dim),
        *(tensor(total, args.kv_heads, args.head_dim) for _ in range(2)),
    )
    longest, n_docs = max(lengths), len(lengths)
    padded = (
        tensor(longest, n_docs, args.heads, args.head_dim),
        *(tensor(longest, n_docs, args.kv_heads, args.head_dim) for _ in range(2)),
    )

    def run(q, k, v, **kwargs) -> None:
        out = module(q, k, v, None, **kwargs)
        if grad:
            out.sum().backward()

    packed_s = timed(lambda: run(*packed, packed_seq_params=params), args)
    padded_s = timed(lambda: run(*padded), args)
    kind = "forward" if args.forward_only else "forward+backward"
    print(
        f"{n_docs} documents, {total} tokens (mean {total / n_docs:.0f}, max {longest}), "
        f"heads {args.heads}/{args.kv_heads}x{args.head_dim}, {args.dtype} on {device}, {kind}, "
        f"segment_tokens {module.segment_tokens}"
    )
    print(f"{'':10}{'ms':>10}{'tokens/s':>14}")
    for name, seconds in (("packed", packed_s), ("padded", padded_s)):
        print(f"{name:10}{seconds * 1e3:10.1f}{total / seconds:14,.0f}")
    print(f"packed/padded throughput ratio: {padded_s / packed_s:.2f}")


if __name__ == "__main__":
    main()
