"""Wall time of login-node commands next to a bare Python start-up.

Times, as fresh processes (what a user waits for), the median of ``--repeat`` runs of:

* ``python -c pass`` -- the floor: interpreter start-up;
* ``python -c "import torch"`` -- what every command would pay if it imported torch
  (skipped with ``--no-torch``);
* ``hpc-mca --help``;
* ``hpc-mca plan`` over a Llama-3-8B-shaped config on 16 H100s (seq 16384, TP4 PP2 CP2);
* ``hpc-mca plan`` over a run config (the demo, or a generated one), as submit plans it;
* ``hpc-mca plan --sbatch`` (the same, rendering the batch script too).

Each line gives seconds and the ratio to ``python -c pass``. Nothing is submitted. The
commands run with bytecode caching on (PYTHONDONTWRITEBYTECODE removed; the untimed warm-up
run writes the caches), as on a login node.

Usage:
    .venv/bin/python benchmarks/cli_latency.py [--repeat 7] [--no-torch]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HPC_MCA = str(Path(sys.executable).with_name("hpc-mca"))
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256}


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def walls(argvs: list[list[str]], repeat: int) -> list[float]:
    """Median wall time of each command as a fresh process. The commands take turns (round
    robin) so that a change in machine load hits all of them alike; one untimed warm-up run
    of each comes first."""
    for argv in argvs:
        subprocess.run(argv, capture_output=True, check=True, env=ENV)
    times: list[list[float]] = [[] for _ in argvs]
    for _ in range(repeat):
        for argv, out in zip(argvs, times):
            start = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True, env=ENV)
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def commands(tmp: Path, with_torch: bool) -> list[tuple[str, list[str]]]:
    model = tmp / "llama3-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    demo = REPO / "hpc_mca" / "assets" / "demo" / "sft_addition.yaml"
    if not demo.is_file():
        demo = tmp / "run.yaml"
        demo.write_text(f"model_name_or_path: {model}\ndataset: d.jsonl\ncutoff_len: 4096\n"
                        "global_batch_size: 64\nbf16: true\n")
    cpu = ["--gpu", "CPU", "--nodes", "2", "--gpus-per-node", "2"]
    out = [("python -c pass", [sys.executable, "-c", "pass"])]
    if with_torch:
        out.append(("python -c 'import torch'", [sys.executable, "-c", "import torch"]))
    out += [
        ("hpc-mca --help", [HPC_MCA, "--help"]),
        ("hpc-mca plan --model llama3-8b (16xH100 TP4 PP2 CP2)",
         [HPC_MCA, "plan", "--model", str(model), "--nodes", "2", "--seq-length", "16384",
          "--global-batch-size", "64", "--tp", "4", "--pp", "2", "--cp", "2"]),
        (f"hpc-mca plan {demo.name} (run config)", [HPC_MCA, "plan", str(demo), *cpu]),
        (f"hpc-mca plan {demo.name} --sbatch", [HPC_MCA, "plan", str(demo), *cpu, "--sbatch",
                                                 "--runs-root", str(tmp / "runs")]),
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-torch", action="store_true", help="skip the import-torch line")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        named = commands(Path(tmp), not args.no_torch)
        rows = list(zip([name for name, _ in named],
                        walls([argv for _, argv in named], args.repeat)))
    base = rows[0][1]
    width = max(len(name) for name, _ in rows)
    print(f"{'command':<{width}}  {'median s':>9}  {'x python':>8}   ({args.repeat} runs each)")
    for name, seconds in rows:
        print(f"{name:<{width}}  {seconds:9.3f}  {seconds / base:8.1f}")


if __name__ == "__main__":
    main()
