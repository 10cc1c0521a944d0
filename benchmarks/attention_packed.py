"""Packed (THD) vs padded attention throughput of the torch attention backend.

Draws documents with long-tailed (log-normal) lengths until ``--tokens`` real tokens, then times
the same documents several ways through hpc_mca.models.attention.TorchCoreAttention:

* packed/<kernel>: one ``[t, heads, dim]`` stream with cu_seqlens, for every packed kernel that
  runs here (hpc_mca.models.packed_kernels: sdpa everywhere; varlen and flex on CUDA; flex also
  on CPU with ``--forward-only``, where torch has no flex backward);
* per-doc: one plain causal SDPA call per document (the reference a packed kernel must beat);
* padded: a ``[max_len, n_docs, heads, dim]`` batch, right-padded, plain causal SDPA.

All count only real tokens, forward + backward unless ``--forward-only``. The ratios printed
at the end: the automatic kernel against the fastest way measured, and against padding.

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


def build_module(args: argparse.Namespace, kernel: str = "sdpa"):
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
        packed_kernel=kernel,
    )


def packed_kernels(args: argparse.Namespace) -> list[str]:
    """The packed kernels that can run this benchmark here."""
    from hpc_mca.models.packed_kernels import varlen_available

    cuda = args.device.startswith("cuda")
    kernels = ["sdpa"]
    if cuda or args.forward_only:
        kernels.append("flex")
    if cuda and varlen_available() and args.dtype != "float32":
        kernels.append("varlen")
    return kernels


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

    from hpc_mca.models.packed_attention import sdpa
    from hpc_mca.models.packed_kernels import resolve_packed_kernel, varlen_available

    init_megatron()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lengths = document_lengths(args)
    total = sum(lengths)
    grad = not args.forward_only

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    packed = (
        tensor(total, args.heads, args.head_dim),
        *(tensor(total, args.kv_heads, args.head_dim) for _ in range(2)),
    )
    longest, n_docs = max(lengths), len(lengths)
    padded = (
        tensor(longest, n_docs, args.heads, args.head_dim),
        *(tensor(longest, n_docs, args.kv_heads, args.head_dim) for _ in range(2)),
    )
    kind = "forward" if args.forward_only else "forward+backward"
    print(
        f"{n_docs} documents, {total} tokens (mean {total / n_docs:.0f}, max {longest}), "
        f"heads {args.heads}/{args.kv_heads}x{args.head_dim}, {args.dtype} on {device}, {kind}",
        flush=True,
    )

    def run(module, q, k, v, **kwargs) -> None:
        out = module(q, k, v, None, **kwargs)
        if grad:
            out.sum().backward()

    def per_document() -> None:
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        for a, b in zip(starts, starts[1:]):
            q, k, v = (x[a:b].transpose(0, 1)[None] for x in packed)
            out = sdpa(q, k, v, is_causal=True)
            if grad:
                out.sum().backward()

    print(f"{'':14}{'ms':>10}{'tokens/s':>14}", flush=True)
    seconds: dict[str, float] = {}

    def report(name: str, step) -> None:
        seconds[name] = timed(step, args)
        print(f"{name:14}{seconds[name] * 1e3:10.2f}{total / seconds[name]:14,.0f}", flush=True)

    for kernel in packed_kernels(args):
        module = build_module(args, kernel)
        # A new PackedSeqParams per call: each micro-batch plans its layout once, as in training.
        report(f"packed/{kernel}", lambda m=module: run(
            m, *packed, packed_seq_params=PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)))
    report("per-doc", per_document)
    report("padded", lambda: run(build_module(args), *padded))
    auto, _ = resolve_packed_kernel(
        "auto", cuda=device.type == "cuda", dtype=dtype, varlen=varlen_available())
    auto = auto if f"packed/{auto}" in seconds else "sdpa"
    best = min(seconds, key=seconds.get)
    chosen = seconds[f"packed/{auto}"]
    print(f"auto kernel: {auto} (segment_tokens {build_module(args).segment_tokens})")
    print(f"packed/{auto} time vs the fastest ({best}): {chosen / seconds[best]:.2f}x")
    print(f"packed/padded throughput ratio: {seconds['padded'] / chosen:.2f}")


if __name__ == "__main__":
    main()
