"""Shared set-up for trainer tests: a tiny HF Llama with weights, the demo tokenizer, SFT data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
FORKRUN = [sys.executable, "-m", "hpc_mca.cli.forkrun"]
"""Local ranks forked after one import of the stack (hpc_mca/runtime/forkrun.py): a rank's
imports cost ~10 s of CPU here, which torchrun pays once per rank."""


def make_model_dir(root: Path, layers: int = 4, moe: bool = False, **shape: int) -> Path:
    """A random-weight Llama (GQA) — or a Qwen3-MoE with 4 experts, top-2 — saved with
    save_pretrained, plus the demo's tokenizer; ``shape`` overrides config fields."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hpc_mca.assets.demo.make_demo import build_tokenizer, tokenizer_config

    model_dir = root / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "tokenizer.json").write_text(build_tokenizer().to_str())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)
    common.update(shape)
    torch.manual_seed(0)
    if moe:
        config = Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, router_aux_loss_coef=0.01)
        Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    else:
        LlamaForCausalLM(LlamaConfig(**common)).save_pretrained(model_dir)
    return model_dir


def run_jobs(worker: Path, models: Path, out: Path, jobs: list[dict], nproc: int) -> Path:
    """``worker MODELS OUT JOBS_JSON`` on ``nproc`` ranks (tests/models_worker.py's protocol,
    also tests/mtp_worker.py's); asserts it succeeded and returns ``out``."""
    proc = run_ranks(nproc, [worker, models, out, json.dumps(jobs)], timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def make_family_dir(model_dir: Path, name: str) -> Path:
    """tests/test_models.py's tiny ``name`` config (qwen2_moe, glm4_moe, deepseek_v3, ...) on
    the demo tokenizer's vocabulary, with transformers' own initialisation (seeded), saved with
    save_pretrained; made once per directory."""
    import torch
    import transformers
    from test_models import COMMON, FAMILIES
    from transformers import AutoTokenizer

    from hpc_mca.assets.demo.make_demo import build_tokenizer, tokenizer_config

    if (model_dir / "config.json").exists():
        return model_dir
    model_dir.mkdir(parents=True)
    (model_dir / "tokenizer.json").write_text(build_tokenizer().to_str())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    config_class, overrides = FAMILIES[name]
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    config = getattr(transformers, config_class)(**{**COMMON, **overrides, "vocab_size": vocab})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    return model_dir


CONFIG_ONLY_LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64,
                     "num_attention_heads": 4, "num_key_value_heads": 4,
                     "intermediate_size": 128, "vocab_size": 100}
"""config.json of a config-only model, for config rules that read the model's shape."""


def config_only_run(root: Path, **settings) -> Path:
    """``root`` with a config-only model, one sft record and ``run.yaml`` naming both by
    relative paths (plus ``settings``); returns ``root``."""
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(CONFIG_ONLY_LLAMA))
    (root / "train.jsonl").write_text('{"instruction": "1+1=", "output": "2"}\n')
    (root / "run.yaml").write_text(yaml.safe_dump({
        "model_name_or_path": "model", "dataset": "train.jsonl", "stage": "sft",
        "output_dir": str(root / "out"), "max_steps": 10, **settings}))
    return root


def make_sft_data(root: Path, count: int, seed: int, name: str) -> Path:
    from hpc_mca.data.addition import alpaca_record, make_problems

    path = root / f"{name}.jsonl"
    with path.open("w") as out:
        for a, b in make_problems(count, seed=seed, max_digits=3):
            out.write(json.dumps(alpaca_record(a, b)) + "\n")
    return path


def write_pairs(path: Path, count: int, seed: int) -> Path:
    """Addition preference pairs (chosen: the sum, rejected: a near miss) as alpaca jsonl."""
    from hpc_mca.data.addition import make_problems, preference_record

    path.write_text("".join(json.dumps(preference_record(a, b)) + "\n"
                            for a, b in make_problems(count, seed=seed)))
    return path


def write_config(root: Path, model_dir: Path, train: Path, evaluation: Path | None = None, **sections) -> Path:
    config = {
        "model": {"model_name_or_path": str(model_dir)},
        "data": {"dataset": [str(train)], "cutoff_len": 32},
        "finetuning": {"stage": "sft"},
        "training": {"output_dir": str(root / "run"), "per_device_train_batch_size": 2,
                     "global_batch_size": 8, "learning_rate": 1e-3, "lr_scheduler_type": "cosine",
                     "warmup_steps": 2, "max_steps": 10, "logging_steps": 5, "seed": 7},
    }
    if evaluation is not None:
        config["data"]["eval_dataset"] = [str(evaluation)]
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def rank_env() -> dict[str, str]:
    """This environment without any launcher's rank variables (Slurm's, torchrun's), and one
    thread per process unless OMP_NUM_THREADS says otherwise: as forkrun gives each of several
    ranks, and now a single rank too. The test models' operations are too small for intra-op
    threads to help: two threads of a one-rank run on the 2-core VM spun on each other's
    barriers, measured 5-20 times the step time of one thread (beside the Slurm lane and
    other ranks) for the same numbers to the bit."""
    launcher = ("SLURM_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env.update(HPC_MCA_DIST_TIMEOUT="120", PYTHONWARNINGS="ignore")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_ranks(nproc: int, args: list[str], *, env: dict[str, str] | None = None,
              timeout: float = 600, launcher: bool | None = None) -> subprocess.CompletedProcess:
    """``hpc-mca ARGS`` (or ``python SCRIPT.py ARGS``) on ``nproc`` local ranks with ``env``
    (default: :func:`rank_env`), forked from the session's warm launcher
    (tests/warm_launcher.py), or started fresh where it cannot serve ``env``. The ranks get
    torchrun's variables from forkrun's launcher (test_rank_bootstrap.py shows it gives
    torchrun's numbers) when there are several, or ``launcher`` says so for one; a single
    process without them is a local run, as ``python -m hpc_mca`` is."""
    import warm_launcher

    env = rank_env() if env is None else env
    launcher = nproc > 1 if launcher is None else launcher
    done = warm_launcher.run(args, nproc, env, launcher=launcher, timeout=timeout)
    if done is not None:
        return done
    if launcher:
        command = FORKRUN + [f"--nproc-per-node={nproc}"]
    else:
        command = [sys.executable] + ([] if str(args[0]).endswith(".py") else ["-m", "hpc_mca"])
    return subprocess.run([*command, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_train(config: Path, run_dir: Path, nproc: int = 1, *overrides: str,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """``hpc-mca train CONFIG`` writing ``run_dir`` on ``nproc`` local ranks (:func:`run_ranks`)."""
    return run_ranks(nproc, ["train", str(config), f"training.output_dir={run_dir}", *overrides],
                     timeout=timeout)


def launch_ranks(nproc: int, args: list[str], timeout: int = 300,
                 extra_env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """``python -m hpc_mca ARGS`` as ``nproc`` ranks started directly with torchrun's variables
    (RANK, WORLD_SIZE, MASTER_ADDR/PORT), each run to its own end. Unlike torchrun, whose
    agent terminates the other workers as soon as one exits non-zero, nothing here kills a
    rank, so a test can assert what every rank did and printed (e.g. that each rank reports a
    bad input alone). Only for runs that end without waiting on each other (errors before the
    process group), or every rank gets to a rendezvous."""
    import warm_launcher

    from hpc_mca.runtime.env import free_port

    env = {**rank_env(), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(extra_env or {})}
    envs = [{**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(nproc)]
    procs = [warm_launcher.start(args, 1, rank_vars, launcher=False) for rank_vars in envs]
    if None in procs:  # not served warm: fresh interpreters
        for proc in procs:
            if proc is not None:
                proc.kill()
        procs = [subprocess.Popen([sys.executable, "-m", "hpc_mca", *args], env=rank_vars,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank_vars in envs]
    results = []
    for proc in procs:
        try:
            if isinstance(proc, subprocess.Popen):
                out, err = proc.communicate(timeout=timeout)
                results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
            else:
                results.append(proc.wait(timeout))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
    return results


def assert_bad_input_on_every_rank(ranks: list[subprocess.CompletedProcess], message: str) -> str:
    """Every rank exited 2 (bad input: never requeued); global rank 0 printed the one line,
    which names ``message``; the others exited quietly. Returns the line."""
    errors = [[line for line in rank.stderr.splitlines() if line.startswith("hpc-mca train: error")]
              for rank in ranks]
    for number, (rank, lines) in enumerate(zip(ranks, errors)):
        assert rank.returncode == 2, (number, rank.returncode, rank.stderr[-3000:])
        assert len(lines) == (1 if number == 0 else 0), (number, rank.stderr[-3000:])
        assert "Traceback" not in rank.stderr, (number, rank.stderr[-3000:])
    assert message in errors[0][0], errors[0][0]
    return errors[0][0]


def write_indexed(prefix: Path, documents: list[list[int]]) -> None:
    """A Megatron .bin/.idx corpus at ``prefix``, one document per list of token ids."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for doc in documents:
        builder.add_item(torch.tensor(doc, dtype=torch.int32))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


PROBE_WORKER = Path(__file__).with_name("probe_worker.py")
CURVE_KEYS = ("loss", "grad_norm", "lr", "tokens")


def probe_run(config: Path, run: Path, nproc: int, *overrides: str) -> list[dict]:
    """``hpc-mca train`` with the forward-call probe (tests/probe_worker.py); each rank's
    record (forward calls per decoder layer and the parts it counts, local expert shapes)."""
    out = run.with_name(f"{run.name}_probe")
    proc = run_ranks(nproc, [PROBE_WORKER, out, config, f"training.output_dir={run}", *overrides])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def same_curve(got: list[dict], want: list[dict], tol: float, what: str) -> None:
    """The two runs' steps.jsonl records agree on every step's loss, grad norm, lr and token
    count within ``tol``."""
    import pytest

    assert [s["step"] for s in got] == [s["step"] for s in want], what
    for mine, ref in zip(got, want):
        for key in CURVE_KEYS:
            assert mine[key] == pytest.approx(ref[key], abs=tol), (what, key, mine, ref)


def steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def rewind(src: Path, dst: Path, step: int) -> Path:
    """A copy of run ``src`` as if it had died right after the checkpoint of ``step``."""
    import shutil

    from hpc_mca.checkpoint.store import complete_checkpoints, iter_name, write_tracker

    shutil.copytree(src, dst)
    (dst / "finished").unlink()
    root = dst / "checkpoints"
    for found, path in complete_checkpoints(root):
        if found > step:
            shutil.rmtree(path)
    write_tracker(root, iter_name(step))
    return dst


def processes_with_env(entry: str) -> dict[int, str]:
    """Live (not zombie) processes whose environment holds ``entry`` (``NAME=value``), as
    pid -> the start of their command line."""
    needle = entry.encode()
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # exited, not yet reaped
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ")[:120]
            found[int(proc.name)] = command.decode(errors="replace")
        except (OSError, IndexError):
            pass
    return found
