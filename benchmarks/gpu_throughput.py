"""Tokens/s and MFU of ``hpc-mca train`` against a plain transformers loop, side by side.

Both train the same model shape on the same number of tokens per optimizer step:

* ``hpc-mca train``: the user's command in a subprocess (stage pt, bf16, Megatron DDP, the
  fp32-master distributed-optimizer path, packed kernel and ``model.fusions`` as the trainer
  chooses them: unset fusions are [layer, cross_entropy] on a GPU), on an indexed
  corpus of random token ids. Its figure comes from steps.jsonl (each step timed after a
  device sync): real tokens over the summed step times of the steps after ``--warmup``. The
  last progress line's ``tok/s`` (a per-window average) is checked against steps.jsonl over
  the same window.
* the transformers loop: ``AutoModelForCausalLM.from_config`` with SDPA attention, torch's
  fused AdamW, gradient clipping at 1.0, the same micro-batch and accumulation, in two
  variants: all-bf16 weights and optimizer ("bf16"), and fp32 weights under bf16 autocast
  ("fp32 master", what Megatron's mixed precision keeps).

With ``--profile``, each side then runs two more steps under torch.profiler (left out of the
figures; hpc-mca through ``training.profile_steps``) and the operator tables by self device
time are printed after the figures: where each side's step time goes.

MFU uses the trainer's own formula (hpc_mca.loop.metrics.flops_per_token: 6 per weight,
output layer included, plus causal-unmasked attention scores) and the device's dense bf16
peak (HPC_MCA_PEAK_TFLOPS overrides). Default shape: Llama-3.2-1B (random weights).

    python benchmarks/gpu_throughput.py                        # one GPU, 1B shape, seq 4096
    python benchmarks/gpu_throughput.py --tiny --device cpu    # a seconds-long CPU check
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from trainer_fixtures import rank_env, write_indexed  # noqa: E402

LLAMA_32_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                   tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
PROFILED = 2  # the extra steps of --profile, after the timed ones
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (CPU check)")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--steps", type=int, default=15, help="optimizer steps per side")
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of the figure")
    parser.add_argument("--sides", default="hpc-mca,bf16,fp32-master",
                        help="comma list of hpc-mca, bf16, fp32-master")
    parser.add_argument("--dir", type=Path, default=None, help="work directory")
    parser.add_argument("--train-arg", action="append", default=[],
                        help="extra key=value override for hpc-mca train (repeatable)")
    parser.add_argument("--profile", action="store_true",
                        help="profile two extra steps per side and print the operator tables")
    args = parser.parse_args()
    if args.global_batch % args.micro_batch:
        parser.error(f"--global-batch {args.global_batch} is not a multiple of --micro-batch "
                     f"{args.micro_batch}")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup}: valid is 0 <= warmup < --steps ({args.steps})")
    return args


def hf_config(args: argparse.Namespace) -> dict:
    shape = dict(TINY if args.tiny else LLAMA_32_1B)
    shape["max_position_embeddings"] = max(args.seq_length, shape.get("max_position_embeddings", 0))
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
            **shape}


def make_model_dir(root: Path, config: dict) -> Path:
    """config.json alone (the trainer starts from a random init) plus the demo tokenizer."""
    from hpc_mca.assets.demo.make_demo import build_tokenizer, tokenizer_config

    model_dir = root / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "tokenizer.json").write_text(build_tokenizer().to_str())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    return model_dir


def make_corpus(root: Path, args: argparse.Namespace, vocab: int) -> Path:
    """A Megatron .bin/.idx corpus of random ids: enough whole rows for every step."""
    import numpy as np

    prefix = root / "corpus"
    rows = (args.steps + PROFILED) * args.global_batch + 4
    write_indexed(prefix, np.random.default_rng(0).integers(3, vocab, (rows, args.seq_length + 1)).tolist())
    return prefix


def run_hpc_mca(root: Path, args: argparse.Namespace, model_dir: Path, corpus: Path) -> dict:
    run_dir = root / "run"
    config = {
        "model": {"model_name_or_path": str(model_dir)},
        "data": {"dataset": [str(corpus)], "dataset_format": "indexed", "cutoff_len": args.seq_length,
                 "preprocessing_cache_dir": str(root / "cache")},
        "finetuning": {"stage": "pt"},
        "training": {"output_dir": str(run_dir), "per_device_train_batch_size": args.micro_batch,
                     "global_batch_size": args.global_batch, "learning_rate": 1e-4,
                     "max_steps": args.steps + (PROFILED if args.profile else 0),
                     "logging_steps": args.steps - args.warmup,
                     "bf16": args.device != "cpu", "report_to": []},
    }
    if args.profile:
        config["training"]["profile_steps"] = [args.steps + 1, args.steps + PROFILED]
    import yaml

    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "hpc_mca", "train", str(path), *args.train_arg],
                          env=rank_env(), capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"hpc-mca train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    window = records[args.warmup:args.steps]
    tokens = sum(r["tokens"] for r in window)
    seconds = [r["seconds"] for r in window]
    kernel = re.findall(r"packed kernel \S+", proc.stdout)
    peak = max((r.get("max_memory_gib", 0.0) for r in records), default=0.0)
    if peak:
        kernel.append(f"peak mem {peak:.1f} GiB")
    for line in re.findall(r"^checkpoint .* saved .*$", proc.stdout, re.M):  # each save's phases
        print(f"  {line}", flush=True)
    tables = sorted((run_dir / "profile").glob("*.txt")) if args.profile else []
    return {"tokens_per_s": tokens / sum(seconds), "step_s": statistics.median(seconds),
            "logged": logged_window(proc.stdout, records, args.steps),
            "note": ", ".join(kernel), "profile": tables[0].read_text() if tables else ""}


def logged_window(stdout: str, records: list[dict], upto: int) -> tuple[float, float] | None:
    """The tok/s of the last progress line up to step ``upto`` and steps.jsonl's figure over
    the same window: the steps after the previous progress line or checkpoint save (a save
    starts a new window, its time left out), up to and including the line's own."""
    logged = [(int(step), float(rate)) for step, rate in
              re.findall(r"step (\d+)/\d+ \|.*?tok/s (\d+)", stdout) if int(step) <= upto]
    if not logged:
        return None
    step, rate = logged[-1]
    saves = [int(n) for n in re.findall(r"iter_(\d+) saved", stdout) if int(n) < step]
    first = max([logged[-2][0] if len(logged) > 1 else 0, *saves])
    window = [r for r in records if first < r["step"] <= step]
    return rate, sum(r["tokens"] for r in window) / sum(r["seconds"] for r in window)


def run_transformers(args: argparse.Namespace, config: dict, fp32_master: bool) -> dict:
    """The plain loop: forward, backward, clip, fused AdamW; timed after a device sync."""
    import transformers

    device = torch.device(args.device)
    if device.type == "cuda":  # this side's own peak, not an earlier side's
        torch.cuda.reset_peak_memory_stats()
    hf = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa")
    dtype = torch.float32 if fp32_master else torch.bfloat16
    model = model.to(device=device, dtype=dtype).train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    accumulation = args.global_batch // args.micro_batch
    gen = torch.Generator(device="cpu").manual_seed(0)

    def step() -> None:
        for _ in range(accumulation):
            ids = torch.randint(3, hf.vocab_size, (args.micro_batch, args.seq_length), generator=gen)
            ids = ids.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=fp32_master):
                loss = model(input_ids=ids, labels=ids).loss / accumulation
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for _ in range(args.steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    window = times[args.warmup:]
    # The trainer counts label tokens (seq per row); count the same here.
    tokens = args.global_batch * args.seq_length * len(window)
    table = profile_steps(step, device) if args.profile else ""
    model = optimizer = None  # type: ignore[assignment]  # freed before the other side runs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    note = (f"peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
            if device.type == "cuda" else "")
    return {"tokens_per_s": tokens / sum(window), "step_s": statistics.median(window), "note": note,
            "profile": table}


def profile_steps(step, device: torch.device) -> str:
    """The operator table of PROFILED more steps, in the trainer's format."""
    from hpc_mca.loop.profiling import activities, operator_table

    cuda = device.type == "cuda"
    with torch.profiler.profile(activities=activities(cuda)) as prof:
        for _ in range(PROFILED):
            step()
        sync(device)
    return operator_table(prof, cuda)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


HEADER = f"{'':14}{'tokens/s':>12}{'step s':>9}{'MFU':>8}  note"
"""The table's header; each side's row follows it in these columns."""


def run_line(config: dict, args: argparse.Namespace) -> str:
    """What was trained: the shape, the batch and the timed steps."""
    return (f"{config['num_hidden_layers']} layers x {config['hidden_size']}, vocab "
            f"{config['vocab_size']}, seq {args.seq_length}, {args.global_batch} rows/step "
            f"(micro-batch {args.micro_batch}), {args.steps} steps ({args.warmup} warm-up)")


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(REPO))
    from hpc_mca.loop.metrics import flops_per_token, peak_flops_per_device
    from hpc_mca.topology import ModelShape

    config = hf_config(args)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        model_dir = make_model_dir(root, config)
        flops = flops_per_token(ModelShape.from_hf_config(str(model_dir)), args.seq_length)
        peak = peak_flops_per_device() if args.device != "cpu" else None
        name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
        print(f"{run_line(config, args)} on {name}; {flops / 1e9:.2f} GFLOP/token, peak "
              f"{f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown'}", flush=True)
        print(HEADER, flush=True)
        results: dict[str, dict] = {}
        for side in args.sides.split(","):
            if side == "hpc-mca":
                corpus = make_corpus(root, args, config["vocab_size"])
                result = run_hpc_mca(root, args, model_dir, corpus)
            elif side in ("bf16", "fp32-master"):
                result = run_transformers(args, config, fp32_master=side == "fp32-master")
            else:
                sys.exit(f"--sides: unknown side {side!r} (valid: hpc-mca, bf16, fp32-master)")
            results[side] = result
            mfu = f"{100 * result['tokens_per_s'] * flops / peak:.1f}%" if peak else "-"
            print(f"{side:14}{result['tokens_per_s']:12,.0f}{result['step_s']:9.3f}{mfu:>8}  "
                  f"{result['note']}", flush=True)
        ours = results.get("hpc-mca")
        if ours and ours["logged"]:
            line, recorded = ours["logged"]
            print(f"last progress line tok/s {line:,.0f} vs steps.jsonl over its window "
                  f"{recorded:,.0f}: ratio {line / recorded:.3f}", flush=True)
        for other in ("bf16", "fp32-master"):
            if ours and other in results:
                print(f"hpc-mca / transformers {other}: "
                      f"{ours['tokens_per_s'] / results[other]['tokens_per_s']:.2f}x", flush=True)
        for side, result in results.items():
            if result.get("profile"):
                print(f"\n=== {side}: {PROFILED} profiled steps, operators by self time\n"
                      f"{result['profile']}", flush=True)


if __name__ == "__main__":
    main()
