"""RoPE on a packed (THD) stream: Megatron's per-document loop vs hpc-mca's one pass, side by side.

Draws documents with long-tailed (log-normal) lengths until ``--tokens`` tokens (the SFT mix of
attention_packed.py), then times, forward + backward, the rotation of a query-shaped
``[tokens, heads, dim]`` tensor three ways:

* megatron-loop: ``rope_utils._apply_rotary_pos_emb_thd``, what Megatron-Core runs without
  Transformer Engine (one rotation and one copy per document);
* one-pass: ``hpc_mca.models.rope.packed_rope`` eager (what hpc-mca runs by default);
* compiled: the same with the rotation under torch.compile (``model.fusions: [rope]``), with
  ``--compiled``.

It checks that the three agree (the first two bit for bit) and prints each one's time and its
ratio to the loop. Positions are cached per micro-batch in the trainer, so they are computed
once before timing here too.

    .venv/bin/python benchmarks/rope_packed.py                        # CPU, 16k tokens
    python benchmarks/rope_packed.py --device cuda --dtype bfloat16 --tokens 65536 --heads 32 \
        --log-mean 6 --max-len 4096 --compiled
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
from attention_packed import document_lengths


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--log-mean", type=float, default=6.0, help="mean of log(document length)")
    parser.add_argument("--log-std", type=float, default=1.0, help="std of log(document length)")
    parser.add_argument("--max-len", type=int, default=4096, help="longest document")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compiled", action="store_true", help="also time the compiled rotation")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class _SingleRank:
    """The CP group Megatron's THD RoPE asks for: size 1, rank 0."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def time_it(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor,
            args: argparse.Namespace) -> float:
    """Median milliseconds of forward + backward."""
    times = []
    for i in range(args.warmup + args.iters):
        leaf = x.detach().requires_grad_()
        _sync(x.device)
        start = time.perf_counter()
        fn(leaf).backward(grad)
        _sync(x.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    from hpc_mca.models import rope

    args = parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lengths = document_lengths(args)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(sum(lengths), args.heads, args.head_dim, generator=gen).to(device, dtype)
    grad = torch.randn(x.shape, generator=gen).to(device, dtype)
    inv = 1.0 / (500000.0 ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))
    angles = torch.outer(torch.arange(max(lengths) + 1, dtype=torch.float32), inv)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :].to(device)
    positions = rope.thd_positions(cu, x.size(0)).to(device)

    def loop(t: torch.Tensor) -> torch.Tensor:
        return rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_SingleRank())

    def one_pass(t: torch.Tensor) -> torch.Tensor:
        return rope._rotate_eager(t.unsqueeze(1), freqs[positions], False).squeeze(1)

    ways = {"megatron-loop": loop, "one-pass": one_pass}
    if args.compiled:
        compiled = rope._compiled_rotate()
        ways["compiled"] = lambda t: compiled(t.unsqueeze(1), freqs[positions], False).squeeze(1)
    reference = loop(x)
    if not torch.equal(one_pass(x), reference):
        raise SystemExit("one-pass RoPE differs from Megatron's loop")
    if args.compiled:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(ways["compiled"](x), reference, rtol=tol, atol=tol)

    print(f"{len(lengths)} documents, {x.size(0):,} tokens, {args.heads} heads x {args.head_dim}, "
          f"{args.dtype} on {device.type}; forward + backward, median of {args.iters}")
    base = None
    for name, fn in ways.items():
        ms = time_it(fn, x, grad, args)
        base = base or ms
        print(f"  {name:<14} {ms:9.2f} ms   {base / ms:5.2f}x the loop", flush=True)


if __name__ == "__main__":
    main()
