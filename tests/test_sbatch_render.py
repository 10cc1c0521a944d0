"""The batch script renderer: golden files, quoting of hostile values, shellcheck, and the
script's behaviour run by bash with stand-ins for srun/scancel (no Slurm needed here; the real
cluster runs it in tests/test_submit_slurm.py).

Regenerate the golden files after an intended change with
``HPC_MCA_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_sbatch_render.py``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpc_mca.slurm.errors import OpsError
from hpc_mca.slurm.quoting import directive_quote, filename_pattern, shell_quote
from hpc_mca.slurm.script import TEMPLATE_PATH, SbatchOptions, render_script

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "sbatch"
HOSTILE = "it's a \"job\"; $(touch pwned) `id` & #1 \\ %x"

GPU_JOB = dict(
    options=SbatchOptions(job_name="llama3-8b_pt", nodes=16, ntasks_per_node=8, gpus_per_node=8,
                          cpus_per_task=12, time="2-00:00:00", partition="gpu", account="proj42",
                          qos="normal", signal_lead_s=300,
                          output="/scratch/me/runs/%x_%j/%x_%j.out",
                          extra=("--exclusive", "--constraint=h100&ib")),
    knob_values={"HPC_MCA_HOME": "/opt/hpc-mca", "HPC_MCA_RANK_CMD": "train",
                 "HPC_MCA_RUNS_ROOT": "/scratch/me/runs", "HPC_MCA_VENV": "/opt/hpc-mca/.venv"},
    rank_args=["/home/me/llama3_8b.yaml", "learning_rate=3e-4", "tensor_model_parallel_size=4",
               "pipeline_model_parallel_size=2", "context_parallel_size=2"],
)
HOSTILE_ROOT = "/scratch/my runs/o'brien/$(rm -rf ~)/100%"
HOSTILE_JOB = dict(
    options=SbatchOptions(job_name=HOSTILE, nodes=2, ntasks_per_node=2,
                          output=f"{filename_pattern(HOSTILE_ROOT)}/%x_%j/%x_%j.out",
                          extra=(f"--comment={HOSTILE}",)),
    knob_values={"HPC_MCA_HOME": "/opt/hpc mca/$(x)", "HPC_MCA_RANK_CMD": "train",
                 "HPC_MCA_RUNS_ROOT": HOSTILE_ROOT},
    rank_args=["/home/me/my config's.yaml", f"text_field={HOSTILE}", "tokenizer_name_or_path=a;b",
               "eval_dataset=", "--not-an-option", "*"],
)
CASES = {"train.sbatch": dict(), "cli_gpu.sbatch": GPU_JOB, "cli_hostile.sbatch": HOSTILE_JOB}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    text = render_script(**CASES[name])
    golden = GOLDEN / name
    if os.environ.get("HPC_MCA_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.read_text() == text, f"{golden} is stale (HPC_MCA_UPDATE_GOLDEN=1 rewrites it)"


def test_template_file_is_the_renderers_default() -> None:
    """One source of truth: sbatch/train.sbatch is render_script() with the defaults."""
    assert (REPO / TEMPLATE_PATH).read_text() == render_script(), (
        "sbatch/train.sbatch is stale: .venv/bin/python -m hpc_mca.slurm.script > "
        "sbatch/train.sbatch")
    assert os.access(REPO / TEMPLATE_PATH, os.X_OK)


def test_cli_and_template_share_the_body() -> None:
    """Everything after the knobs is the same text in both scripts."""
    raw, cli = render_script(), render_script(**GPU_JOB)
    body = raw[raw.index("# --- environment"):]
    assert cli.endswith(body)


def _shellcheck() -> str:
    found = shutil.which("shellcheck")
    if found is None:
        pytest.skip("shellcheck is not installed (bin/test installs it)")
    return found


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_scripts_are_shellcheck_clean(name: str, tmp_path: Path) -> None:
    script = tmp_path / name
    script.write_text(render_script(**CASES[name]))
    done = subprocess.run([_shellcheck(), str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


# --- quoting -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [HOSTILE, "plain", "", "a b", "x'y", 'x"y', "a\\b", "#", "é ü"])
def test_shell_quote_round_trips_through_bash(value: str) -> None:
    done = subprocess.run(["bash", "-c", f"printf '%s' {shell_quote(value)}"],
                          capture_output=True, text=True, check=True)
    assert done.stdout == value


def _sbatch_parse(text: str) -> str:
    """sbatch's #SBATCH argument parser, as Slurm 22.05 implements it (quotes toggle,
    backslash escapes everywhere, unquoted # ends the line); checked against the real sbatch
    in tests/test_submit_slurm.py::test_hostile_strings_reach_slurm_and_ranks_intact."""
    out, quote, escape = [], None, False
    for ch in text:
        if escape:
            out.append(ch)
            escape = False
        elif ch == "\\":
            escape = True
        elif quote:
            if ch == quote:
                quote = None
            else:
                out.append(ch)
        elif ch in "'\"":
            quote = ch
        elif ch == "#" or ch.isspace():
            break
        else:
            out.append(ch)
    return "".join(out)


@pytest.mark.parametrize("value", [HOSTILE, "plain", "a b", "x'y", 'x"y', "a\\b", "#x", "B:USR1@9"])
def test_directive_quote_reads_back(value: str) -> None:
    assert _sbatch_parse(directive_quote(value)) == value


def test_refused_values() -> None:
    with pytest.raises(OpsError, match="newline"):
        render_script(SbatchOptions(job_name="a\nb"))
    with pytest.raises(OpsError, match="without '/'"):
        render_script(SbatchOptions(job_name="a/b"))
    with pytest.raises(OpsError, match="set by hpc-mca itself"):
        render_script(SbatchOptions(extra=("--output=x",)))
    with pytest.raises(OpsError, match="not --name"):
        render_script(SbatchOptions(extra=("exclusive",)))
    with pytest.raises(OpsError, match="backslash"):
        filename_pattern("/a\\b")
    with pytest.raises(OpsError, match="unknown knob"):
        render_script(knob_values={"HPC_MCA_NOPE": "1"})
    with pytest.raises(OpsError, match="subcommand"):
        render_script(knob_values={"HPC_MCA_RANK_CMD": "train; rm"})
    assert filename_pattern("/runs/100%") == "/runs/100%%"


# --- the script under bash, with stand-ins for srun and scancel ---------------------------

FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" >"${FAKE_DIR}/srun.args"
env >"${FAKE_DIR}/srun.env"
while [[ -e "${FAKE_DIR}/hold" ]]; do sleep 0.05; done
if [[ -n "${FAKE_FINISH:-}" ]]; then echo '{"step": 1}' >"${HPC_MCA_RUN_DIR}/finished"; fi
if [[ -n "${FAKE_BAD_INPUT:-}" ]]; then
    printf '%s\\nrank=0\\n' "${FAKE_BAD_INPUT}" >"${HPC_MCA_RUN_DIR}/bad_input"
fi
exit "${FAKE_SRUN_EXIT:-0}"
"""
FAKE_SCANCEL = """#!/bin/bash
printf '%s\\0' "$@" >>"${FAKE_DIR}/scancel.args"
echo "$*" >>"${FAKE_DIR}/scancel.calls"
"""
# squeue answers what the test wrote into squeue.out (State|Reason|RestartCnt|, or nothing),
# or, asked for the EndTime, endtime.out.
FAKE_SQUEUE = """#!/bin/bash
[[ -s "${FAKE_DIR}/squeue.out" ]] || exit 0  # the controller does not answer
if [[ "$*" == *EndTime* ]]; then cat "${FAKE_DIR}/endtime.out" 2>/dev/null || true; exit 0; fi
cat "${FAKE_DIR}/squeue.out"
"""
# scontrol records its arguments; FAKE_CANCEL_ON_REQUEUE plays a cancel racing the requeue.
FAKE_SCONTROL = """#!/bin/bash
echo "$*" >>"${FAKE_DIR}/scontrol.calls"
if [[ -n "${FAKE_CANCEL_ON_REQUEUE:-}" && "$1" == requeue ]]; then
    echo "job=${SLURM_JOB_ID} time=0 user=x" >>"${HPC_MCA_RUN_DIR}/cancel_requested"
fi
"""


def _fake_slurm(tmp_path: Path) -> dict[str, str]:
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "squeue.out").write_text("RUNNING|None|0|\n")
    # The time limit 100 s away: a USR1 now is the lead-time signal (lead 120 s).
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 100))
    (fake / "endtime.out").write_text(f"{end}\n")
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("squeue", FAKE_SQUEUE),
                       ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPC_MCA_"))}
    env.update(PATH=f"{fake}:{env['PATH']}", FAKE_DIR=str(fake), SLURM_JOB_ID="4242",
               SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_NUM_NODES="2", SLURM_NTASKS="4",
               SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="n[1-2]",
               # Their configs are placeholders: no job-start planning (tests/test_sbatch_plan.py).
               HPC_MCA_PLAN="given")
    return env


def _start(script_text: str, tmp_path: Path, args: list[str], env: dict[str, str]):
    script = tmp_path / "job.sbatch"
    script.write_text(script_text)
    return subprocess.Popen(["bash", str(script), *args], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _srun_args(env: dict[str, str]) -> list[str]:
    return (Path(env["FAKE_DIR"]) / "srun.args").read_text().split("\0")[:-1]


def test_hostile_values_reach_srun_intact(tmp_path: Path) -> None:
    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NAME=HOSTILE, FAKE_FINISH="1")
    knobs = {**HOSTILE_JOB["knob_values"], "HPC_MCA_HOME": str(REPO),
             "HPC_MCA_RUNS_ROOT": str(tmp_path / "my runs" / "$(touch pwned)")}
    config = tmp_path / "my config's.yaml"
    config.write_text("{}\n")
    rank_args = [str(config), *HOSTILE_JOB["rank_args"][1:]]
    proc = _start(render_script(HOSTILE_JOB["options"], knobs, rank_args), tmp_path, [], env)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    run_dir = Path(knobs["HPC_MCA_RUNS_ROOT"]) / f"{HOSTILE}_4242"
    assert run_dir.is_dir()
    assert _srun_args(env) == ["--unbuffered", "--kill-on-bad-exit=1",
                               str(REPO / "bin" / "hpc-mca-rank"), "train", *rank_args,
                               f"output_dir={run_dir}"]
    assert not list(tmp_path.rglob("pwned")) and not Path("pwned").exists()
    assert "hpc-mca | end            exit code 0" in out


def test_a_watchdog_the_term_missed_stops_once_the_ranks_ended(tmp_path: Path) -> None:
    """On a loaded node the ranks can end before the subshell has started the hang watchdog,
    so the shell's TERM finds nothing to stop; with no rank ever beating, the watchdog would
    watch forever and the job never end. A launcher that starts the watchdog late and deaf to
    TERM plays that race: the job still ends, because the shell wrote ranks_ended."""
    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NAME="j", FAKE_FINISH="1")
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    launcher = home / "bin" / "hpc-mca-rank"
    launcher.write_text("#!/bin/bash\n"
                        "if [[ \"$1\" == watchdog ]]; then trap '' TERM; sleep 1; fi\n"
                        f"export HPC_MCA_HOME={shlex.quote(str(REPO))}\n"
                        f"exec {shlex.quote(str(REPO / 'bin' / 'hpc-mca-rank'))} \"$@\"\n")
    launcher.chmod(0o755)
    config = tmp_path / "c.yaml"
    config.write_text("{}\n")
    proc = _start(render_script(knob_values={"HPC_MCA_HOME": str(home)}, rank_args=[str(config)]),
                  tmp_path, [], env)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "hpc-mca | end            exit code 0" in out
    assert (tmp_path / "runs" / "j_4242" / "ranks_ended").is_file()


def test_arguments_given_to_sbatch_win_over_baked_ones(tmp_path: Path) -> None:
    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NAME="j", HPC_MCA_RANK_CMD="smoke")
    script = render_script(knob_values={"HPC_MCA_HOME": str(REPO), "HPC_MCA_RANK_CMD": "train"},
                           rank_args=["baked.yaml"])
    proc = _start(script, tmp_path, ["--tp", "2"], env)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert _srun_args(env)[2:] == [str(REPO / "bin" / "hpc-mca-rank"), "smoke", "--tp", "2"]
    srun_env = (Path(env["FAKE_DIR"]) / "srun.env").read_text().splitlines()
    assert f"HPC_MCA_RUN_DIR={tmp_path}/runs/j_4242" in srun_env
    assert f"HPC_MCA_SIGNAL_FILE={tmp_path}/runs/j_4242/signal_received" in srun_env


@pytest.mark.parametrize("code", [0, 3, 137])
def test_exit_code_is_propagated(tmp_path: Path, code: int) -> None:
    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NAME="j", HPC_MCA_HOME=str(REPO), HPC_MCA_RANK_CMD="smoke",
               FAKE_SRUN_EXIT=str(code))
    proc = _start(render_script(), tmp_path, [], env)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == code, out
    assert f"exit code {code} after" in out


def test_train_without_a_config_fails_with_usage(tmp_path: Path) -> None:
    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NAME="j", HPC_MCA_HOME=str(REPO))
    proc = _start(render_script(), tmp_path, ["missing.yaml"], env)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "usage: sbatch [options] train.sbatch CONFIG.yaml" in out and "missing.yaml" in out
    assert not (Path(env["FAKE_DIR"]) / "srun.args").exists()


def test_outside_slurm_and_without_checkout(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPC_MCA_"))}
    done = subprocess.run(["bash", str(REPO / TEMPLATE_PATH)], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 2 and "run this script with sbatch" in done.stderr
    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NAME="j", HPC_MCA_HOME=str(tmp_path / "nowhere"))
    proc = _start(render_script(), tmp_path, [], env)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "set HPC_MCA_HOME to the hpc-mca checkout" in out


@pytest.mark.parametrize("forward", ["", "USR1"])
def test_lead_time_signal_is_recorded_and_forwarded(tmp_path: Path, forward: str) -> None:
    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NAME="j", HPC_MCA_HOME=str(REPO), HPC_MCA_RANK_CMD="smoke",
               HPC_MCA_FORWARD_SIGNAL=forward, SLURM_RESTART_COUNT="2", FAKE_SRUN_EXIT="0")
    hold = Path(env["FAKE_DIR"]) / "hold"
    hold.touch()
    proc = _start(render_script(), tmp_path, [], env)
    args_file = Path(env["FAKE_DIR"]) / "srun.args"
    deadline = time.monotonic() + 20
    while not args_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    signal_file = tmp_path / "runs" / "j_4242" / "signal_received"
    while not signal_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert proc.poll() is None, "the batch shell must keep waiting for the ranks"
    hold.unlink()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    lines = signal_file.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["USR1", "TERM"]
    assert lines[0].endswith("job=4242 restart=2")
    scancel = Path(env["FAKE_DIR"]) / "scancel.args"
    if forward:
        assert scancel.read_text().split("\0")[:-1] == ["--signal=USR1", "4242"]
    else:
        assert not scancel.exists()
    assert "signal         SIGUSR1" in out


def test_a_lead_time_signal_during_start_up_is_held_not_fatal(tmp_path: Path) -> None:
    """Slurm checks limits every 30 s, so a job whose limit is under lead + 30 s can get its
    USR1 the moment it starts (seen on the local cluster 47 ms after the start, which killed
    the batch shell): here it comes from inside the banner, before the handlers exist. The
    shell holds it, records it once the handler exists, and the job goes on."""
    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NAME="j", HPC_MCA_HOME=str(REPO), HPC_MCA_RANK_CMD="smoke",
               FAKE_SRUN_EXIT="0")
    fake, pid_file = Path(env["FAKE_DIR"]), tmp_path / "script.pid"
    (fake / "hostname").write_text(  # the banner calls it before the handlers are installed
        f'#!/bin/bash\nkill -USR1 "$(cat {pid_file})"\nsleep 0.3\necho node1\n')
    (fake / "hostname").chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render_script())
    proc = subprocess.Popen(["bash", "-c", f'echo "$$" >{pid_file}; exec bash {script}'],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out  # killed by the USR1 (-10) without the hold
    lines = (tmp_path / "runs" / "j_4242" / "signal_received").read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["USR1"]
    assert "signal         SIGUSR1" in out and (fake / "srun.args").exists()


# --- the requeue decision (contract: hpc_mca/checkpoint/requeue.py), with stand-ins --------

VERDICTS = {
    # name: (signals sent, squeue's answer when the TERM comes / after srun, cancel record,
    #        expected scontrol calls, expected scancel calls, line in the log)
    "lead signal": (["USR1"], None, False, ["requeue 4242"], [],
                    "requeue        time limit ahead (SIGUSR1 "),
    "scancel after the lead signal": (["USR1", "TERM"], "COMPLETING|None|0|", False, [], [],
                                      "end            cancelled: not requeued"),
    "hpc-mca cancel after the lead signal": (["USR1"], None, True, [], [],
                                             "end            cancelled: not requeued"),
    "outside scontrol requeue": (["TERM"], "COMPLETING|None|1|", False, [], [],
                                 "requeued by Slurm (scontrol requeue or preemption)"),
    "time limit reached": (["USR1", "TERM"], "COMPLETING|TimeLimit|0|", False,
                           ["requeue 4242"], [], "time limit reached (SIGTERM): restart 1"),
    "controller unreachable": (["USR1"], "", False, ["requeue 4242"], [],
                               "SIGUSR1 (Slurm did not say when the job ends"),
    "cancel racing the requeue": (["USR1"], None, False, ["requeue 4242"], ["4242"],
                                  "cancelled while being requeued: the requeued job is cancelled"),
    # A rank stopped on bad input; srun killed the others: exit 143, but never requeued.
    "bad input": ([], None, False, [], [],
                  "end            bad input, not requeued: data.dataset: x.jsonl:3: not JSON; "
                  "exit code 2"),
}


RECORDED = {"lead signal": "time limit ahead (SIGUSR1 ",
            "outside scontrol requeue": "requeued by Slurm (scontrol requeue or preemption)",
            "time limit reached": "time limit reached (SIGTERM)",
            "controller unreachable": "SIGUSR1 (Slurm did not say when the job ends"}
"""The cause each requeue leaves in <run dir>/requeues (its start)."""


def _calls(env: dict[str, str], name: str) -> list[str]:
    """The stand-in's calls, one line of arguments each."""
    path = Path(env["FAKE_DIR"]) / f"{name}.calls"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_requeue_decision(tmp_path: Path, name: str) -> None:
    signals, squeue, cancel_record, scontrol, scancel, line = VERDICTS[name]
    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NAME="j", HPC_MCA_HOME=str(REPO), HPC_MCA_RANK_CMD="train")
    if name == "cancel racing the requeue":
        env["FAKE_CANCEL_ON_REQUEUE"] = "1"
    if name == "bad input":
        env.update(FAKE_BAD_INPUT="data.dataset: x.jsonl:3: not JSON", FAKE_SRUN_EXIT="143")
    config = tmp_path / "c.yaml"
    config.write_text("{}\n")
    fake = Path(env["FAKE_DIR"])
    (fake / "hold").touch()
    run_dir = tmp_path / "runs" / "j_4242"
    signal_file = run_dir / "signal_received"
    proc = _start(render_script(), tmp_path, [str(config)], env)
    deadline = time.monotonic() + 20
    while not (fake / "srun.args").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    for sent, sig in enumerate(signals, 1):
        if sig == "TERM" or squeue is not None and sent == len(signals):
            (fake / "squeue.out").write_text(f"{squeue}\n" if squeue else "")
        proc.send_signal(getattr(signal, f"SIG{sig}"))
        while (not signal_file.exists() or len(signal_file.read_text().splitlines()) < sent) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    if cancel_record:
        (run_dir / "cancel_requested").write_text("job=4242 time=0 user=me\n")
    (fake / "hold").unlink()
    out, _ = proc.communicate(timeout=30)
    assert line in out, out
    # ("show ..." calls are the node facts read for a hang's or a preflight's exclusion)
    assert [c for c in _calls(env, "scontrol") if not c.startswith("show ")] == scontrol, out
    assert _calls(env, "scancel") == scancel, out
    if "TERM" in signals:
        cause = {"COMPLETING|None|0|": "cancelled", "COMPLETING|None|1|": "requeued",
                 "COMPLETING|TimeLimit|0|": "timelimit"}[squeue]
        assert signal_file.read_text().splitlines()[-1].endswith(f"cause={cause}")
    # Not finished and not requeued: "stopped, not coming back" (75); bad input 2; requeued by
    # this shell or by Slurm (the job comes back: no FAILED batch step in accounting) 0.
    requeued = bool(scontrol and not scancel) or name == "outside scontrol requeue"
    expected = 2 if name == "bad input" else 0 if requeued else 75
    assert proc.returncode == expected, out
    # Each requeue, made or seen, is recorded with its cause for hpc-mca status and watch.
    from hpc_mca.slurm.status import read_requeues

    records = read_requeues(run_dir)
    assert [(r["job"], r["restart"]) for r in records] == ([("4242", "0")] if requeued else []), records
    if requeued:
        assert records[0]["why"].startswith(RECORDED[name]), records


def test_the_script_reads_the_run_dir_files_by_their_contract_names() -> None:
    from hpc_mca import rundir

    script = render_script()
    for name in (rundir.SIGNAL_FILE, rundir.CANCEL_FILE, rundir.BAD_INPUT_FILE,
                 rundir.FINISHED_FILE, rundir.REQUEUES_FILE,
                 f"{rundir.PREFLIGHT_DIR}/{rundir.PREFLIGHT_ENDED_FILE}"):
        assert f'"${{HPC_MCA_RUN_DIR}}/{name}"' in script, name
    exported = next(line for line in script.splitlines() if line.startswith("export HPC_MCA_HOME"))
    assert rundir.RUN_DIR_ENV in exported.split()
