"""``hpc-mca resume`` on the real local Slurm cluster: a 2-node TP=2×DP=2 run continued on 1 node
with TP=1×DP=2, then with DP=1, equals an uninterrupted run (1e-5); bad input submits nothing.

Each job is stopped by the lead-time signal sent by hand (``scancel --signal=USR1 --batch``)
with no requeue budget (HPC_MCA_MAX_REQUEUES=0), so it saves and ends, ready to be resumed
elsewhere. The test hook (tests/checkpoint_hooks) paces the steps so the stop lands mid-run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster as slurm
from trainer_fixtures import (
    make_model_dir,
    make_sft_data,
    run_train,
    steps,
    write_config,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HPC_MCA = str(Path(sys.executable).with_name("hpc-mca"))
HOOKS = Path(__file__).with_name("checkpoint_hooks")
MAX_STEPS = 12


def hpc_mca(*args: str, cwd: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    env.update(PYTHONPATH=str(HOOKS), HPC_MCA_TEST_STEP_SLEEP="0.3", HPC_MCA_MAX_REQUEUES="0",
               PYTHONWARNINGS="ignore", **extra)
    return subprocess.run([HPC_MCA, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def stop_after(job_id: str, run_dir: Path, step: int) -> None:
    """Send the lead-time signal once ``step`` steps are logged; the job saves and ends."""
    path, deadline = run_dir / "steps.jsonl", time.monotonic() + 240
    while not (path.is_file() and len(path.read_text().splitlines()) >= step):
        assert time.monotonic() < deadline, f"job {job_id} did not reach step {step}"
        assert slurm.job_state(job_id) not in slurm.TERMINAL_STATES, f"job {job_id} ended early"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    assert slurm.wait_for_job(job_id, timeout=120) == "FAILED"  # exit 75: stopped, not requeued


def queued() -> str:
    return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True,
                          check=True).stdout


@pytest.fixture(scope="module")
def setup(slurm_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("resume")
    config = write_config(root, make_model_dir(root, layers=2),
                          make_sft_data(root, 256, seed=1, name="train"),
                          training={"max_steps": MAX_STEPS, "logging_steps": 1,
                                    "report_to": ["none"]},
                          # The planner turns sequence parallelism on with TP>1, which the
                          # local (non-TE) layer spec on CPU does not support.
                          parallel={"sequence_parallel": False})
    proc = run_train(config, root / "reference", 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "config": config, "reference": steps(root / "reference")}


def test_resume_on_other_node_counts_and_layouts(setup: dict) -> None:
    root, config = setup["root"], setup["config"]
    runs = ["--runs-root", str(root / "runs")]
    first = slurm.submitted_job_id(hpc_mca("submit", str(config), "--gpu", "CPU", "--nodes", "2",
                              "--gpus-per-node", "2", "--tp", "2", *runs, cwd=root))
    run_dir = root / "runs" / f"config_{first}"
    stop_after(first, run_dir, 3)
    done = hpc_mca("resume", first, "--nodes", "1", "--tp", "1", *runs, cwd=root)
    second = slurm.submitted_job_id(done)
    assert "on 1 node(s) × 2 CPU" in done.stdout and "TP1" in done.stdout, done.stdout
    stop_after(second, run_dir, 7)
    third = slurm.submitted_job_id(hpc_mca("resume", second, "--nodes", "1", "--gpus-per-node",
                                           "1", *runs, cwd=root))
    assert slurm.wait_for_job(third, timeout=240) == "COMPLETED"

    logs = {job: (run_dir / f"config_{job}.out").read_text() for job in (first, second, third)}
    resumed = [next(line for line in logs[job].splitlines() if line.startswith("resumed from"))
               for job in (second, third)]
    assert "layout changed: tp 2->1, world_size 4->2" in resumed[0], resumed[0]
    assert "layout changed: dp 2->1, world_size 2->1" in resumed[1], resumed[1]
    got, want = steps(run_dir), setup["reference"]
    assert [s["step"] for s in got] == list(range(1, MAX_STEPS + 1))
    print(f"\nmax |loss - reference| over {MAX_STEPS} steps: "
          f"{max(abs(a['loss'] - b['loss']) for a, b in zip(got, want)):.2e}")
    for mine, ref in zip(got, want):
        assert mine["tokens"] == ref["tokens"]
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-5), (mine, ref)
        assert mine["lr"] == pytest.approx(ref["lr"], rel=1e-9)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["job_ids"] == [second, third]
    assert [c["world_size"] for c in manifest["continuations"]] == [2, 1]
    assert (run_dir / "finished").is_file()
    print("\n" + "\n".join(resumed))
    # A finished run continues only when it is extended.
    done = hpc_mca("resume", third, *runs, cwd=root)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"Error: run {run_dir} finished at step {MAX_STEPS}; nothing to resume; valid: extend it "
        f"with max_steps=N (N > {MAX_STEPS}) or num_train_epochs=E, e.g. hpc-mca resume {third} "
        f"max_steps={2 * MAX_STEPS}")


def test_bad_input_submits_and_deletes_nothing(setup: dict) -> None:
    root, config = setup["root"], setup["config"]
    runs = root / "bad_runs"
    # A run whose job ended before its first checkpoint (a manifest, no checkpoints/).
    empty = runs / "config_999998"
    empty.mkdir(parents=True)
    (empty / "manifest.json").write_text(json.dumps({"version": 1, "job_id": "999998",
                                                     "job_name": "config", "config": str(config)}))
    # A run with a checkpoint (copied from the reference run), for layouts that cannot load it.
    ckpt = runs / "config_999999"
    subprocess.run(["cp", "-r", str(root / "reference"), str(ckpt)], check=True)
    (ckpt / "finished").unlink()
    (ckpt / "manifest.json").write_text(json.dumps({
        "version": 1, "job_id": "999999", "job_name": "config", "config": str(config),
        "plan": {"request": {"nodes": 1, "gpus_per_node": 1, "gpu": "CPU", "stage": "sft"}}}))
    before = {p: p.stat().st_mtime for p in runs.rglob("*")}
    jobs = queued()
    cases = {
        "123456789": "Error: no run found for job 123456789",
        "999998": f"Error: run {empty} has no checkpoint to resume from",
        "999999 --distributed-optimizer --nodes 2": "Error: cannot resume from",
        "999999 --tp 3": "Error: ",
        "999999 global_batch_size=16": "Error: cannot resume from",
        "999999 --time 1 --signal-lead 120": "Error: --signal-lead 120 s does not fit --time 1",
    }
    for args, message in cases.items():
        done = hpc_mca("resume", *args.split(), "--runs-root", str(runs), cwd=root)
        assert done.returncode != 0 and done.stdout == "", (args, done.stdout)
        assert len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)
        assert done.stderr.startswith(message), (args, done.stderr)
    assert queued() == jobs
    assert {p: p.stat().st_mtime for p in runs.rglob("*")} == before
    # A login-node command: no torch, even when it gets as far as the checkpoint check.
    probe = ("import sys\nfrom hpc_mca.cli import main\ntry:\n    main()\nexcept SystemExit:\n"
             "    pass\nassert 'torch' not in sys.modules, 'resume imported torch'")
    done = subprocess.run([sys.executable, "-c", probe, "resume", "999999", "--dry-run",
                           "--runs-root", str(runs)], capture_output=True, text=True, cwd=root,
                          check=False)
    assert done.returncode == 0 and "# would continue run" in done.stdout, done.stderr
    done = hpc_mca("resume", "999999", "--nodes", "2", "--dry-run", "--runs-root", str(runs),
                   cwd=root)
    assert done.returncode == 0 and "# would continue run" in done.stdout, done.stderr
    assert f"HPC_MCA_RUN_DIR=${{HPC_MCA_RUN_DIR:-{ckpt}}}" in done.stdout
    assert f"#SBATCH --output={ckpt}/%x_%j.out" in done.stdout
    # A shorter limit gets a default lead scaled to it; a lead given for the new job is kept.
    for args, lead in ((["--time", "2"], 30), (["--time", "2", "--signal-lead", "45"], 45)):
        done = hpc_mca("resume", "999999", *args, "--dry-run", "--runs-root", str(runs), cwd=root)
        assert done.returncode == 0 and f"#SBATCH --signal=B:USR1@{lead}\n" in done.stdout
    # A run of the raw template (no manifest naming a config): its resolved_config.yaml.
    raw = runs / "config_999997"
    subprocess.run(["cp", "-r", str(ckpt), str(raw)], check=True)
    (raw / "manifest.json").write_text(json.dumps({"version": 1, "job_id": "999997"}))
    done = hpc_mca("resume", "999997", "--gpu", "CPU", "--nodes", "2", "--gpus-per-node", "1",
                   "--dry-run", "--runs-root", str(runs), cwd=root)
    assert done.returncode == 0, done.stderr
    assert f"set -- {raw}/resolved_config.yaml data_parallel_size=null" in done.stdout
