"""The hang watchdog and node exclusion (issue #42): which rank a hang is blamed on, the
allowances, the exclusion budget, the heartbeat files, the config's refusal, and on the real
local Slurm a frozen rank, a rank blocked in a collective and a slow rank (2-node jobs; the
4-node figures: benchmarks/hang_campaign.py).
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_mca.config.input import ConfigError
from hpc_mca.config.run_settings import check_run_settings
from hpc_mca.config.sections import TrainConfig
from hpc_mca.rundir import EXCLUDED_FILE, HANGS_FILE, HEARTBEAT_ENV, RANKS_ENDED_FILE, REQUEUE_VERDICT_FILE
from hpc_mca.runtime.heartbeat import Heartbeat, beat_interval, heartbeat_file
from hpc_mca.runtime.node_beats import LOCAL_ROOT_ENV
from hpc_mca.slurm import exclusion, watchdog
from hpc_mca.slurm.watchdog import Beat, read_beats, timeout_s, verdict

NOW = 1_000_000.0


@pytest.fixture(autouse=True)
def node_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The nodes' local heartbeat directories: the test's, not the machine's /dev/shm."""
    monkeypatch.setenv(LOCAL_ROOT_ENV, str(tmp_path / "node-local"))
    return tmp_path / "node-local"


def beat(rank: int, *, step: int = 10, ago: float = 1.0, step_ago: float = 1.0, phase: str = "step",
         phase_ago: float | None = None, hang: float | None = 20, ddp: float | None = 120,
         median: float | None = 0.5, node: str | None = None) -> Beat:
    """A heartbeat as a rank writes it, ``ago`` seconds old, its step ``step_ago`` old."""
    phase_ago = step_ago if phase_ago is None else phase_ago
    return Beat(rank=rank, node=node or f"n{rank + 1}", pid=100 + rank, time=NOW - ago, step=step,
                step_time=NOW - step_ago, phase=phase, phase_time=NOW - phase_ago,
                median_step_s=median, hang_timeout=hang, ddp_timeout=ddp,
                interval=beat_interval(int(hang) if hang else None))


def test_a_frozen_rank_is_named_by_its_stale_heartbeat() -> None:
    beats = [beat(0, step_ago=25), beat(1, ago=24, step_ago=25)]
    hang = verdict(beats, NOW)
    assert hang is not None and [b.rank for b, _ in hang.named] == [1]
    assert hang.nodes == ["n2"] and hang.step == 10 and hang.timeout_s == 20
    assert "rank 1 on n2" in hang.line() and "no heartbeat for 24 s" in hang.line()


def test_a_rank_blocked_in_a_collective_is_named_by_its_step() -> None:
    beats = [beat(0, step=11, step_ago=22), beat(1, step=10, step_ago=23), beat(2, step=11, step_ago=22)]
    hang = verdict(beats, NOW)
    assert hang is not None and [b.rank for b, _ in hang.named] == [1]
    assert "stuck in step 11, which the others finished" in hang.line()


def test_every_rank_alive_at_one_step_blames_no_node() -> None:
    hang = verdict([beat(0, step_ago=30), beat(1, step_ago=30)], NOW)
    assert hang is not None and hang.named == () and hang.nodes == []
    assert "no node is to blame" in hang.line()


def test_progress_within_the_timeout_is_no_hang() -> None:
    # A slow rank: each step takes 15 s, the last finished 15 s ago (timeout 20 s).
    assert verdict([beat(0, step_ago=15, median=15), beat(1, step_ago=15, median=15)], NOW) is None
    assert verdict([], NOW) is None


def test_first_step_saves_and_evaluations_get_the_collective_timeout() -> None:
    for phase in ("first", "save", "eval"):
        beats = [beat(0, phase=phase, step_ago=100), beat(1, phase=phase, step_ago=100)]
        assert verdict(beats, NOW) is None, phase
        beats = [beat(0, phase=phase, step_ago=121), beat(1, phase=phase, step_ago=121)]
        assert verdict(beats, NOW) is not None, phase
    # ... but a rank whose heartbeat stopped is stopped, whatever it was doing
    hang = verdict([beat(0, phase="save", step_ago=30), beat(1, phase="save", step_ago=30, ago=25)], NOW)
    assert hang is not None and hang.nodes == ["n2"]


def test_the_automatic_timeout_follows_the_median_step_below_the_collective_timeout() -> None:
    auto = dict(hang=None, ddp=1800)
    assert timeout_s([beat(0, median=2.0, **auto)]) == 300  # the floor
    assert timeout_s([beat(0, median=2.0, **auto), beat(1, median=50.0, **auto)]) == 500
    assert timeout_s([beat(0, median=200.0, **auto)]) == 0.8 * 1800
    assert timeout_s([beat(0, hang=0)]) is None and verdict([beat(0, hang=0, step_ago=1e6)], NOW) is None
    assert timeout_s([beat(0, hang=45)]) == 45


def test_exclusion_respects_the_budget_and_the_nodes_left() -> None:
    usable = [f"n{i}" for i in range(1, 7)]
    ex = exclusion.decide(["n2"], usable=usable, job_excluded=["n9"], already=[], budget=2,
                          job_nodes=4, job_id="7")
    assert ex.exclude == ("n9", "n2") and ex.added == ("n2",) and ex.end is None
    ex = exclusion.decide(["n2", "n3"], usable=usable, job_excluded=["n5"], already=["n5"], budget=2,
                          job_nodes=2, job_id="7")
    assert ex.added == ("n2",) and ex.over_budget == ("n3",) and ex.exclude == ("n5", "n2")
    assert "n3 not excluded: the budget" in ex.summary()
    ex = exclusion.decide(["n2"], usable=usable[:4], job_excluded=[], already=[], budget=2,
                          job_nodes=4, job_id="7")
    assert ex.end == ("excluding n2 would leave 3 usable node(s) (n1,n3,n4) for a 4-node job: not "
                      "requeued; continue on fewer nodes with: hpc-mca resume 7 --nodes 3")


def test_the_verdict_and_records_for_the_batch_shell(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_RESTART_COUNT": "1",
           exclusion.USABLE_ENV: "n1,n2,n3,n4", exclusion.JOB_EXCLUDED_ENV: "",
           exclusion.BUDGET_ENV: "1"}
    exclusion.decide_for_job(tmp_path, ["n2"], "hang: x", env)
    assert (tmp_path / REQUEUE_VERDICT_FILE).read_text() == ("why=hang: x; excluding n2 from the next "
                                                             "start\nexclude=n2\nend=\n")
    records = exclusion.read_excluded(tmp_path)
    assert [(r["node"], r["reason"], r["restart"]) for r in records] == [("n2", "hang: x", 1)]
    exclusion.decide_for_job(tmp_path, ["n3"], "hang: y", {**env, exclusion.JOB_EXCLUDED_ENV: "n2"})
    assert "exclude=\n" in (tmp_path / REQUEUE_VERDICT_FILE).read_text()  # budget spent
    assert [r["node"] for r in exclusion.read_excluded(tmp_path)] == ["n2"]


def test_the_heartbeat_files_the_watchdog_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HEARTBEAT_ENV, str(tmp_path))
    monkeypatch.setenv("SLURMD_NODENAME", "n7")
    hb = Heartbeat.from_env(3, hang_timeout=20, ddp_timeout=120.0)
    assert hb is not None and hb.interval == 2.0
    hb.start(5)
    hb.step_done(6, 0.5)
    hb.step_done(7, 1.5)
    with hb.phase("save"):
        hb.beat()
        [saving] = read_beats(tmp_path)
    hb.beat()
    [after] = read_beats(tmp_path)
    assert (saving.rank, saving.node, saving.step, saving.phase) == (3, "n7", 7, "save")
    assert (after.phase, after.median_step_s, after.hang_timeout, after.ddp_timeout) == ("step", 1.0, 20, 120.0)
    assert [p.name.split(".")[0] for p in tmp_path.glob("*.json")] == ["node-n7"]  # its node's file
    hb.close()
    assert read_beats(tmp_path) == []  # an ended rank is never taken for a frozen one
    assert Heartbeat.from_env(0, hang_timeout=0, ddp_timeout=None) is None
    [off] = read_beats(tmp_path)
    assert off.hang_timeout == 0 and timeout_s([off]) is None


def _job_of_two_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch environment of job 7 on two of the usable nodes n1-n3, nothing excluded."""
    for key, value in {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_RESTART_COUNT": "0",
                       exclusion.USABLE_ENV: "n1,n2,n3", exclusion.JOB_EXCLUDED_ENV: ""}.items():
        monkeypatch.setenv(key, value)


def test_watch_records_a_hang_and_exits_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _job_of_two_nodes(monkeypatch)
    beats = tmp_path / "heartbeat"
    beats.mkdir()
    for b in (beat(0, step_ago=25), beat(1, ago=24, step_ago=25)):
        (beats / f"rank-{b.rank:05d}.json").write_text(json.dumps(dataclasses.asdict(b)))
    assert watchdog.watch(tmp_path, clock=lambda: NOW, sleep=lambda s: None) == 3
    [record] = [json.loads(line) for line in (tmp_path / HANGS_FILE).read_text().splitlines()]
    assert record["ranks"][0]["node"] == "n2" and record["excluded"] == ["n2"] and record["step"] == 10
    assert json.loads((tmp_path / EXCLUDED_FILE).read_text())["nodes"][0]["node"] == "n2"
    # Healthy ranks that then end (each removes its heartbeat): the watchdog ends too.
    for b in (beat(0), beat(1)):
        (beats / f"rank-{b.rank:05d}.json").write_text(json.dumps(dataclasses.asdict(b)))

    def ranks_end(seconds: float) -> None:
        assert seconds == 2.0  # a beat interval
        for path in beats.iterdir():
            path.unlink()

    assert watchdog.watch(tmp_path, clock=lambda: NOW, sleep=ranks_end) == 0


def test_watch_ends_when_the_batch_shell_says_the_ranks_ended(tmp_path: Path) -> None:
    """No rank ever beat (they ended before the watchdog started): it watches, every beat
    interval, until the batch shell writes ranks_ended, then ends without a verdict."""
    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            (tmp_path / RANKS_ENDED_FILE).touch()

    assert watchdog.watch(tmp_path, clock=lambda: NOW, sleep=nap) == 0
    assert naps == [2.0, 2.0, 2.0] and not (tmp_path / HANGS_FILE).exists()


@pytest.mark.parametrize("value", [-1, 120, 500])
def test_a_hang_timeout_the_collective_timeout_would_beat_is_refused(value: int) -> None:
    config = TrainConfig()
    config.training.ddp_timeout, config.training.hang_timeout = 120, value
    with pytest.raises(ConfigError, match=rf"training.hang_timeout={value} must be 0 .* below "
                                          r"training.ddp_timeout=120"):
        check_run_settings(config, 1)
    config.training.hang_timeout = 119
    check_run_settings(config, 1)


# ---- on the local Slurm ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(slurm_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> dict:
    import fault_campaign

    root = tmp_path_factory.mktemp("hangs")
    config, reference = fault_campaign.prepare(root)
    return {"root": root, "config": config, "reference": reference}


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["freeze", "block", "freeze-start", "freeze-pg", "freeze-data",
                                  "freeze-load", "freeze-save"])
def test_a_hung_rank_is_requeued_without_its_node_and_the_run_stays_exact(setup: dict, kind: str) -> None:
    """A rank frozen mid-step, blocked in a collective, frozen while it starts (at its first
    heartbeat, after its process group, in data preparation, in the checkpoint load of a
    restart) or in its first save: named, its node excluded, the run's numbers those of an
    uninterrupted run."""
    import hang_campaign as campaign

    t = campaign.trial(kind, setup["config"], setup["reference"], setup["root"] / kind, random.Random())
    print(f"\n{t}\n{campaign.table([t])}")
    outside = kind == "freeze-load"  # its restart came from an outside requeue first
    assert t.state == "COMPLETED" and t.equal and t.restarts == 1 + outside, t
    assert t.node in t.excluded and t.restart_nodes and t.node not in t.restart_nodes, t
    assert t.requeue_s is not None and t.requeue_s <= campaign.HANG_TIMEOUT_S + 60, t
    [hang] = t.hangs
    assert [(r["rank"], r["node"]) for r in hang["ranks"]] == [(t.rank, t.node)], hang
    why = "stuck in step" if kind == "block" else "no heartbeat"
    assert why in hang["ranks"][0]["why"] and hang["excluded"] == [t.node], hang
    hpc_mca = str(Path(sys.executable).with_name("hpc-mca"))
    shown = subprocess.run([hpc_mca, "status", t.job_id, "--runs-root", str(setup["root"] / kind / "runs")],
                           capture_output=True, text=True)
    assert f"rank {t.rank} on {t.node}" in shown.stdout and f"excluded    {t.node} (restart {int(outside)}: hang)" \
        in shown.stdout, shown.stdout + shown.stderr


@pytest.mark.slurm
@pytest.mark.slow
def test_a_slow_rank_that_progresses_is_not_stopped(setup: dict) -> None:
    import hang_campaign as campaign

    t = campaign.trial("slow", setup["config"], setup["reference"], setup["root"] / "slow", random.Random())
    # 40 steps of at least SLOW_S s each: far longer in all than the 8 s hang timeout
    assert t.state == "COMPLETED" and t.equal and t.restarts == 0 and t.hangs == [], t


def test_a_continuation_keeps_the_excluded_nodes_away(tmp_path: Path) -> None:
    from hpc_mca.slurm.continuation import _submit_options
    from hpc_mca.slurm.manifest import Run

    (tmp_path / EXCLUDED_FILE).write_text(json.dumps({"nodes": [
        {"node": "n2", "reason": "hang: x", "restart": 0}, {"node": "n4", "reason": "preflight: y"}]}))
    run = Run(tmp_path, "7", None, {"sbatch": {"time": "00:10:00", "extra": ["--exclude=n9",
                                                                             "--exclusive"]}})
    assert _submit_options(run, tmp_path, {}).sbatch_args == ("--exclusive", "--exclude=n9,n2,n4")
    (tmp_path / EXCLUDED_FILE).unlink()
    assert _submit_options(run, tmp_path, {}).sbatch_args == ("--exclude=n9", "--exclusive")


# ---- the batch shell's side (stand-ins for srun, squeue, scontrol, scancel and the watchdog) ----

SHELL_FAKES = {
    # srun holds until scancel kills the step
    "srun": '#!/bin/bash\ntouch "${FAKE_DIR}/started"\n'
            'while [[ -e "${FAKE_DIR}/hold" ]]; do sleep 0.05; done\nexit 137\n',
    "squeue": '#!/bin/bash\nif [[ "$*" == *" -s "* ]]; then printf "4242.0\\n4242.batch\\n"; '
              'else echo "RUNNING|None|0|"; fi\n',
    "scontrol": '#!/bin/bash\necho "$*" >>"${FAKE_DIR}/scontrol.calls"\n'
                'if [[ "$1 $2" == "show hostnames" ]]; then echo n1; echo n2; fi\n',
    "sinfo": '#!/bin/bash\nprintf "n1 alloc\\nn2 alloc\\nn3 idle\\n"\n',
    "scancel": '#!/bin/bash\necho "$*" >>"${FAKE_DIR}/scancel.calls"\nrm -f "${FAKE_DIR}/hold"\n',
}
# The watchdog: once the ranks run, it leaves the verdict FAKE_VERDICT and exits 3 (a hang).
FAKE_LAUNCHER = ('#!/bin/bash\n[[ "$1" == watchdog ]] || exit 1\n'
                 'while [[ ! -e "${FAKE_DIR}/started" ]]; do sleep 0.05; done\n'
                 'printf "%b" "${FAKE_VERDICT}" >"${HPC_MCA_RUN_DIR}/requeue_verdict"\nexit 3\n')


@pytest.mark.parametrize("end", [False, True])
def test_the_batch_shell_kills_the_ranks_requeues_then_excludes(tmp_path: Path, end: bool) -> None:
    import os

    from hpc_mca.slurm.script import render_script

    fake, home = tmp_path / "fake", tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    fake.mkdir()
    for path, text in [*((fake / n, t) for n, t in SHELL_FAKES.items()),
                       (home / "bin" / "hpc-mca-rank", FAKE_LAUNCHER)]:
        path.write_text(text)
        path.chmod(0o755)
    (fake / "hold").touch()
    (tmp_path / "c.yaml").write_text("{}\n")
    gone = "excluding n2 would leave 1 usable node(s) (n1) for a 2-node job: not requeued" if end else ""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPC_MCA_"))}
    env.update(PATH=f"{fake}:{env['PATH']}", FAKE_DIR=str(fake), SLURM_JOB_ID="4242", SLURM_JOB_NAME="j",
               SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="n[1-2]",
               HPC_MCA_HOME=str(home), HPC_MCA_PLAN="given",
               FAKE_VERDICT=f"why=hang: rank 1 on n2 stopped\\nexclude=n2\\nend={gone}\\n")
    (tmp_path / "job.sbatch").write_text(render_script())
    done = subprocess.run(["bash", str(tmp_path / "job.sbatch"), str(tmp_path / "c.yaml")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    assert "hpc-mca | hang           hang: rank 1 on n2 stopped; killing the ranks" in out, out
    assert (fake / "scancel.calls").read_text() == "--signal=KILL 4242.0\n"  # not the batch step
    calls = [c for c in (fake / "scontrol.calls").read_text().splitlines() if not c.startswith("show ")]
    if end:  # too few nodes left: the job ends, stopped
        assert calls == [] and done.returncode == 75, out
        assert f"end            hang: rank 1 on n2 stopped: {gone}; exit code 75" in out, out
    else:  # the ExcNodeList only once the job is pending again
        assert calls == ["requeue 4242", "update job=4242 ExcNodeList=n2"] and done.returncode == 0, out
        assert "hpc-mca | exclude        the next start runs without n2" in out, out


@pytest.mark.parametrize("value", [1, 4])
def test_a_hang_timeout_below_the_heartbeats_resolution_is_refused(value: int) -> None:
    config = TrainConfig()
    config.training.hang_timeout = value
    with pytest.raises(ConfigError, match=rf"training.hang_timeout={value} is below 5 s"):
        check_run_settings(config, 1)
    config.training.hang_timeout = 5
    check_run_settings(config, 1)


def test_a_resume_refuses_a_hang_timeout_its_own_steps_would_exceed(tmp_path: Path) -> None:
    """The run recorded 4 s steps: a 10 s hang timeout would take healthy steps for hangs."""
    (tmp_path / "steps.jsonl").write_text("".join(
        json.dumps({"step": n, "loss": 1.0, "seconds": 4.0 + 0.1 * (n % 2)}) + "\n" for n in range(1, 40)))
    config = TrainConfig()
    config.training.output_dir, config.training.hang_timeout = str(tmp_path), 10
    with pytest.raises(ConfigError, match=r"hang_timeout=10 is below 3 x this run's median step "
                                          r"time \(4\.1 s .*at least 13 s"):
        check_run_settings(config, 1)
    config.training.hang_timeout = 13
    check_run_settings(config, 1)
    config.training.hang_timeout, config.training.overwrite_output_dir = 10, True  # a new run
    check_run_settings(config, 1)


def test_a_configured_timeout_allows_three_of_the_slowest_ranks_steps() -> None:
    beats = [beat(0, hang=5, median=0.5), beat(1, hang=5, median=4.0)]
    assert timeout_s(beats) == 12.0
    assert verdict([beat(0, hang=5, median=4.0, step_ago=11)], NOW) is None


# ---- ranks that start: absent, frozen or stuck before training ----------------------------------


def expected(ranks: int, started_ago: float, startup: float | None = None) -> watchdog.Expected:
    return watchdog.Expected(ranks, NOW - started_ago, lambda r: f"n{r + 1}", startup)


def test_a_rank_that_never_beat_is_named_with_its_node() -> None:
    beats = [beat(0, phase="start", step=0, step_ago=70), beat(1, phase="start", step=0, step_ago=70)]
    assert verdict(beats, NOW, expected(3, 59)) is None  # within a first beat's allowance
    hang = verdict(beats, NOW, expected(3, 61))
    assert hang is not None and [(b.rank, b.node) for b, _ in hang.named] == [(2, "n3")]
    assert hang.nodes == ["n3"] and "never beat in 61 s" in hang.line()
    # a rank that beat before and ended (its file removed) is not absent
    assert verdict(beats, NOW, expected(3, 61), seen=frozenset({2})) is None


def test_a_rank_frozen_while_it_starts_goes_stale_like_one_frozen_mid_run() -> None:
    beats = [beat(0, phase="start", step=0, step_ago=30), beat(1, ago=25, phase="start", step=0, step_ago=30)]
    hang = verdict(beats, NOW, expected(2, 30))
    assert hang is not None and hang.nodes == ["n2"] and "(phase start)" in hang.line()
    # Before its config a starting rank beats every 10 s: stale after 30 s, whatever the hang
    # timeout (20 s here, from the configured rank), and only it is named then.
    unconfigured = dataclasses.replace(beats[1], hang_timeout=None, ddp_timeout=None, interval=10.0)
    assert verdict([beats[0], unconfigured], NOW, expected(2, 30)) is None
    hang = verdict([beats[0], dataclasses.replace(unconfigured, time=NOW - 31)], NOW, expected(2, 31))
    assert hang is not None and [b.rank for b, _ in hang.named] == [1]


def test_a_rank_alive_but_stuck_starting_is_named_after_the_start_allowance() -> None:
    """Floor 300 s, or 3 x the previous start's measured start-up."""
    beats = [beat(0, phase="start", step=0, step_ago=310), beat(1, phase="first", step=0, step_ago=100)]
    hang = verdict(beats, NOW, expected(2, 310))
    assert hang is not None and hang.nodes == ["n1"] and "still starting after 310 s" in hang.line()
    assert verdict(beats, NOW, expected(2, 310, startup=120.0)) is None  # allowance 360 s


def test_the_task_layout_of_a_job_step() -> None:
    from hpc_mca.slurm.tasks import UNKNOWN, TaskLayout, expand_counts

    assert expand_counts("4(x2),2") == [4, 4, 2] and expand_counts("1") == [1]
    assert expand_counts("junk") == [] and expand_counts("") == []
    layout = TaskLayout("n[1-3]", "2(x2),1")
    layout.__dict__["hosts"] = ["n1", "n2", "n3"]  # what scontrol show hostnames prints
    assert [layout.node_of(t) for t in range(6)] == ["n1", "n1", "n2", "n2", "n3", UNKNOWN]


def test_a_starting_process_beats_before_its_config_and_training_takes_it_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_mca.runtime import heartbeat

    monkeypatch.setenv(HEARTBEAT_ENV, str(tmp_path))
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURMD_NODENAME", "n5")
    early = heartbeat.begin()
    try:
        assert early is not None and heartbeat.begin() is early
        [starting] = read_beats(tmp_path)
        assert (starting.rank, starting.node, starting.phase, starting.hang_timeout) == (2, "n5", "start", None)
        heartbeat.configure_process(20, 120.0)
        early.beat()
        [configured] = read_beats(tmp_path)
        assert (configured.hang_timeout, configured.ddp_timeout, configured.interval) == (20, 120.0, 2.0)
        assert Heartbeat.from_env(2, hang_timeout=20, ddp_timeout=120.0) is early
        early.start(0)
        [training] = read_beats(tmp_path)
        assert training.phase == "first" and training.step == 0
    finally:
        early.close() if early is not None else None
    assert read_beats(tmp_path) == [] and heartbeat._PROCESS is None


def test_watch_names_a_rank_of_the_step_that_never_beat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _job_of_two_nodes(monkeypatch)
    directory = tmp_path / "heartbeat"
    directory.mkdir()
    b = beat(0, phase="start", step=0, ago=0.0, phase_ago=0.0)
    heartbeat_file(directory, 0).write_text(json.dumps(dataclasses.asdict(b)))
    times = iter([NOW - 61, NOW - 30, NOW])  # the first read sees rank 0's beat
    env = {"SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_NODELIST": ""}
    assert watchdog.watch(tmp_path, clock=lambda: next(times), sleep=lambda s: None, env=env) == watchdog.EXIT_HANG
    [record] = [json.loads(line) for line in (tmp_path / HANGS_FILE).read_text().splitlines()]
    assert [r["rank"] for r in record["ranks"]] == [1] and "never beat" in record["ranks"][0]["why"]
    assert record["excluded"] == []  # no layout to tell its node: requeued, nothing excluded
