"""Heartbeats rolled up per node (issue #62): every rank beats into a directory of its own node,
the node's lowest rank copies them into one shared file, and the watchdog reads those files
into the same beats as one file per rank gave. Who is named when a rank or a node's writer
freezes, what ranks that end leave behind, and the old per-rank files. Pure: no Slurm; time is
a clock the test moves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from hpc_mca.runtime import heartbeat, node_beats
from hpc_mca.runtime.heartbeat import Heartbeat
from hpc_mca.runtime.node_beats import LOCAL_ROOT_ENV, local_directory
from hpc_mca.slurm import watchdog
from hpc_mca.slurm.watchdog import read_beats, verdict

REPO = Path(__file__).resolve().parents[1]
T0 = 2_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The writers' clock (the lock's waits keep the real monotonic clock)."""
    c = Clock()
    fake = types.SimpleNamespace(time=c.time, monotonic=time.monotonic, sleep=time.sleep)
    monkeypatch.setattr(heartbeat, "time", fake)
    monkeypatch.setattr(node_beats, "time", fake)
    return c


@pytest.fixture
def shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The run's heartbeat directory; the nodes' local directories live beside it."""
    monkeypatch.setenv(LOCAL_ROOT_ENV, str(tmp_path / "node-local"))
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "heartbeat").mkdir()
    return tmp_path / "heartbeat"


def ranks(shared: Path, layout: dict[str, list[int]], hang_timeout: int = 20) -> dict[int, Heartbeat]:
    """One heartbeat per rank, on the nodes ``layout`` gives (nothing beats yet)."""
    return {r: Heartbeat(shared, r, hang_timeout=hang_timeout, ddp_timeout=120.0, node=node)
            for node, rs in layout.items() for r in rs}


def training(hbs: dict[int, Heartbeat], step: int) -> None:
    """Training starts at ``step`` on every rank; the test beats for the threads."""
    for hb in hbs.values():
        hb.start(step)
        hb.stop_beating()


def beat_all(hbs: dict[int, Heartbeat], *only: int) -> None:
    """A beat interval of these ranks: each writes its beat, then the aggregators copy them."""
    chosen = [hbs[r] for r in (only or hbs)]
    for hb in chosen:
        hb.beat(aggregate=False)
    for hb in chosen:
        hb.beat()


def node_files(shared: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(shared.glob("node-*.json"))}


def test_one_file_per_node_holds_each_local_ranks_beat(shared: Path, clock: Clock) -> None:
    hbs = ranks(shared, {"n1": [0, 1, 2], "n2": [3, 4]})
    training(hbs, 10)
    for r, hb in hbs.items():
        hb.step_done(11 + r, 0.5)
    beat_all(hbs)
    files = node_files(shared)
    assert [name.split(".")[0] for name in files] == ["node-n1", "node-n2"]
    assert sorted(p.name for p in shared.iterdir()) == sorted(files)  # no file per rank
    n1, n2 = files.values()
    assert (n1["node"], n1["writer"], n1["time"]) == ("n1", 0, T0)
    assert [(b["rank"], b["step"], b["phase"]) for b in n1["beats"]] == [(0, 11, "step"), (1, 12, "step"),
                                                                         (2, 13, "step")]
    assert n2["writer"] == 3 and [b["rank"] for b in n2["beats"]] == [3, 4]
    assert all(hb.beats_per_interval == 2 for hb in hbs.values())


def test_the_watchdog_reads_node_files_into_the_beats_rank_files_gave(
        shared: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def written(directory: Path) -> list[watchdog.Beat]:
        hbs = ranks(directory, {"n1": [0, 1], "n2": [2, 3]})
        training(hbs, 4)
        for r, hb in hbs.items():
            hb.step_done(5, 0.25 * (r + 1))
            hb.step_done(6, 0.75)
        with hbs[2].phase("save"):
            beat_all(hbs)
            return read_beats(directory)

    by_node = written(shared)
    monkeypatch.setenv(LOCAL_ROOT_ENV, "none")  # every rank its own shared file, as before
    (tmp_path / "per-rank").mkdir()
    by_rank = written(tmp_path / "per-rank")
    assert sorted(p.name for p in (tmp_path / "per-rank").iterdir()) == [f"rank-0000{r}.json" for r in range(4)]
    assert by_node == by_rank and [b.rank for b in by_node] == [0, 1, 2, 3]
    assert [(b.node, b.step, b.phase, b.median_step_s) for b in by_node] == [
        ("n1", 6, "step", 0.5), ("n1", 6, "step", 0.625), ("n2", 6, "save", 0.75), ("n2", 6, "step", 0.875)]


def test_a_frozen_aggregator_makes_its_whole_node_stale(shared: Path, clock: Clock) -> None:
    hbs = ranks(shared, {"n1": [0, 1], "n2": [2, 3]})
    training(hbs, 10)
    beat_all(hbs)
    clock.now = T0 + 24  # rank 0, n1's writer, stopped at T0: rank 1 beats on, uncopied
    beat_all(hbs, 1, 2, 3)
    hang = verdict(read_beats(shared), T0 + 25)
    assert hang is not None and [b.rank for b, _ in hang.named] == [0, 1] and hang.nodes == ["n1"]
    assert "rank 0 on n1, rank 1 on n1" in hang.line() and "no heartbeat for 25 s" in hang.line()


def test_a_frozen_rank_beside_a_live_aggregator_is_named_alone(shared: Path, clock: Clock) -> None:
    hbs = ranks(shared, {"n1": [0, 1], "n2": [2, 3]})
    training(hbs, 10)
    beat_all(hbs)
    clock.now = T0 + 24  # rank 1 stopped at T0: rank 0 copies its last beat as it was
    beat_all(hbs, 0, 2, 3)
    [n1, _] = node_files(shared).values()
    assert n1["time"] == T0 + 24 and [b["time"] for b in n1["beats"]] == [T0 + 24, T0]
    hang = verdict(read_beats(shared), T0 + 25)
    assert hang is not None and [b.rank for b, _ in hang.named] == [1] and hang.nodes == ["n1"]


def test_a_beat_is_never_newer_than_its_node_file(shared: Path) -> None:
    """Whatever the beats inside say, a node file not rewritten for 25 s is 25 s stale."""
    entry = {"rank": 0, "node": "n1", "pid": 7, "time": T0, "step": 3, "step_time": T0, "phase": "step",
             "phase_time": T0, "median_step_s": 0.5, "hang_timeout": 20, "ddp_timeout": 120.0, "interval": 2.0}
    (shared / "node-n1.x.json").write_text(json.dumps({"node": "n1", "time": T0 - 25, "writer": 0,
                                                       "beats": [entry]}))
    [beat] = read_beats(shared)
    assert beat.time == T0 - 25 and beat.step_time == T0
    hang = verdict([beat], T0)
    assert hang is not None and hang.nodes == ["n1"]


def test_ranks_that_end_leave_nothing_and_the_watchdog_ends(shared: Path, clock: Clock) -> None:
    hbs = ranks(shared, {"n1": [0, 1, 2], "n2": [3]})
    training(hbs, 10)
    beat_all(hbs)
    hbs[0].close()  # n1's writer ends first: the file goes on without it, rank 1 takes over
    [n1, _] = node_files(shared).values()
    assert [b["rank"] for b in n1["beats"]] == [1, 2]
    beat_all(hbs, 1, 2, 3)
    assert [f["writer"] for f in node_files(shared).values()] == [1, 3]

    def ranks_end(seconds: float) -> None:
        for r in (2, 1, 3):
            hbs[r].close()

    assert watchdog.watch(shared.parent, clock=clock.time, sleep=ranks_end) == 0
    assert list(shared.iterdir()) == [] and list((shared.parent / "node-local").iterdir()) == []
    assert not (shared.parent / "hangs.jsonl").exists()


def test_ranks_ending_together_never_leave_a_node_file(shared: Path) -> None:
    for trial in range(10):
        hbs = ranks(shared, {"n1": list(range(8))})
        beat_all(hbs)
        barrier = threading.Barrier(8)

        def end(hb: Heartbeat) -> None:
            barrier.wait()
            hb.close()

        threads = [threading.Thread(target=end, args=(hb,)) for hb in hbs.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert list(shared.iterdir()) == [], trial


def test_rank_files_are_still_read_beside_node_files(shared: Path, clock: Clock,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ranks(shared, {"n1": [0, 1]})[0].beat()
    monkeypatch.setenv(LOCAL_ROOT_ENV, "none")
    alone = Heartbeat(shared, 5, hang_timeout=20, ddp_timeout=120.0, node="n9")
    alone.beat()
    assert alone.local is None and alone.beats_per_interval == 1
    assert (shared / "rank-00005.json").exists()
    assert [(b.rank, b.node) for b in read_beats(shared)] == [(0, "n1"), (5, "n9")]
    alone.close()
    assert [b.rank for b in read_beats(shared)] == [0]


def test_ranks_that_share_no_local_directory_each_keep_their_own_file(
        shared: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A container with its own /dev/shm: each rank writes a node file of its own; none
    overwrites another's beats."""
    hbs = []
    for r in (0, 1):
        monkeypatch.setenv(LOCAL_ROOT_ENV, str(tmp_path / f"private-{r}"))
        hbs.append(Heartbeat(shared, r, hang_timeout=20, ddp_timeout=120.0, node="n1"))
    for hb in hbs:
        hb.beat()
    assert len(node_files(shared)) == 2 and [b.rank for b in read_beats(shared)] == [0, 1]


def test_the_node_local_directory_is_one_per_job_step_and_node(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1", "SLURM_STEP_ID": "0"}
    made = []
    try:
        here = local_directory(tmp_path, "n1", env)
        made.append(here)
        assert here is not None and here.name.startswith("hpc-mca-heartbeat-42-")
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
            assert here.parent == Path("/dev/shm")
        assert local_directory(tmp_path, "n1", env) == here  # the node's other ranks
        for other in ({**env, "SLURM_RESTART_COUNT": "2"}, {**env, "SLURM_STEP_ID": "1"}):
            made.append(local_directory(tmp_path, "n1", other))
            assert made[-1] not in (None, here)
        made.append(local_directory(tmp_path, "n2", env))  # the local Slurm's nodes share a host
        assert made[-1] not in (None, here)
        assert local_directory(tmp_path, "n1", {**env, LOCAL_ROOT_ENV: "none"}) is None
    finally:
        for path in made:
            if path is not None:
                path.rmdir()


def test_the_benchmark_counts_ranks_per_node_times_fewer_shared_operations() -> None:
    done = subprocess.run([sys.executable, "benchmarks/heartbeat_scale.py", "--nodes", "4", "--ranks-per-node", "8",
                           "--intervals", "2", "--repeats", "3"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert re.search(r"^ranks\s+32\s+32\s*$", out, re.M), out
    for row in ("shared files", "shared FS ops per interval", "shared FS ops/s at 30 s", "shared FS ops/s at 1 s"):
        ratio = re.search(rf"^{re.escape(row)}.*\s(\d+\.\d)x$", out, re.M)
        assert ratio is not None and float(ratio[1]) == 8.0, (row, out)
    assert re.search(r"^watchdog scan \(read_beats, median of 3\)\s+[\d.]+ ms\s+[\d.]+ ms", out, re.M), out
    assert re.search(r"^beats read per scan\s+32\s+32\s*$", out, re.M), out
