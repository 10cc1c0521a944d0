"""A Python training script as a job: ``hpc-mca run SCRIPT.py`` (the rank command) and
``hpc-mca submit [options] SCRIPT.py ARGS`` (issue 41).

* Fast: the rendered batch script runs ``run SCRIPT ARGS`` and exports the planned layout
  (bash with stand-ins for srun/squeue/scontrol, as tests/test_sbatch_render.py); the refusals
  at submit; ``hpc-mca run``'s exit codes; the demo script's token dicts equal the data
  pipeline's samples.
* ``@slurm``: the demo API script through ``hpc-mca submit --nodes 2`` with a 2-minute limit is
  requeued by it and finishes with an uninterrupted run's numbers; ``hpc-mca resume`` of its
  finished run is refused until max_steps is raised, then runs the script on in its run dir.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_sbatch_render import _fake_slurm, _srun_args, _start

from hpc_mca.slurm.errors import OpsError
from hpc_mca.slurm.jobplan import PlanOptions, make_script_plan
from hpc_mca.slurm.submit import SubmitOptions, render_job

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = REPO / "hpc_mca" / "assets" / "demo"
API_SFT = DEMO_DIR / "api_sft.py"
HPC_MCA = str(Path(sys.executable).with_name("hpc-mca"))
CPU_1X2_TP2 = PlanOptions(nodes=1, gpus_per_node=2, gpu="CPU", model=str(DEMO_DIR), tp=2)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    return {**env, "PYTHONWARNINGS": "ignore", **extra}


# --- the rendered job ---------------------------------------------------------------------


def test_a_script_job_runs_run_with_its_arguments_and_exports_the_plan(tmp_path: Path) -> None:
    job = make_script_plan(CPU_1X2_TP2, API_SFT, ["max_steps=4", "learning_rate=1e-3"])
    rendered = render_job(job, SubmitOptions(runs_root=tmp_path / "runs", home=REPO))
    assert rendered.rank_command == "run" and rendered.job_name == "api_sft"
    assert rendered.rank_args == (str(API_SFT), "max_steps=4", "learning_rate=1e-3")
    plan = rendered.knobs["HPC_MCA_PLAN_OVERRIDES"].split()
    assert "tensor_model_parallel_size=2" in plan and "pipeline_model_parallel_size=1" in plan
    # The planner cannot see a script's batch: it is left to the script.
    assert not [item for item in plan if item.startswith(("global_batch_size", "per_device_"))]

    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NAME="api_sft", FAKE_FINISH="1")
    proc = _start(rendered.script, tmp_path, [], env)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    # No output_dir argument: the script's TrainingArguments take the run dir from the env.
    assert _srun_args(env)[2:] == [str(REPO / "bin" / "hpc-mca-rank"), "run", *rendered.rank_args]
    srun_env = (Path(env["FAKE_DIR"]) / "srun.env").read_text().splitlines()
    assert f"HPC_MCA_PLAN_OVERRIDES={' '.join(plan)}" in srun_env
    assert f"HPC_MCA_RUN_DIR={tmp_path}/runs/api_sft_4242" in srun_env


def test_a_script_job_keeps_the_requeue_contract(tmp_path: Path) -> None:
    """Like train: ranks that end without the finished marker are not a success (75), and a
    job ending at its time limit requeues itself."""
    job = make_script_plan(CPU_1X2_TP2, API_SFT, [])
    script = render_job(job, SubmitOptions(runs_root=tmp_path / "runs", home=REPO)).script
    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NAME="s")
    proc = _start(script, tmp_path, [], env)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 75, out

    (Path(env["FAKE_DIR"]) / "squeue.out").write_text("TIMEOUT|TimeLimit|0|\n")
    proc = _start(script, tmp_path, [], {**env, "FAKE_SRUN_EXIT": "75"})
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "requeue        time limit reached (SIGTERM): restart 1 of at most 10" in out
    calls = (Path(env["FAKE_DIR"]) / "scontrol.calls").read_text().splitlines()
    assert [c for c in calls if not c.startswith("show ")] == ["requeue 4242"]  # show: node facts


def test_the_template_refuses_run_without_a_script(tmp_path: Path) -> None:
    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NAME="j", HPC_MCA_HOME=str(REPO), HPC_MCA_RANK_CMD="run")
    proc = _start((REPO / "sbatch" / "train.sbatch").read_text(), tmp_path, ["nope.py"], env)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2, out
    assert "usage: HPC_MCA_RANK_CMD=run sbatch" in out and "'nope.py' not found" in out
    assert not (Path(env["FAKE_DIR"]) / "srun.args").exists()


def test_script_plans_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(OpsError, match=r"^the script 'api_sft.py' needs --model HF_DIR"):
        make_script_plan(PlanOptions(gpu="CPU"), API_SFT)
    with pytest.raises(OpsError, match=r"^script '.*missing.py' does not exist; valid: "):
        make_script_plan(CPU_1X2_TP2, tmp_path / "missing.py")
    job = make_script_plan(CPU_1X2_TP2, API_SFT)
    with pytest.raises(OpsError, match=r"^--rank-command 'smoke' with the script 'api_sft.py'"):
        render_job(job, SubmitOptions(runs_root=tmp_path, rank_command=("smoke",)))


def test_submit_of_a_script_without_model_submits_nothing(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(f"#!/bin/bash\ntouch {tmp_path}/sbatch_called\n")
    (fake / "sbatch").chmod(0o755)
    env = _env(PATH=f"{fake}:{os.environ['PATH']}")
    done = subprocess.run([HPC_MCA, "submit", "--gpu", "CPU", "--nodes", "2", str(API_SFT),
                           "max_steps=3", "--runs-root", str(tmp_path / "runs")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr == ("Error: the script 'api_sft.py' needs --model HF_DIR (the model it "
                           "trains: the planner has no config to read it from); valid: --model "
                           "DIR|config.json\n")
    assert not (tmp_path / "sbatch_called").exists() and not (tmp_path / "runs").exists()


def test_plan_of_a_script_gives_the_overrides_its_job_exports(tmp_path: Path) -> None:
    done = subprocess.run([HPC_MCA, "plan", "--gpu", "CPU", "--gpus-per-node", "2", "--tp", "2",
                           "--model", str(DEMO_DIR), "--json", str(API_SFT), "max_steps=3"],
                          env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    job = make_script_plan(CPU_1X2_TP2, API_SFT, ["max_steps=3"])
    answer = json.loads(done.stdout)
    assert answer["plan_overrides"] == list(job.plan_overrides)
    assert answer["plan"]["layout"]["tp"] == 2


# --- hpc-mca run ----------------------------------------------------------------------------

SCRIPTS = {
    "bad.py": "import sys\nfrom hpc_mca.config.input import ConfigError\n"
              "print('argv', sys.argv[1:], flush=True)\n"
              "raise ConfigError(\"learning_rate='x' must be a number\\nmax_steps=0 must be positive\")\n",
    "everyone.py": "from hpc_mca.errors import BadInputOnRankZero\nraise BadInputOnRankZero('shared')\n",
    "stop.py": "raise SystemExit(75)\n",
    "crash.py": "raise RuntimeError('boom')\n",
    "fine.py": "import sys\nprint('argv', sys.argv[1:])\n",
}


def _run(tmp_path: Path, name: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / name).write_text(SCRIPTS[name])
    return subprocess.run([sys.executable, "-m", "hpc_mca", "run", name, *args], cwd=tmp_path,
                          env=_env(**env), capture_output=True, text=True, timeout=120)


def test_run_turns_bad_input_into_one_line_and_exit_2(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    done = _run(tmp_path, "bad.py", "a=1", "--flag", "x", HPC_MCA_RUN_DIR=str(run_dir))
    assert done.returncode == 2, done.stderr
    assert done.stdout == "argv ['a=1', '--flag', 'x']\n"
    line = "learning_rate='x' must be a number; max_steps=0 must be positive"
    assert done.stderr == f"hpc-mca run: error: {line}\n"
    assert (run_dir / "bad_input").read_text().splitlines()[0] == line
    # An error every rank finds alike is printed by rank 0 only; the others exit 2 quietly.
    quiet = _run(tmp_path, "everyone.py", RANK="1", WORLD_SIZE="2", LOCAL_RANK="1",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    assert (quiet.returncode, quiet.stderr) == (2, "")


def test_run_passes_exit_codes_through_and_crashes_exit_1(tmp_path: Path) -> None:
    assert _run(tmp_path, "stop.py").returncode == 75
    crash = _run(tmp_path, "crash.py")
    assert crash.returncode == 1 and "RuntimeError: boom" in crash.stderr
    assert "Traceback" in crash.stderr
    fine = _run(tmp_path, "fine.py", "max_steps=2")
    assert (fine.returncode, fine.stdout) == (0, "argv ['max_steps=2']\n")


# --- the demo API script's data -------------------------------------------------------------


def test_demo_script_examples_are_the_pipelines_samples_unshifted() -> None:
    """api_sft.py's token dicts, shifted as the trainer shifts them, equal the samples
    ``hpc-mca train sft_addition.yaml`` makes of the same file, in the same order."""
    import runpy

    from transformers import AutoTokenizer

    from hpc_mca.config.loading import load_config
    from hpc_mca.data.dataset import load_samples
    from hpc_mca.data.tokenize import load_tokenizer

    demo = runpy.run_path(str(API_SFT), run_name="api_sft")
    config = load_config(DEMO_DIR / "sft_addition.yaml", ["sequence_packing=false"])
    data = demo["run_config"]([]).data
    assert (data.sequence_packing, data.cutoff_len, data.seq_length) == (False, 16, 64)
    store = load_samples(str(DEMO_DIR / "eval.jsonl"), load_tokenizer(str(DEMO_DIR)), config.data, "sft")
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_DIR), local_files_only=True)
    examples = demo["AdditionProblems"](str(DEMO_DIR / "eval.jsonl"), tokenizer, data.cutoff_len)
    assert len(examples) == len(store) == 512
    for index in range(len(store)):
        ids, labels = store.sample(index)
        example = examples[index]
        assert example["input_ids"][:-1] == ids.tolist(), index
        assert example["labels"][1:] == labels.tolist(), index
    batch = demo["PadToLength"](tokenizer.pad_token_id, 64)([examples[0], examples[1]])
    assert {key: tuple(value.shape) for key, value in batch.items()} == {
        "input_ids": (2, 64), "labels": (2, 64), "attention_mask": (2, 64)}
    size = len(examples[0]["input_ids"])
    assert batch["attention_mask"][0].sum() == size
    assert (batch["input_ids"][0, size:] == tokenizer.pad_token_id).all()
    assert (batch["labels"][0, size:] == -100).all()
    assert np.array_equal(batch["labels"][0, :size].numpy(), examples[0]["labels"])


# --- on the local Slurm cluster -------------------------------------------------------------

COMPARED = ("step", "loss", "tokens", "grad_norm", "lr", "skipped")
STEPS = 120
# Seconds per step while SLURM_RESTART_COUNT is 0 (tests/checkpoint_hooks): the first run lasts
# past its signal (sleeping, so the shared CPUs stay free); the resumed one runs at full speed.
SLOW_FIRST_RUN = "1.0@0"
SCRIPT_ARGS = [f"max_steps={STEPS}", "logging_steps=25", "eval_dataset=null", "eval_steps=null",
               "report_to=none"]


def _numbers(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    return [{key: row[key] for key in COMPARED} for row in rows]


@pytest.mark.slurm
@pytest.mark.slow
def test_submitted_script_requeued_by_its_time_limit_finishes_as_uninterrupted(
        slurm_cluster: None, tmp_path: Path) -> None:
    """``hpc-mca submit --nodes 2 api_sft.py`` with ``--time 2 --signal-lead 10``: Slurm's
    limit check (every 30 s) sends the lead-time signal once less than lead + 30 s is left, so
    80-110 s into each run. The first run's steps are slowed past that; the script's
    McaTrainer saves and exits 75, the batch script requeues the job, and the resumed run
    (at full speed, it has 80 s) finishes. Its steps equal those of the same script and layout
    run without interruption. Usually one requeue; a loaded machine may need another, which
    must resume exactly too."""
    import slurm_cluster as slurm
    from trainer_fixtures import rank_env, run_ranks

    hooks = Path(__file__).with_name("checkpoint_hooks")
    env = _env(HPC_MCA_HOME=str(REPO), HPC_MCA_DIST_TIMEOUT="120", PYTHONPATH=str(hooks),
               HPC_MCA_TEST_STEP_SLEEP=SLOW_FIRST_RUN)
    started = time.monotonic()
    done = subprocess.run(
        [HPC_MCA, "submit", "--gpu", "CPU", "--nodes", "2", "--gpus-per-node", "1",
         "--model", str(DEMO_DIR), "--time", "2", "--signal-lead", "10",
         "--runs-root", str(tmp_path / "runs"), str(API_SFT), *SCRIPT_ARGS],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = re.match(r"submitted job (\d+):", done.stdout).group(1)
    run_dir = tmp_path / "runs" / f"api_sft_{job_id}"
    state = slurm.wait_for_job(job_id, timeout=600)
    log = (run_dir / f"api_sft_{job_id}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    restarts = slurm.job_restart_count(job_id)
    assert restarts >= 1 and f"{job_id} (api_sft) restart 1" in log, log[-4000:]
    assert re.search(r"requeue        time limit ahead \(SIGUSR1 \d+ s before the limit\): "
                     r"restart 1 of at most 10", log), log[-4000:]
    stopped = [line for line in log.splitlines() if line.startswith("stop requested by USR1")]
    saved = [line for line in log.splitlines() if "saved (signal)" in line]
    assert len(stopped) == len(saved) == restarts, log[-4000:]
    assert (run_dir / "finished").is_file()
    assert f"api_sft: global_step={STEPS} training_loss=" in log
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["train_script"] == str(API_SFT) and manifest["overrides"] == SCRIPT_ARGS
    assert manifest["rank_command"] == ["run", str(API_SFT), *SCRIPT_ARGS]
    plan = " ".join(manifest["plan_overrides"])
    assert manifest["plan"]["describe"].startswith("TP1 PP1 CP1 DP2")

    # The same script and layout, uninterrupted, on 2 local ranks (no Slurm, no hook).
    reference = tmp_path / "reference"
    proc = run_ranks(2, ["run", str(API_SFT), *SCRIPT_ARGS, f"output_dir={reference}"],
                     env={**rank_env(), "HPC_MCA_PLAN_OVERRIDES": plan})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = _numbers(run_dir), _numbers(reference)
    assert len(ours) == STEPS and ours == theirs
    print(f"\n{stopped[0]}\njob {job_id}: {restarts} requeue(s), {STEPS} steps, final loss {ours[-1]['loss']:.6f} "
          f"(uninterrupted: {theirs[-1]['loss']:.6f}), {time.monotonic() - started:.0f} s; plan {plan}")

    # hpc-mca resume of the script's finished run: refused while it would add nothing; with
    # max_steps raised, the script again in the same run dir, planned for its nodes.
    plain = _env(HPC_MCA_HOME=str(REPO), HPC_MCA_DIST_TIMEOUT="120")
    runs = ["--runs-root", str(tmp_path / "runs")]
    refused = subprocess.run([HPC_MCA, "resume", job_id, *runs, "--dry-run"], env=plain, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and f"finished at step {STEPS}; nothing to resume" in refused.stderr
    more = subprocess.run([HPC_MCA, "resume", job_id, f"max_steps={STEPS + 10}", *runs], env=plain,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert more.returncode == 0, more.stdout + more.stderr
    new_id = re.match(r"submitted job (\d+):", more.stdout).group(1)
    log = run_dir / f"api_sft_{new_id}.out"
    assert slurm.wait_for_job(new_id, timeout=600) == "COMPLETED", log.read_text()[-4000:]
    extended = _numbers(run_dir)
    assert len(extended) == STEPS + 10 and extended[:STEPS] == ours
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert new_id in manifest["job_ids"] and (run_dir / "finished").is_file()
