"""Tokens/s and MFU of torchtitan on the shape benchmarks/gpu_throughput.py trains, for a row
beside ``hpc-mca train``'s.

torchtitan 0.2.2 (the release that imports against torch 2.11; 0.3.0 needs torch's newer
``torch.distributed.fsdp.DataParallelMeshDims``). Its ``Trainer.__init__`` cannot run here as it
stands: it builds an HF dataset and tokenizer from a local asset folder, and on a machine without
a GPU it still asks for ``cuda``. So this script repeats what ``Trainer.__init__`` does for one
device with torchtitan's own pieces, and then calls torchtitan's own ``Trainer.train_step``:

* config: torchtitan's ``ConfigManager`` parses its own CLI flags (printed at the start);
* model: ``torchtitan.models.llama3.Transformer`` built on the meta device in fp32
  (``training.dtype``), then ``parallelize_llama`` (per-TransformerBlock ``torch.compile``,
  fullgraph, inductor; activation checkpointing mode ``none``), ``to_empty`` + ``init_weights``;
* loss: ``build_cross_entropy_loss`` (sum reduction, compiled when ``loss`` is a compile
  component); the step divides by the step's token count, as torchtitan does;
* optimizer: ``build_optimizers`` (AdamW, ``implementation=fused`` on CUDA, ``foreach`` on CPU)
  and ``build_lr_schedulers``;
* mixed precision: ``dist_utils.maybe_enable_amp``. With one device there is no FSDP, so
  torchtitan keeps fp32 weights and runs forward and loss under bf16 autocast (CUDA and CPU);
* step: ``Trainer.train_step`` itself (micro-batches, ``clip_grad_norm_`` at
  ``training.max_norm`` 1.0 with foreach, optimizer and scheduler step), with its GC handler.
  Checkpointing and metric logging are stubbed out (neither is enabled by default).

Data: random token ids (no dataset, no tokenizer, nothing downloaded), ``seq+1`` ids per row
split into input and labels like torchtitan's text loader. Shape: Llama-3.2-1B except the
embeddings, which torchtitan 0.2.2's llama3 does not tie (the output layer is a separate
128256 x 2048 matrix: 0.26B more weights and AdamW state; FLOPs per token are unchanged).

Figure: each step timed after ``torch.cuda.synchronize()``, label tokens over the summed time of
the steps after ``--warmup``; MFU with hpc_mca's formula and peak (as gpu_throughput.py).

Beside the GPU image's packages it needs these wheels (pip download --no-deps; 1.7 MB in
all): torchtitan 0.2.2, torchdata 0.11.0, datasets 5.2.0 (its llama3 package imports its HF
dataset module), dill 0.4.1, multiprocess 0.70.19, tyro 1.0.17, typeguard 4.6.1,
docstring_parser 0.18.0. On one H200 (2026-11-27): 56,989 tokens/s, MFU 52.0%, first step 8.6 s.

    python benchmarks/torchtitan_peer.py                        # one GPU, 1B shape, seq 4096
    python benchmarks/torchtitan_peer.py --tiny --device cpu    # a seconds-long CPU check
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_throughput import HEADER, PROFILED, hf_config, make_model_dir, profile_steps, run_line, sync


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (CPU check)")
    parser.add_argument("--seq-length", type=int, default=None, help="4096; 128 with --tiny")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of the figure")
    parser.add_argument("--compile", choices=("on", "off", "auto"), default="auto",
                        help="torchtitan's compile (model blocks + loss); auto: on for CUDA, off "
                             "on CPU to keep the check short (inductor adds ~15 s there)")
    parser.add_argument("--ac", default="none", help="torchtitan activation_checkpoint.mode")
    parser.add_argument("--profile", action="store_true",
                        help="then profile two more steps and print the operator table "
                             "(gpu_throughput.py --profile prints hpc-mca's beside the loop's)")
    args = parser.parse_args()
    if args.seq_length is None:  # a seconds-long CPU check needs short rows
        args.seq_length = 128 if args.tiny else 4096
    if args.global_batch % args.micro_batch or not 0 <= args.warmup < args.steps:
        parser.error("need --global-batch % --micro-batch == 0 and 0 <= --warmup < --steps")
    return args


def ffn_rounding(dim: int, ffn: int) -> tuple[int, float]:
    """(multiple_of, ffn_dim_multiplier) that make torchtitan's FeedForward exactly ``ffn`` wide:
    it computes multiple_of * ceil(int(multiplier * int(8 * dim / 3)) / multiple_of)."""
    multiple_of = min(1024, ffn & -ffn)  # the largest power of two (up to 1024) dividing ffn
    base = int(2 * (4 * dim) / 3)
    multiplier = ffn / base
    width = multiple_of * -(-int(multiplier * base) // multiple_of)
    assert width == ffn, (dim, ffn, width)
    return multiple_of, multiplier


def titan_cli(args: argparse.Namespace, compile_on: bool, assets: str) -> list[str]:
    """torchtitan's own command-line flags for this run (its defaults otherwise)."""
    cuda = args.device != "cpu"
    cli = ["--model.name", "llama3", "--model.hf_assets_path", assets, "--training.seq_len", str(args.seq_length),
           "--training.local_batch_size", str(args.micro_batch),
           "--training.global_batch_size", str(args.global_batch),
           "--training.steps", str(args.steps), "--training.max_norm", "1.0",
           "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", args.ac,
           "--optimizer.name", "AdamW", "--optimizer.lr", "1e-4",
           "--optimizer.implementation", "fused" if cuda else "foreach",
           "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", str(args.steps + 1)]
    if compile_on:
        cli += ["--compile.enable", "--compile.components", "model,loss"]
    return cli


def random_batches(args: argparse.Namespace, vocab: int) -> Iterator[tuple[dict, torch.Tensor]]:
    """torchtitan's loader contract: ({"input": ids[:, :-1]}, ids[:, 1:]) on the CPU."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    while True:
        ids = torch.randint(3, vocab, (args.micro_batch, args.seq_length + 1), generator=gen)
        yield {"input": ids[:, :-1]}, ids[:, 1:]


def init_single_rank(device: torch.device) -> None:
    """A one-rank process group: torchtitan's ParallelDims builds a device mesh even for one
    device (clip_grad_norm_ asks it for the pp mesh). nccl on CUDA as its trainer picks."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as pd_module

    if device.type == "cpu":
        # torchtitan resolves its device type at import to "cuda" when no accelerator exists.
        pd_module.device_type = "cpu"
    with socket.socket() as s:  # a free local port; nothing leaves the machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)


def build_trainer(args: argparse.Namespace, config: dict, cli: list[str]):
    """Trainer.__init__'s single-device path, from torchtitan's own builders."""
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import (
        Transformer,
        TransformerModelArgs,
        parallelize_llama,
    )
    from torchtitan.models.llama3.model.args import RoPEScalingArgs
    from torchtitan.tools import utils
    from torchtitan.train import Trainer

    device = torch.device(args.device if args.device == "cpu" else "cuda:0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_single_rank(device)
    job = ConfigManager().parse_args(cli)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    multiple_of, multiplier = ffn_rounding(config["hidden_size"], config["intermediate_size"])
    scaling = config.get("rope_scaling") or {}
    model_args = TransformerModelArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"], n_kv_heads=config["num_key_value_heads"],
        vocab_size=config["vocab_size"], multiple_of=multiple_of, ffn_dim_multiplier=multiplier,
        norm_eps=config["rms_norm_eps"], rope_theta=config.get("rope_theta", 500000.0),
        rope_scaling_args=RoPEScalingArgs(scaling_factor=scaling.get("factor", 8.0)))
    model_args.update_from_config(job)
    torch.manual_seed(0)
    with torch.device("meta"), utils.set_default_dtype(torch.float32):  # training.dtype float32
        model = Transformer(model_args)
    model = parallelize_llama(model, dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    width = model.layers["0"].feed_forward.w1.weight.shape[0]
    assert width == config["intermediate_size"], width

    # Trainer.train_step reads only these attributes; __init__'s dataset/tokenizer/checkpoint/
    # metrics set-up is left out (checkpointing and logging are off by default).
    trainer = Trainer.__new__(Trainer)
    trainer.job_config, trainer.device, trainer.parallel_dims = job, device, dims
    trainer.model_args, trainer.tokenizer, trainer.model_parts = model_args, None, [model]
    trainer.loss_fn = build_cross_entropy_loss(job, parallel_dims=dims)
    trainer.optimizers = build_optimizers([model], job.optimizer, dims)
    trainer.lr_schedulers = build_lr_schedulers(trainer.optimizers, job.lr_scheduler,
                                                job.training.steps)
    trainer.train_context = dist_utils.get_train_context(False)
    trainer.maybe_enable_amp = dist_utils.maybe_enable_amp(
        dims, job.training.mixed_precision_param, device.type)
    trainer.gradient_accumulation_steps = args.global_batch // args.micro_batch
    trainer.step, trainer.ntokens_seen = 0, 0
    trainer.checkpointer = SimpleNamespace(maybe_wait_for_staging=lambda: None)
    trainer.metrics_processor = SimpleNamespace(should_log=lambda step: False)
    trainer.gc_handler = utils.GarbageCollection(gc_freq=job.training.gc_freq)
    return trainer, model_args


def main() -> None:
    args = parse_args()
    import torchtitan

    from hpc_mca.loop.metrics import flops_per_token, peak_flops_per_device
    from hpc_mca.topology import ModelShape

    compile_on = args.compile == "on" or (args.compile == "auto" and args.device != "cpu")
    config = hf_config(args)
    tmp = tempfile.TemporaryDirectory()
    # config.json for the FLOP count; the demo tokenizer beside it is torchtitan's asset folder
    # (unused by random ids, but its config check wants the folder to exist).
    model_dir = make_model_dir(Path(tmp.name), config)
    flops = flops_per_token(ModelShape.from_hf_config(str(model_dir)), args.seq_length)
    peak = peak_flops_per_device() if args.device != "cpu" else None
    cli = titan_cli(args, compile_on, str(model_dir))
    print(f"torchtitan {getattr(torchtitan, '__version__', '?')} with torch {torch.__version__}; "
          f"flags: {' '.join(cli)}", flush=True)

    trainer, model_args = build_trainer(args, config, cli)
    _, titan_flops = model_args.get_nparams_and_flops(trainer.model_parts[0], args.seq_length)
    params = sum(p.numel() for p in trainer.model_parts[0].parameters())
    data = random_batches(args, config["vocab_size"])
    times = []
    for _ in range(args.steps):
        sync(trainer.device)
        start = time.perf_counter()
        trainer.step += 1
        trainer.gc_handler.run(trainer.step)  # what Trainer.train does before each step
        trainer.train_step(data)
        sync(trainer.device)
        times.append(time.perf_counter() - start)
    window = times[args.warmup:]
    tokens_per_s = args.global_batch * args.seq_length * len(window) / sum(window)
    mfu = f"{100 * tokens_per_s * flops / peak:.1f}%" if peak else "-"
    mem = (f", peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
           if trainer.device.type == "cuda" else "")
    note = (f"compile {'on' if compile_on else 'off'}, AC {args.ac}, fp32 weights + bf16 "
            f"autocast, AdamW {trainer.job_config.optimizer.implementation}, untied output, "
            f"{params / 1e9:.3f}B params{mem}")
    print(f"{run_line(config, args)}; {flops / 1e9:.2f} GFLOP/token (torchtitan's own count "
          f"{titan_flops / 1e9:.2f}); first step {times[0]:.1f} s{' (compile)' if compile_on else ''}",
          flush=True)
    print(HEADER, flush=True)
    print(f"{'torchtitan':14}{tokens_per_s:12,.0f}{statistics.median(window):9.3f}{mfu:>8}  "
          f"{note}", flush=True)
    if args.profile:  # after the figures, so that profiling never slows the timed steps
        print(f"\n=== torchtitan: {PROFILED} profiled steps, operators by self time\n"
              f"{profile_steps(lambda: trainer.train_step(data), trainer.device)}", flush=True)
    torch.distributed.destroy_process_group()
    tmp.cleanup()


if __name__ == "__main__":
    main()
