"""Checkpoint I/O: save and load throughput next to raw sequential I/O, and signal-to-durable time.

Trains a random-init llama-style model (default 6 layers, hidden 512: ~25 M parameters, a
~400 MB checkpoint with the distributed optimizer's fp32 main weights and Adam moments) with
``hpc-mca train`` on 2 local ranks (torchrun, DP=2, distributed optimizer), then reports:

* save: checkpoint bytes / the trainer's own save time (building the sharded state dict —
  for fully_reshardable that includes the all-gather of the optimizer state over DP —, the
  torch_dist write with fsync, the commit: rename + tracker), and the write phase alone; the
  first save of a process also plans the save, so first and later saves are both shown;
* load: the same bytes / the resume time (dist_checkpointing.load — with the fully-parallel
  load wrapper on GPUs only — + putting model, optimizer, scheduler and RNG back), page cache
  dropped for the checkpoint's files first (posix_fadvise DONTNEED);
* for the distributed optimizer's three formats (training.save_optimizer_format):
  model_space (the default: each rank writes its own slices in model space, any TP/PP/DP on
  resume), Megatron's fully_reshardable (the same tensors gathered over DP first) and
  dp_reshardable (bucket shards, DP changes only);
* best of 3 saves and 2 loads (``--loads``) for every figure: the machine may be shared;
* raw: one file of the same size written sequentially (8 MiB writes, fsync) and read back
  (page cache dropped), on the same file system, and the ratios checkpoint/raw;
* readers side by side: the model_space checkpoint loaded whole in this process by PyTorch's
  ``FileSystemReader`` and by hpc-mca's direct reader (``hpc_mca/checkpoint/reader.py``),
  into tensors already allocated, page cache dropped, alternating, best of ``--loads``: the
  file-reading part of a load alone, against the raw read;
* signal -> durable: a run gets the batch shell's record of the lead-time signal (the
  ``signal_received`` line ``hpc-mca``'s sbatch script writes) and the time until the
  ``latest`` tracker names the new checkpoint is measured from outside, by polling.

Usage:
    .venv/bin/python benchmarks/checkpoint_io.py [--dir DIR] [--layers 6] [--hidden 512]

Use --dir on the file system to measure (default: a temporary directory under /tmp).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "hpc_mca" / "assets" / "demo"
CHUNK = 8 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="work directory (file system)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--loads", type=int, default=2, help="loads per format (best of)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return parser.parse_args()


def make_model(root: Path, layers: int, hidden: int) -> Path:
    """config.json (random init) + the demo's tokenizer."""
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    config = json.loads((DEMO / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=8)
    (model / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, model / name)
    return model


def train(root: Path, model: Path, run_dir: Path, *overrides: str,
          wait: bool = True) -> subprocess.Popen | subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(PYTHONWARNINGS="ignore", HPC_MCA_DIST_TIMEOUT="600")
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "hpc_mca", "train", str(DEMO / "sft_addition.yaml"),
            f"model_name_or_path={model}", f"output_dir={run_dir}", "eval_dataset=null", "eval_steps=null",
            "report_to=none", "use_distributed_optimizer=true", "per_device_train_batch_size=1",
            "sequence_packing=false", "seq_length=16", "logging_steps=1", *overrides]
    if not wait:
        return subprocess.Popen(args, env=env, cwd=root, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    done = subprocess.run(args, env=env, cwd=root, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"training failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_cache(path: Path) -> None:
    """Evict a file's (clean) pages from the page cache so the next read hits the disk."""
    for file in ([path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_io(root: Path, size: int) -> tuple[float, float]:
    """Seconds to write ``size`` bytes sequentially (with fsync) and to read them back."""
    path, block = root / "raw.bin", os.urandom(CHUNK)
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as out:
        out.writelines(block[:min(CHUNK, size - offset)] for offset in range(0, size, CHUNK))
        os.fsync(out.fileno())
    write_s = time.perf_counter() - started
    drop_cache(path)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as src:
        while src.read(CHUNK):
            pass
    read_s = time.perf_counter() - started
    path.unlink()
    return write_s, read_s


def seconds(pattern: str, text: str) -> list[float]:
    return [float(m) for m in re.findall(pattern, text)]


def readers_side_by_side(checkpoint: Path, loads: int) -> dict[str, float]:
    """Seconds to read the whole checkpoint in this process: PyTorch's reader vs the direct one."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hpc_mca.checkpoint.reader import DirectFileSystemReader

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    state = {key: torch.zeros(m.size, dtype=m.properties.dtype)  # zeros: pages already touched
             for key, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    best = {"torch_reader_s": float("inf"), "direct_reader_s": float("inf")}
    for _ in range(loads):
        for name, reader in (("torch_reader_s", FileSystemReader), ("direct_reader_s", DirectFileSystemReader)):
            drop_cache(checkpoint)
            started = time.perf_counter()
            dcp.load(state, storage_reader=reader(str(checkpoint)), no_dist=True)
            best[name] = min(best[name], time.perf_counter() - started)
    return {**best, "tensor_bytes": sum(t.numel() * t.element_size() for t in state.values())}


def signal_to_durable(root: Path, model: Path) -> dict[str, float]:
    """Start a long run, record the signal as the batch shell does after a few steps, and time
    until the tracker names the new checkpoint (polled every 5 ms from here)."""
    run_dir = root / "signal_run"
    proc = train(root, model, run_dir, "max_steps=100000", wait=False)
    steps = run_dir / "steps.jsonl"
    while not (steps.is_file() and len(steps.read_text().splitlines()) >= 3):
        if proc.poll() is not None:
            raise SystemExit(f"training ended early:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    signalled = time.time()
    with open(run_dir / "signal_received", "a") as record:
        record.write(f"USR1 {signalled:.3f} job=benchmark restart=0\n")
    tracker = run_dir / "checkpoints" / "latest"
    while not tracker.is_file():
        time.sleep(0.005)
    durable = time.time() - signalled
    out, _ = proc.communicate(timeout=600)
    step_times = [json.loads(line).get("seconds", 0.0) for line in steps.read_text().splitlines()]
    own = seconds(r"durable ([\d.]+) s after the stop request", out)
    return {"signal_to_durable_s": durable, "trainer_reported_s": own[0] if own else float("nan"),
            "save_s": seconds(r"saved \(signal\) in ([\d.]+) s", out)[0],
            "step_s": sorted(step_times)[len(step_times) // 2]}


def main() -> None:
    args = parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt_io_", dir=args.dir))
    try:
        report = run(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def measure_format(root: Path, model: Path, fmt: str, loads: int = 2, saves: int = 3) -> dict:
    """Saves (the first of a process, then steady ones: best of ``saves``) and loads (best of
    ``loads``, page cache dropped before each) of one optimizer format."""
    run_dir = root / f"run_{fmt}"
    fmt_arg = f"save_optimizer_format={fmt}"
    steps = f"max_steps={saves + 1}"
    saved = train(root, model, run_dir, steps, "save_steps=1", fmt_arg).stdout
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    totals = seconds(r"saved \((?:interval|end)\) in ([\d.]+) s", saved)
    writes = seconds(r"saved \((?:interval|end)\) in [\d.]+ s \(state dict [\d.]+ s, write ([\d.]+) s",
                     saved)
    load_s = []
    for _ in range(loads):
        drop_cache(latest)
        # Without its finished marker the run resumes (loads) at its last step and ends there;
        # with it, the trainer would say "nothing to train" before loading anything.
        (run_dir / "finished").unlink(missing_ok=True)
        loaded = train(root, model, run_dir, steps, fmt_arg).stdout
        load_s.append(seconds(r"resumed from .* in ([\d.]+) s", loaded)[0])
    return {"bytes": tree_bytes(latest), "save_s_first": totals[0], "save_s": min(totals[1:]),
            "write_s": min(writes[1:]), "load_s": min(load_s, default=float("nan")),
            "save_s_all": totals, "load_s_all": load_s}


def run(root: Path, args: argparse.Namespace) -> dict:
    """Every figure is printed as soon as it is measured (raw I/O right after the first
    format, which tells the checkpoint's size: the ratios are then known at once)."""
    model = make_model(root, args.layers, args.hidden)
    first = measure_format(root, model, "model_space", loads=args.loads)
    size = first["bytes"]
    # Best of 3, like the checkpoint figures (the machine may be shared).
    write_s, read_s = (min(x) for x in zip(*(raw_io(root, size) for _ in range(3))))
    raw_write, raw_read = size / 1e9 / write_s, size / 1e9 / read_s
    report: dict = {"filesystem_dir": str(root), "raw_write_GBps": raw_write, "raw_read_GBps": raw_read}
    print(f"raw sequential    {size / 1e6:.0f} MB | write {raw_write:.2f} GB/s, read "
          f"{raw_read:.2f} GB/s", file=sys.stderr, flush=True)
    for fmt in ("model_space", "fully_reshardable", "dp_reshardable"):
        m = first if fmt == "model_space" else measure_format(root, model, fmt, loads=args.loads)
        gb = m["bytes"] / 1e9
        report[fmt] = r = {**m, "save_GBps": gb / m["save_s"], "write_GBps": gb / m["write_s"],
                           "load_GBps": gb / m["load_s"],
                           "save_ratio": gb / m["save_s"] / raw_write,
                           "write_ratio": gb / m["write_s"] / raw_write,
                           "load_ratio": gb / m["load_s"] / raw_read}
        print(f"{fmt:17s} {m['bytes'] / 1e6:.0f} MB | save {r['save_GBps']:.2f} GB/s (ratio "
              f"{r['save_ratio']:.2f}; write phase alone {r['write_ratio']:.2f}; first save "
              f"{m['save_s_first']:.2f} s, then {m['save_s']:.2f} s) | load {r['load_GBps']:.2f} "
              f"GB/s (ratio {r['load_ratio']:.2f}, {m['load_s']:.2f} s)", file=sys.stderr, flush=True)
    ms_dir = root / "run_model_space" / "checkpoints"
    report["readers"] = rd = readers_side_by_side(ms_dir / (ms_dir / "latest").read_text().strip(),
                                                  max(args.loads, 3))
    gb = rd["tensor_bytes"] / 1e9
    print(f"readers, 1 process {gb * 1e3:.0f} MB | PyTorch's {rd['torch_reader_s']:.2f} s (ratio "
          f"{gb / rd['torch_reader_s'] / raw_read:.2f}), direct {rd['direct_reader_s']:.2f} s (ratio "
          f"{gb / rd['direct_reader_s'] / raw_read:.2f}) | direct/PyTorch speed "
          f"{rd['torch_reader_s'] / rd['direct_reader_s']:.2f}x", file=sys.stderr, flush=True)
    report["signal"] = sig = signal_to_durable(root, model)
    print(f"signal -> durable {sig['signal_to_durable_s']:.2f} s (median step {sig['step_s']:.2f} s, "
          f"save {sig['save_s']:.2f} s)", file=sys.stderr, flush=True)
    return report


if __name__ == "__main__":  # dist_checkpointing's spawn helper re-imports the entry module
    main()
