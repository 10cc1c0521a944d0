"""The raw template plans its own layout at job start (hpc_mca/slurm/startplan.py, issue #41).

* Fast: the job-start planner (``hpc-mca plan --at-job-start`` in the batch shell) gives the
  overrides of ``make_job_plan`` / ``hpc-mca plan --json`` for the allocation, imports no torch,
  refuses what cannot run (bad input, exit 2), and the template runs it (stand-in srun).
* Slurm: ``sbatch --nodes 2`` and ``--nodes 4`` of sbatch/train.sbatch with the demo config
  stripped of its layout record the plan ``hpc-mca plan --nodes 2/4 --json`` shows, and train.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_mca.checkpoint.store import CheckpointInfo, checkpoints_dir, iter_name, write_tracker
from hpc_mca.slurm.errors import OpsError
from hpc_mca.slurm.jobplan import PlanOptions, make_job_plan, plan_summary
from hpc_mca.slurm.script import render_script
from hpc_mca.slurm.startplan import PLAN_FILE, allocation_from_env, checkpoint_pins

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "hpc_mca" / "assets" / "demo"
HPC_MCA = str(Path(sys.executable).with_name("hpc-mca"))
# A 13B-class llama (config.json only: enough to plan): the planner gives 2 nodes x 8 H100
# TP2 PP1 CP2 DP4 and 4 nodes TP2 PP1 CP2 DP8 for 8k tokens.
MID = {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 17920,
       "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
       "vocab_size": 32000, "max_position_embeddings": 8192}
# 70B-class: no layout fits one node of 8 H100.
BIG = {**MID, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
       "num_attention_heads": 64, "vocab_size": 128256}


def _config(folder: Path, shape: dict, name: str = "c.yaml") -> Path:
    model = folder / f"model_{name}"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(shape))
    data = folder / "d.jsonl"
    data.write_text('{"instruction": "1+1=", "output": "2"}\n')
    config = folder / name
    config.write_text(f"model_name_or_path: {model}\ndataset: {data}\ncutoff_len: 8192\n"
                      "max_steps: 2\nbf16: true\n")
    return config


def _slurm_env(run_dir: Path, nodes: int, tasks: str, gpus: int | None = 8, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES=str(nodes), SLURM_TASKS_PER_NODE=tasks,
               HPC_MCA_RUN_DIR=str(run_dir), **extra)
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return env


def _at_job_start(config: Path, overrides: list[str], env: dict) -> subprocess.CompletedProcess:
    """What the batch shell runs, with Python's import log (to see that torch stays out)."""
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "hpc_mca", "plan",
                           "--at-job-start", str(config), *overrides],
                          env=env, capture_output=True, text=True, timeout=120)


def _imported(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[-1].strip().split(".")[0]
            for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("nodes", [2, 4])
def test_job_start_plan_is_hpc_mca_plans_for_the_allocation(tmp_path: Path, nodes: int) -> None:
    config = _config(tmp_path, MID)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    done = _at_job_start(config, ["seed=7"], _slurm_env(run_dir, nodes, f"8(x{nodes})"))
    assert done.returncode == 0, done.stderr[-2000:]
    want = make_job_plan(PlanOptions(nodes=nodes, gpus_per_node=8, gpu="H100-80GB"), config,
                         ["seed=7"])
    describe, overrides = done.stdout.splitlines()
    assert overrides.split() == list(want.plan_overrides)
    expected = {2: "TP2 PP1 CP2 DP4", 4: "TP2 PP1 CP2 DP8"}[nodes]
    assert want.plan.describe() == expected
    assert describe == f"{expected} on {nodes} node(s) x 8 rank(s) (H100-80GB)"
    record = json.loads((run_dir / PLAN_FILE).read_text())
    assert record["plan"] == json.loads(json.dumps(plan_summary(want.plan)))
    assert (record["nodes"], record["ranks_per_node"], record["gpu"]) == (nodes, 8, "H100-80GB")
    assert record["config"] == str(config) and record["overrides"] == ["seed=7"]
    assert record["checkpoint_pins"] == [] and record["job_id"] == "4242"
    shown = subprocess.run([HPC_MCA, "plan", str(config), "--nodes", str(nodes), "--json",
                            "seed=7"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == {"plan": record["plan"],
                                        "plan_overrides": record["plan_overrides"]}
    # The planner's whole path in the batch shell is torch-free.
    imported = _imported(done.stderr)
    assert "hpc_mca" in imported and not imported & {"torch", "megatron", "transformers"}


def test_sizes_the_config_or_overrides_set_stay(tmp_path: Path) -> None:
    config = _config(tmp_path, MID)
    done = _at_job_start(config, ["tensor_model_parallel_size=4"],
                         _slurm_env(tmp_path, 4, "8(x4)"))
    assert done.returncode == 0, done.stderr[-2000:]
    overrides = done.stdout.splitlines()[1].split()
    assert not any(o.startswith("tensor_model_parallel_size=") for o in overrides)
    assert done.stdout.startswith("TP4 ")
    assert overrides == list(make_job_plan(PlanOptions(nodes=4, gpus_per_node=8), config,
                                           ["tensor_model_parallel_size=4"]).plan_overrides)


def test_a_model_that_does_not_fit_is_bad_input(tmp_path: Path) -> None:
    config = _config(tmp_path, BIG)
    done = _at_job_start(config, [], _slurm_env(tmp_path, 1, "8"))
    assert done.returncode == 2 and done.stdout == ""
    error = done.stderr.splitlines()[-1]
    assert error.startswith("hpc-mca: no layout fits 1 node(s) × 8 H100-80GB")
    reason, detail = (tmp_path / "bad_input").read_text().splitlines()
    assert reason == error.removeprefix("hpc-mca: ") and detail.startswith("job=4242 restart=0")
    assert not (tmp_path / PLAN_FILE).exists()


@pytest.mark.parametrize(("env", "error"), [
    ({"SLURM_TASKS_PER_NODE": "2,1", "SLURM_JOB_NUM_NODES": "2"},
     "SLURM_TASKS_PER_NODE='2,1': the nodes run different numbers of ranks"),
    ({"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "2"},
     "4 ranks per node but SLURM_GPUS_ON_NODE=2"),
    ({"SLURM_NTASKS": "3", "SLURM_JOB_NUM_NODES": "2"}, "SLURM_NTASKS=3 ranks do not split"),
    ({}, "SLURM_JOB_NUM_NODES is not set"),
])
def test_allocations_the_planner_refuses(env: dict, error: str) -> None:
    with pytest.raises(OpsError, match=error.replace("(", r"\(").replace(")", r"\)")):
        allocation_from_env(env)


def test_allocation_and_device_preset() -> None:
    cpu = allocation_from_env({"SLURM_JOB_NUM_NODES": "3", "SLURM_TASKS_PER_NODE": "2(x3)"})
    assert (cpu.nodes, cpu.ranks_per_node, cpu.gpus_on_node, cpu.gpu) == (3, 2, 0, "CPU")
    gpu = allocation_from_env({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "8",
                               "SLURM_GPUS_ON_NODE": "4"})
    assert (gpu.ranks_per_node, gpu.gpu) == (4, "H100-80GB")
    named = allocation_from_env({"SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_ON_NODE": "8",
                                 "HPC_MCA_GPU": "A100-40GB"})
    assert (named.ranks_per_node, named.gpu) == (1, "A100-40GB")


def test_a_start_after_a_checkpoint_keeps_what_it_fixes(tmp_path: Path) -> None:
    """A requeue, or the template pointed at an old run dir on another size, plans with the
    checkpoint's global batch and optimizer kind, as hpc-mca resume does."""
    assert checkpoint_pins(tmp_path, []) == []
    root = checkpoints_dir(tmp_path)
    (root / iter_name(3)).mkdir(parents=True)
    info = CheckpointInfo(step=3, consumed_samples=48,
                          training={"global_batch_size": 16, "use_distributed_optimizer": False})
    (root / iter_name(3) / "checkpoint.json").write_text(info.to_json())
    write_tracker(root, iter_name(3))
    assert checkpoint_pins(tmp_path, ["seed=1"]) == [
        "global_batch_size=16", "use_distributed_optimizer=false",
        "gradient_accumulation_steps=null"]
    assert checkpoint_pins(tmp_path, ["training.gradient_accumulation_steps=2"])[-1] == \
        "use_distributed_optimizer=false"
    config = _config(tmp_path, MID)
    done = _at_job_start(config, [], _slurm_env(tmp_path, 2, "8(x2)", SLURM_RESTART_COUNT="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / PLAN_FILE).read_text())
    assert record["restart"] == 1 and record["plan"]["request"]["global_batch_size"] == 16
    assert record["overrides"] == [] and len(record["checkpoint_pins"]) == 3
    assert done.stdout.splitlines()[1].split()[:3] == record["checkpoint_pins"]
    assert record["plan"]["use_distributed_optimizer"] is False
    # A start that will not resume from it plans afresh: never, or a fresh start that moves the
    # old run aside (overwrite_output_dir on a first start; a requeue of it resumes).
    for overrides, restart, pinned in ((["resume_from_checkpoint=never"], "1", False),
                                       (["overwrite_output_dir=true"], "0", False),
                                       (["overwrite_output_dir=true"], "1", True)):
        done = _at_job_start(config, overrides,
                             _slurm_env(tmp_path, 2, "8(x2)", SLURM_RESTART_COUNT=restart))
        assert done.returncode == 0, done.stderr[-2000:]
        pins = json.loads((tmp_path / PLAN_FILE).read_text())["checkpoint_pins"]
        assert bool(pins) == pinned, (overrides, restart, pins)


# --- the template runs it (stand-ins for srun, no Slurm) -------------------------------------

FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" >"${FAKE_DIR}/srun.args"
touch "${HPC_MCA_RUN_DIR}/finished"
"""


def _run_template(tmp_path: Path, args: list[str], **env: str) -> tuple[int, str, list[str]]:
    fake = tmp_path / "fake"
    fake.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("squeue", "#!/bin/bash\n")):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    base = _slurm_env(tmp_path / "runs" / "j_4242", 2, "8(x2)", SLURM_JOB_NAME="j",
                      SLURM_SUBMIT_DIR=str(tmp_path), HPC_MCA_HOME=str(REPO), FAKE_DIR=str(fake))
    base.update(PATH=f"{fake}:{os.environ['PATH']}", **env)
    script = tmp_path / "job.sbatch"
    script.write_text(render_script())
    done = subprocess.run(["bash", str(script), *args], env=base, cwd=tmp_path, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    srun = fake / "srun.args"
    return done.returncode, done.stdout, srun.read_text().split("\0")[:-1] if srun.exists() else []


@pytest.mark.parametrize("mode", ["start", "given"])
def test_the_template_hands_the_plan_to_the_ranks(tmp_path: Path, mode: str) -> None:
    config = _config(tmp_path, MID)
    rc, out, srun = _run_template(tmp_path, [str(config), "seed=7"], HPC_MCA_PLAN=mode)
    assert rc == 0, out
    run_dir = tmp_path / "runs" / "j_4242"
    head = [str(REPO / "bin" / "hpc-mca-rank"), "train", str(config), "seed=7"]
    if mode == "given":
        assert srun[2:] == [*head, f"output_dir={run_dir}"]
        assert not (run_dir / PLAN_FILE).exists() and "hpc-mca | plan" not in out
        return
    record = json.loads((run_dir / PLAN_FILE).read_text())
    assert srun[2:] == [*head, *record["plan_overrides"], f"output_dir={run_dir}"]
    assert record["plan_overrides"] == list(make_job_plan(
        PlanOptions(nodes=2, gpus_per_node=8), config, ["seed=7"]).plan_overrides)
    assert (f"hpc-mca | plan           TP2 PP1 CP2 DP4 on 2 node(s) x 8 rank(s) (H100-80GB); "
            f"recorded in {run_dir}/{PLAN_FILE}") in out


def test_the_template_stops_on_a_plan_that_cannot_run(tmp_path: Path) -> None:
    config = _config(tmp_path, BIG)
    rc, out, srun = _run_template(tmp_path, [str(config)], SLURM_JOB_NUM_NODES="1",
                                  SLURM_TASKS_PER_NODE="8")
    assert rc == 2 and srun == [], out
    reason = (tmp_path / "runs" / "j_4242" / "bad_input").read_text().splitlines()[0]
    assert reason.startswith("no layout fits 1 node(s) × 8 H100-80GB")
    assert f"hpc-mca: {reason}" in out
    assert f"hpc-mca | end            bad input, not requeued: {reason}; exit code 2 after" in out


def test_a_bad_plan_knob_is_refused(tmp_path: Path) -> None:
    rc, out, srun = _run_template(tmp_path, [str(_config(tmp_path, MID))], HPC_MCA_PLAN="auto")
    assert rc == 2 and srun == []
    assert "hpc-mca: HPC_MCA_PLAN='auto' is not valid; valid: start, given" in out


# --- on the local Slurm cluster (bin/local-slurm) ---------------------------------------------

def _demo_without_layout(folder: Path) -> Path:
    """The demo config with its layout lines removed and its paths made absolute; short."""
    lines = []
    for line in (DEMO / "sft_addition.yaml").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "eval_steps"):
            continue
        lines.append({"model_name_or_path": f"model_name_or_path: {DEMO}",
                      "dataset": f"dataset: {DEMO / 'train.jsonl'}",
                      "eval_dataset": "eval_dataset: null"}.get(key, line))
    config = folder / "no_layout.yaml"
    config.write_text("\n".join(lines) + "\n")
    return config


@pytest.mark.slurm
@pytest.mark.slow
def test_raw_template_plans_like_hpc_mca_plan_on_2_and_4_nodes(
        slurm_cluster: None, tmp_path: Path) -> None:
    import slurm_cluster as slurm

    if not (DEMO / "sft_addition.yaml").is_file():
        pytest.skip("the demo config is missing")
    config = _demo_without_layout(tmp_path)
    overrides = ["max_steps=3", "logging_steps=1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    jobs = {}
    for nodes in (2, 4):
        work = tmp_path / f"n{nodes}"
        work.mkdir()
        done = subprocess.run(["sbatch", "--parsable", "--nodes", str(nodes), "--ntasks-per-node",
                               "1", "--job-name", f"plan{nodes}",
                               str(REPO / "sbatch" / "train.sbatch"), str(config), *overrides],
                              cwd=work, env={**env, "HPC_MCA_HOME": str(REPO)},
                              capture_output=True, text=True, check=True, timeout=60)
        jobs[nodes] = (done.stdout.strip().split(";")[0], work)
    # The same config through hpc-mca submit (planned on the login node) for the 2-node losses.
    submitted = subprocess.run([HPC_MCA, "submit", str(config), "--gpu", "CPU", "--nodes", "2",
                                "--gpus-per-node", "1", "--job-name", "sub2", *overrides],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    sub_id = slurm.submitted_job_id(submitted)
    losses = {}
    for nodes, (job_id, work) in jobs.items():
        state = slurm.wait_for_job(job_id, timeout=900)
        run_dir, log = work / "runs" / f"plan{nodes}_{job_id}", work / f"plan{nodes}_{job_id}.out"
        assert state == "COMPLETED", log.read_text()[-3000:]
        shown = subprocess.run([HPC_MCA, "plan", str(config), "--gpu", "CPU", "--nodes",
                                str(nodes), "--gpus-per-node", "1", "--json", *overrides],
                               env=env, capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0, shown.stderr
        want = json.loads(shown.stdout)
        record = json.loads((run_dir / PLAN_FILE).read_text())
        assert record["plan"] == want["plan"] and record["plan_overrides"] == want["plan_overrides"]
        assert (record["job_id"], record["nodes"], record["ranks_per_node"]) == (job_id, nodes, 1)
        assert want["plan"]["layout"]["dp"] == nodes and record["gpu"] == "CPU"
        assert f"global_batch_size={4 * nodes}" in record["plan_overrides"]
        steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == [1, 2, 3] and (run_dir / "finished").is_file()
        assert all(s["loss"] > 0 for s in steps)
        losses[nodes] = [s["loss"] for s in steps]
        text = log.read_text()
        assert f"hpc-mca | plan           TP1 PP1 CP1 DP{nodes} on {nodes} node(s) x 1 rank(s)" in text
    assert slurm.wait_for_job(sub_id, timeout=900) == "COMPLETED"
    sub_dir = tmp_path / "runs" / f"sub2_{sub_id}"
    assert [json.loads(line)["loss"] for line in (sub_dir / "steps.jsonl").read_text().splitlines()
            ] == losses[2]
    assert not (sub_dir / PLAN_FILE).exists()  # its script carries the plan: no replanning
    # hpc-mca resume of such a run replans from the recorded config (not its resolved sizes).
    job_id, work = jobs[2]
    done = subprocess.run([HPC_MCA, "resume", job_id, "--nodes", "1", "max_steps=6", "--dry-run"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"set -- {config} max_steps=3 logging_steps=1 global_batch_size=8" in done.stdout
    assert "HPC_MCA_PLAN=${HPC_MCA_PLAN:-given}" in done.stdout
    assert "TP1 PP1 CP1 DP1" in done.stdout.splitlines()[-1]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_requeued_raw_template_job_replans_and_records_each_start(
        slurm_cluster: None, tmp_path: Path) -> None:
    """The lead-time signal mid-run: the ranks save, the shell requeues (same id), the second
    start plans again (with the checkpoint's global batch pinned), records it and finishes."""
    import time

    import slurm_cluster as slurm

    if not (DEMO / "sft_addition.yaml").is_file():
        pytest.skip("the demo config is missing")
    config = _demo_without_layout(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    done = subprocess.run(["sbatch", "--parsable", "--nodes", "2", "--ntasks-per-node", "1",
                           "--job-name", "rq", str(REPO / "sbatch" / "train.sbatch"), str(config),
                           "max_steps=150", "logging_steps=50", "save_steps=1000"],
                          cwd=tmp_path, env={**env, "HPC_MCA_HOME": str(REPO)},
                          capture_output=True, text=True, check=True, timeout=60)
    job_id = done.stdout.strip().split(";")[0]
    run_dir, log = tmp_path / "runs" / f"rq_{job_id}", tmp_path / f"rq_{job_id}.out"
    steps, deadline = run_dir / "steps.jsonl", time.monotonic() + 600
    while not (steps.is_file() and steps.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and slurm.job_state(job_id) not in slurm.TERMINAL_STATES
        time.sleep(0.5)
    first = json.loads((run_dir / PLAN_FILE).read_text())
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=60)
    assert slurm.wait_for_job(job_id, timeout=900) == "COMPLETED", log.read_text()[-3000:]
    assert slurm.job_restart_count(job_id) == 1
    second = json.loads((run_dir / PLAN_FILE).read_text())
    assert (first["restart"], second["restart"]) == (0, 1)
    assert first["checkpoint_pins"] == [] and second["checkpoint_pins"] == [
        "global_batch_size=8", "use_distributed_optimizer=true", "gradient_accumulation_steps=null"]
    assert second["plan"]["layout"] == first["plan"]["layout"] and first["plan"]["layout"]["dp"] == 2
    text = log.read_text()
    assert text.count("hpc-mca | plan           TP1 PP1 CP1 DP2 on 2 node(s) x 1 rank(s)") == 2
    records = [json.loads(line) for line in steps.read_text().splitlines()]
    assert records[-1]["step"] == 150 and (run_dir / "finished").is_file()
