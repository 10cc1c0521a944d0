"""Faults on the real local Slurm cluster (2-node training jobs, CPU):

* one of each fault of the campaign (tests/fault_campaign.py; benchmarks/fault_campaign.py
  runs ten of each): an outside requeue, the lead-time signal, a SIGKILLed rank at a random
  moment and inside a save — every run ends with the uninterrupted run's numbers exactly,
  and no process of the job outlives it by more than 5 s;
* bad input (a truncated jsonl line, token ids beyond the model's vocabulary, a missing file,
  an attention backend this machine does not have) on 2 and 4 ranks with a budget of 3 requeues:
  never requeued, exit 2, and ``status`` names the cause, whatever srun made of the other ranks' exit codes;
* a full disk: one line naming the directory and the bytes, no partial checkpoint left, no
  requeue loop; once there is room the run continues from its last checkpoint exactly;
* ``hpc-mca resume JOBID --nodes 1`` of the demo keeps the global batch, re-derives the
  gradient accumulation and says so.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import fault_campaign as campaign
import pytest
import slurm_cluster as slurm
from trainer_fixtures import make_model_dir, make_sft_data, run_train, steps, write_config

from hpc_mca.checkpoint.space import tree_bytes
from hpc_mca.checkpoint.store import read_tracker

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
HPC_MCA = str(Path(sys.executable).with_name("hpc-mca"))
DEMO = REPO / "hpc_mca" / "assets" / "demo" / "sft_addition.yaml"


@pytest.fixture(scope="module")
def setup(slurm_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("faults")
    config, reference = campaign.prepare(root)
    return {"root": root, "config": config, "reference": reference}


def _sbatch(work: Path, name: str, tasks_per_node: int, config: Path, **env_extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    # HPC_MCA_PLAN=given: the ranks' own bad-input lines and a reference run without a plan
    # (the job-start planner's refusals: tests/test_sbatch_plan.py).
    env.update(HPC_MCA_HOME=str(REPO), PYTHONWARNINGS="ignore", HPC_MCA_DIST_TIMEOUT="120",
               HPC_MCA_RUNS_ROOT=str(work / "runs"), HPC_MCA_PLAN="given", **env_extra)
    done = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", "--nodes=2",
                           f"--ntasks-per-node={tasks_per_node}", "--time=10",
                           f"--output={work}/%x_%j.out", f"--chdir={work}",
                           str(campaign.TEMPLATE), str(config)],
                          env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip().split(";")[0]


@pytest.mark.parametrize("kind", campaign.KINDS)
def test_a_fault_leaves_the_run_exact_and_no_process_behind(setup: dict, kind: str) -> None:
    work = setup["root"] / f"campaign_{kind}"
    t = campaign.trial(kind, setup["config"], setup["reference"], work, random.Random())
    print(f"\n{t.kind}: job {t.job_id} {t.detail} at step {t.fault_step}\n"
          + campaign.table([t]))
    assert t.state == "COMPLETED" and t.equal, t
    assert t.restarts >= 1 and t.resume_s is not None, t
    assert t.orphans_s <= 5, t


BAD_INPUTS = {
    "truncated": "train.jsonl:{line}: ",
    "vocab": "tokens but the model's vocab_size is 16 (ids from 16 on have no embedding)",
    "missing": "data.dataset: dataset file",
    "empty": "yields no trainable samples",
    "backend": "model.attention_backend='te' is not available here",
    # Megatron-Core's own config check, run before the process group (it used to raise after
    # tokenizing: a traceback, exit 1, requeued)
    "megatron": "Megatron-Core refuses these settings: Using parallel.recompute_granularity: "
                "full so parallel.recompute_method must be",
}


def _bad_config(root: Path, kind: str) -> tuple[Path, str]:
    """A config with one kind of bad input; returns it and the line its job must report."""
    work = root / kind
    work.mkdir()
    data = make_sft_data(work, 64, seed=2, name="train")
    if kind == "truncated":
        lines = data.read_text().splitlines()
        data.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2] + "\n")
        expected = BAD_INPUTS[kind].format(line=len(lines))
    elif kind == "empty":
        data.write_text("")
        expected = BAD_INPUTS[kind]
    else:
        expected = BAD_INPUTS[kind]
    model = make_model_dir(work, layers=2, **({"vocab_size": 16} if kind == "vocab" else {}))
    if kind == "missing":
        data = work / "gone.jsonl"
    extra = {"backend": {"model": {"attention_backend": "te"}},
             "megatron": {"parallel": {"recompute_granularity": "full",
                                       "recompute_num_layers": 1}}}.get(kind, {})
    return write_config(work, model, data, training={"max_steps": 4}, **extra), expected


def test_bad_input_is_never_requeued_and_status_names_it(setup: dict) -> None:
    root = setup["root"] / "bad"
    root.mkdir()
    jobs = {}
    for kind in BAD_INPUTS:
        config, expected = _bad_config(root, kind)
        # 2 ranks for every kind, 4 for one of each origin: a file every rank reads (missing)
        # and data only rank 0 tokenizes (truncated). tests/test_trainer_features.py runs the
        # data kinds on 2 and 4 ranks without Slurm.
        for per_node in (1, 2) if kind in ("missing", "truncated") else (1,):
            job_id = _sbatch(root, f"bad_{kind}", per_node, config, HPC_MCA_MAX_REQUEUES="3")
            jobs[job_id] = (kind, per_node, expected)
    for job_id, (kind, per_node, expected) in jobs.items():
        assert slurm.wait_for_job(job_id, timeout=300) == "FAILED", (kind, per_node)
        records = slurm.job_records(job_id)
        assert slurm.job_restart_count(job_id) == 0 and records[-1].exit_code == "2:0", records
        log = (root / f"bad_{kind}_{job_id}.out").read_text()
        # Every rank stopped on it; one line says why (rank 0's), no rank crashed on the way.
        errors = [line for line in log.splitlines() if line.startswith("hpc-mca train: error")]
        assert len(errors) == 1 and expected in errors[0], (kind, per_node, log[-3000:])
        assert "Traceback" not in log, (kind, per_node, log[-3000:])
        end = [line for line in log.splitlines() if line.startswith("hpc-mca | end")]
        assert len(end) == 1 and "bad input, not requeued: " in end[0], log[-3000:]
        assert expected in end[0], (kind, end[0])
        # From anywhere: the job index finds the raw template's run, status names the cause.
        shown = subprocess.run([HPC_MCA, "status", job_id], capture_output=True, text=True,
                               cwd="/", timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert re.search(rf"^  bad input   .*{re.escape(expected)}.* \(not requeued\)$",
                         shown.stdout, re.M), shown.stdout


@pytest.fixture
def tmpfs(tmp_path: Path):
    point = tmp_path / "small_disk"
    point.mkdir()
    yield point
    subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_full_disk_stops_the_job_once_and_the_run_resumes_exactly(setup: dict,
                                                                    tmpfs: Path) -> None:
    """Runs root on a tmpfs with room for one checkpoint of the run, not two."""
    size = tree_bytes(setup["root"] / "reference" / "checkpoints" / "iter_0000005")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.6) + 400_000}", "tmpfs",
                    str(tmpfs)], check=True)
    job_id = _sbatch(tmpfs, "full", 1, setup["config"], HPC_MCA_MAX_REQUEUES="3")
    assert slurm.wait_for_job(job_id, timeout=300) == "FAILED"
    run_dir = tmpfs / "runs" / f"full_{job_id}"
    root = run_dir / "checkpoints"
    assert slurm.job_restart_count(job_id) == 0
    log = (tmpfs / f"full_{job_id}.out").read_text()
    errors = [line for line in log.splitlines() if line.startswith("hpc-mca train: error")]
    assert errors and all(f"checkpoint iter_0000010 does not fit: {root} needs about " in line
                          and "the last good checkpoint is iter_0000005" in line
                          for line in errors), log[-3000:]
    assert "bad input, not requeued: checkpoint iter_0000010 does not fit" in log
    assert read_tracker(root) == "iter_0000005" and not list(root.glob("*.tmp"))
    # Room again: the same job script on the same run directory continues from step 5.
    subprocess.run(["mount", "-o", "remount,size=64m", str(tmpfs)], check=True)
    again = _sbatch(tmpfs, "full", 1, setup["config"], HPC_MCA_RUN_DIR=str(run_dir))
    assert slurm.wait_for_job(again, timeout=300) == "COMPLETED"
    assert "at step 5 (40 samples)" in (tmpfs / f"full_{again}.out").read_text()
    assert campaign.numbers(run_dir) == setup["reference"]


def test_resume_on_one_node_keeps_the_global_batch(setup: dict) -> None:
    work = setup["root"] / "one_node"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    env.update(PYTHONPATH=str(campaign.HOOKS), PYTHONWARNINGS="ignore",
               HPC_MCA_TEST_STEP_SLEEP="0.2", HPC_MCA_MAX_REQUEUES="0",
               HPC_MCA_RUNS_ROOT=str(work / "runs"))
    # The demo config says gradient_accumulation_steps: 1 (for its 2 ranks).
    overrides = ["max_steps=40", "eval_dataset=null", "eval_steps=null", "logging_steps=10", "save_steps=5"]

    def hpc_mca(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([HPC_MCA, *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=180)

    done = hpc_mca("submit", str(DEMO), "--gpu", "CPU", "--nodes", "2", "--gpus-per-node", "1",
                   *overrides)
    first = slurm.submitted_job_id(done)
    run_dir = work / "runs" / f"sft_addition_{first}"
    resolved = json.loads((run_dir / "manifest.json").read_text())["resolved_overrides"]
    deadline = time.monotonic() + 240
    while not ((run_dir / "steps.jsonl").is_file()
               and len((run_dir / "steps.jsonl").read_text().splitlines()) >= 25):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", first], check=True)
    assert slurm.wait_for_job(first, timeout=120) == "FAILED"  # stopped, no budget: exit 75
    done = hpc_mca("resume", first, "--nodes", "1")
    second = slurm.submitted_job_id(done)
    assert slurm.wait_for_job(second, timeout=300) == "COMPLETED"
    log = (run_dir / f"sft_addition_{second}.out").read_text()
    resumed = next(line for line in log.splitlines() if line.startswith("resumed from"))
    assert "layout changed: dp 2->1, world_size 2->1" in resumed, resumed
    assert "global batch 8 kept: gradient_accumulation_steps 1->2" in resumed, resumed
    # The reference: the same settings the jobs got, 2 ranks, no interruption.
    proc = run_train(DEMO, work / "reference", 2, *resolved)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = steps(run_dir), steps(work / "reference")
    assert [s["step"] for s in got] == list(range(1, 41))
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want))
    assert worst <= 1e-5, worst
    print(f"\n{resumed}\nmax |loss - uninterrupted 2-rank run| {worst:.1e}")
