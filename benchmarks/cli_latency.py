"""Wall time of login-node commands next to a bare Python start-up.

Times, as fresh processes (what a user waits for), the median of ``--repeat`` runs of:

* ``python -c pass`` -- the floor: interpreter start-up;
* ``python -c "import torch"`` -- what every command would pay if it imported torch
  (skipped with ``--no-torch``);
* ``hpc-mca --help``;
* ``hpc-mca plan`` over a Llama-3-8B-shaped config on 16 H100s (seq 16384, TP4 PP2 CP2);
* ``hpc-mca plan`` over a run config (the demo, or a generated one), as submit plans it;
* ``hpc-mca plan --sbatch`` (the same, rendering the batch script too);
* ``hpc-mca plan`` searching a layout: Llama-3-8B on 16 H100s (seq 16384) and
  Qwen3-235B-A22B on 256 H100s (seq 4096, global batch 2048), the largest search we plan.

Each line gives seconds and the ratio to ``python -c pass``. Nothing is submitted. The
commands run with bytecode caching on (PYTHONDONTWRITEBYTECODE removed; the untimed warm-up
run writes the caches), as on a login node. Then the same two searches in this process
(``topology.plan()``, best of ``--repeat``, first call untimed): the planner alone, without
interpreter start-up and imports. Issue #43's targets: ``--help`` under 0.1 s, any plan at
most 0.3 s and a dense plan at most 0.15 s on the 2-core login machine. The load average is
printed with the table: on a shared machine, compare runs at similar load.

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
QWEN3_235B_A22B = {"model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
                   "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
                   "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
                   "moe_intermediate_size": 1536, "num_experts_per_tok": 8}
# (label, model directory name, nodes, seq_length, global_batch_size) of the searched plans.
SEARCHES = [("llama3-8b 16xH100 seq 16384", "llama3-8b", 2, 16384, 512),
            ("qwen3-235b-a22b 256xH100 seq 4096", "qwen3-235b", 32, 4096, 2048)]


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
    for name, config in (("llama3-8b", LLAMA3_8B), ("qwen3-235b", QWEN3_235B_A22B)):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
    model = tmp / "llama3-8b"
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
    out += [(f"hpc-mca plan --model {label} (searched)",
             [HPC_MCA, "plan", "--model", str(tmp / name), "--nodes", str(nodes),
              "--seq-length", str(seq), "--global-batch-size", str(gbs)])
            for label, name, nodes, seq, gbs in SEARCHES]
    return out


def in_process(tmp: Path, repeat: int) -> list[tuple[str, float]]:
    """Best-of-``repeat`` seconds of each searched plan as a plain ``plan()`` call."""
    from hpc_mca.topology import plan

    rows = []
    for label, name, nodes, seq, gbs in SEARCHES:
        job = dict(model=tmp / name, nodes=nodes, seq_length=seq, global_batch_size=gbs)
        plan(**job)  # untimed: imports and the config file read
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            plan(**job)
            times.append(time.perf_counter() - start)
        rows.append((f"plan() {label}", min(times)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-torch", action="store_true", help="skip the import-torch line")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        named = commands(Path(tmp), not args.no_torch)
        rows = list(zip([name for name, _ in named],
                        walls([argv for _, argv in named], args.repeat)))
        planned = in_process(Path(tmp), args.repeat)
    base = rows[0][1]
    width = max(len(name) for name, _ in rows + planned)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    print(f"{'command':<{width}}  {'median s':>9}  {'x python':>8}   ({args.repeat} runs each)")
    for name, seconds in rows:
        print(f"{name:<{width}}  {seconds:9.3f}  {seconds / base:8.1f}")
    print(f"{'in this process':<{width}}  {'best s':>9}")
    for name, seconds in planned:
        print(f"{name:<{width}}  {seconds:9.3f}")


if __name__ == "__main__":
    main()
