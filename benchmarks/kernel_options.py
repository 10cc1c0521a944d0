"""The optional kernels a `model.fusions` setting could use, side by side on the 1B shape.

Each row is one forward + backward of one piece of the Llama-3.2-1B step (one micro-batch of
2 x 4096 tokens), timed after a device sync (median of ``--repeats``), with the peak memory
it allocated above its inputs and its error against an fp32 computation of the same piece:

* output layer + loss (2048 -> 128,256 vocabulary): the logits GEMM then Megatron's
  vocabulary cross-entropy, unfused and fused, and hpc-mca's (``model.fusions:
  [cross_entropy]``, hpc_mca.models.cross_entropy), against liger-kernel's fused linear
  cross-entropy (chunks of the GEMM and the loss together; the logits are never whole in
  memory);
* RMSNorm (2048 wide): torch's eager ``rms_norm`` (what ``TorchNorm`` runs), compiled, and
  liger's Triton kernel;
* SwiGLU (8192 wide): eager ``silu(a) * b``, Megatron's fused ``bias_swiglu_impl``
  (``model.fusions: [swiglu]``) and liger's Triton kernel.

liger-kernel rows need CUDA and the package (``pip install liger-kernel``; a wheel, no
compiler); where either is missing the row says so. A kernel is worth a setting only where it
is faster here and its error is that of the others.

    python benchmarks/kernel_options.py                       # one GPU, bf16
    python benchmarks/kernel_options.py --device cpu --tokens 512 --vocab 4096   # a CPU check
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens in one micro-batch")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--repeats", type=int, default=10)
    return parser.parse_args()


def timed(fn: Callable[[], list[torch.Tensor]], device: torch.device, repeats: int
          ) -> tuple[float, float, list[torch.Tensor]]:
    """(median seconds, peak bytes above what was allocated before, the last outputs)."""
    cuda = device.type == "cuda"
    outputs = fn()  # warm-up: compilation, autotuning, allocator growth
    del outputs
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = fn()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return statistics.median(seconds), peak, outputs


def rel_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest ||got - want|| / ||want|| over the outputs (loss, then gradients)."""
    return max(float((g.float() - w).norm() / w.norm().clamp_min(1e-30)) for g, w in zip(got, want))


def with_grads(loss_fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
    """A closure: forward, backward of the summed output; returns [output sum, *input grads]."""
    def run() -> list[torch.Tensor]:
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = loss_fn(*leaves).float().sum()
        out.backward()
        return [out.detach(), *(t.grad for t in leaves)]
    return run


def liger() -> object | None:
    try:
        import liger_kernel.transformers.functional as functional
    except ImportError:
        return None
    return functional


def output_layer_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list:
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    from hpc_mca.models.cross_entropy import vocab_parallel_cross_entropy as hpc_mca_cross_entropy

    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(args.tokens, args.hidden, generator=gen) * 0.5).to(device, dtype)
    w = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(device, dtype)
    target = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    group = torch.distributed.group.WORLD
    sb = (args.tokens // 2, 2)  # Megatron's [sequence, batch] layout

    def unfused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy((x @ w.t()).view(*sb, -1), target.view(sb))

    def fused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fused_vocab_parallel_cross_entropy((x @ w.t()).view(*sb, -1), target.view(sb), group)

    def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x.float() @ w.float().t(), target, reduction="none")

    def ours(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return hpc_mca_cross_entropy((x @ w.t()).view(*sb, -1), target.view(sb), group)

    rows = [("output+loss", "Megatron CE (unfused)", with_grads(unfused, x, w)),
            ("output+loss", "Megatron fused CE", with_grads(fused, x, w)),
            ("output+loss", "hpc-mca fused CE", with_grads(ours, x, w))]
    functional = liger()
    if functional is not None and device.type == "cuda":
        rows.append(("output+loss", "liger fused linear CE", with_grads(
            lambda x, w: functional.liger_fused_linear_cross_entropy(x, w, target, reduction="sum"), x, w)))
    else:
        rows.append(("output+loss", "liger fused linear CE", None))
    return [(piece, name, fn, with_grads(reference, x, w)) for piece, name, fn in rows]


def elementwise_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list:
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    gen = torch.Generator(device="cpu").manual_seed(1)
    h = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(args.hidden, generator=gen)).to(device, dtype)
    a, b = (torch.randn(args.tokens, args.ffn, generator=gen).to(device, dtype) for _ in range(2))
    functional = liger() if device.type == "cuda" else None

    def norm(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(h, (args.hidden,), weight, 1e-5)

    def norm_fp32(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return norm(h.float(), weight.float())

    def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.silu(a) * b

    def swiglu_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return swiglu(a.float(), b.float())

    def megatron_swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return bias_swiglu_impl(torch.cat([a, b], dim=-1), None)

    compiled_norm, compiled_swiglu = torch.compile(norm), torch.compile(swiglu)
    norm_ref, swiglu_ref = with_grads(norm_fp32, h, weight), with_grads(swiglu_fp32, a, b)
    liger_norm = liger_swiglu = None
    if functional is not None:
        # in_place=False: liger's default writes dY's storage, which autograd may still need
        liger_norm = with_grads(lambda h, w: functional.liger_rms_norm(h, w, 1e-5, in_place=False), h, weight)
        # liger's backward writes the gradients into its saved inputs: give it copies, or the
        # shared a, b (and every later row) would be overwritten; the copies are timed too
        liger_swiglu = with_grads(lambda a, b: functional.liger_swiglu(a.clone(), b.clone()), a, b)
    return [("RMSNorm", "torch eager", with_grads(norm, h, weight), norm_ref),
            ("RMSNorm", "torch.compile", with_grads(compiled_norm, h, weight), norm_ref),
            ("RMSNorm", "liger", liger_norm, norm_ref),
            ("SwiGLU", "eager", with_grads(swiglu, a, b), swiglu_ref),
            ("SwiGLU", "Megatron fused", with_grads(megatron_swiglu, a, b), swiglu_ref),
            ("SwiGLU", "torch.compile", with_grads(compiled_swiglu, a, b), swiglu_ref),
            ("SwiGLU", "liger", liger_swiglu, swiglu_ref)]


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()  # TP=1: the unfused CE reads its group from here
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{args.tokens} tokens, hidden {args.hidden}, ffn {args.ffn}, vocab {args.vocab}, "
          f"{dtype} on {where}; liger-kernel {'yes' if liger() else 'not installed'}", flush=True)
    print(f"{'piece':13}{'kernel':24}{'ms':>9}{'peak MiB':>10}{'rel err':>10}", flush=True)
    for piece, name, fn, reference in output_layer_rows(args, device, dtype) + \
            elementwise_rows(args, device, dtype):
        if fn is None:
            print(f"{piece:13}{name:24}  (needs CUDA and liger-kernel)", flush=True)
            continue
        try:
            seconds, peak, got = timed(fn, device, args.repeats)
            error = rel_error(got, reference())
        except Exception as err:  # a kernel that fails here is reported, not fatal to the rest
            print(f"{piece:13}{name:24}  failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
            continue
        print(f"{piece:13}{name:24}{seconds * 1e3:9.2f}{peak / 2**20:10.0f}{error:10.2e}", flush=True)
        del got
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
