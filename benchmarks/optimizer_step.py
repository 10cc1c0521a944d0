"""AdamW step time: torch's per-tensor loop, its multi-tensor foreach path and its fused kernel,
side by side on the parameter shapes of a llama-style model.

Megatron-core without Transformer Engine or Apex builds ``torch.optim.AdamW`` with torch's
defaults (the loop on CPU, foreach on CUDA); ``training.fused_optimizer`` (default on) switches
it to the fused kernel (hpc_mca/trainer/fused_optimizer.py). This prints each variant's time per
step (best of ``--iters``) and the ratio to the fused kernel.

Usage:
    .venv/bin/python benchmarks/optimizer_step.py [--layers 6] [--hidden 512] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args()


def model_shapes(layers: int, hidden: int, vocab: int) -> list[tuple[int, ...]]:
    """Megatron's fp32 main parameters of a llama-style model (GQA 4:1, SwiGLU 8/3·h)."""
    ffn, kv = 8 * hidden // 3, hidden // 4
    layer = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * ffn, hidden), (hidden, ffn),
             (hidden,), (hidden,)]
    return [(vocab, hidden), *layer * layers, (hidden,), (vocab, hidden)]


def step_time(shapes: list[tuple[int, ...]], device: str, iters: int, **mode: bool) -> float:
    params = [torch.nn.Parameter(torch.randn(shape, device=device)) for shape in shapes]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **mode)
    best = float("inf")
    for i in range(iters + 2):  # two warm-up steps create the state
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 2:
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    args = parse_args()
    shapes = model_shapes(args.layers, args.hidden, args.vocab)
    count = sum(torch.Size(s).numel() for s in shapes)
    print(f"{count / 1e6:.1f} M fp32 parameters in {len(shapes)} tensors on {args.device}",
          flush=True)
    times = {}
    for name, mode in (("loop", dict(foreach=False)), ("foreach", dict(foreach=True)),
                       ("fused", dict(fused=True))):
        times[name] = step_time(shapes, args.device, args.iters, **mode)
        print(f"{name:8}{times[name] * 1e3:10.1f} ms/step", flush=True)
    for name in ("loop", "foreach"):
        print(f"{name} / fused step time: {times[name] / times['fused']:.2f}x")


if __name__ == "__main__":
    main()
