"""Checkpoints without Slurm: the on-disk protocol, exact resume, SIGKILL during saves,
incompatible resumes (2 ranks under torchrun, CPU, fixed seeds).

The Slurm side (signals, requeue, other node counts) is in tests/test_requeue.py and
tests/test_resume_cli.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from trainer_fixtures import (
    TORCHRUN,
    assert_bad_input_on_every_rank,
    launch_ranks,
    make_model_dir,
    make_sft_data,
    processes_with_env,
    rewind,
    run_train,
    steps,
    write_config,
)

from hpc_mca.checkpoint import compat
from hpc_mca.checkpoint.requeue import read_signal_file
from hpc_mca.checkpoint.store import (
    CheckpointError,
    CheckpointInfo,
    complete_checkpoints,
    iter_name,
    latest_checkpoint,
    prune,
    read_info,
    read_tracker,
    resolve_checkpoint,
    write_tracker,
)

HOOKS = Path(__file__).with_name("checkpoint_hooks")
COMPARED = ("step", "loss", "tokens", "grad_norm", "lr", "skipped")
DIST_OPT = ("use_distributed_optimizer=true",)


def numbers(run_dir: Path) -> list[dict]:
    """steps.jsonl without the wall-clock field."""
    return [{k: s[k] for k in COMPARED} for s in steps(run_dir)]


def _marked(marker: str) -> list[str]:
    """``pid command`` of every live process started with HPC_MCA_TEST_RUN=<marker>."""
    return [f"{pid} {command}" for pid, command in
            processes_with_env(f"HPC_MCA_TEST_RUN={marker}").items()]


def train_killed(config: Path, run_dir: Path, kill: str, *overrides: str) -> subprocess.CompletedProcess:
    """``run_train`` with the kill hook (torchrun stops the other rank). ``.leftover`` lists
    the processes this run started (found by an environment marker, since torchrun gives each
    rank a session of its own) still alive 5 s after torchrun returned: the checkpoint
    writer's helpers must die with the SIGKILLed rank (they would hold the job step's output
    open). Whatever is left is killed before returning."""
    marker = f"{os.getpid()}-{run_dir.name}-{kill}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(HPC_MCA_DIST_TIMEOUT="120", PYTHONWARNINGS="ignore", PYTHONPATH=str(HOOKS),
               HPC_MCA_TEST_KILL=kill, HPC_MCA_TEST_RUN=marker)
    args = [*TORCHRUN, "--nproc-per-node=2", "-m", "hpc_mca", "train", str(config),
            f"training.output_dir={run_dir}", *overrides]
    out, err = run_dir.with_name(f"{run_dir.name}.out"), run_dir.with_name(f"{run_dir.name}.err")
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(args, stdout=stdout, stderr=stderr, env=env)
        try:
            code = proc.wait(timeout=300)
            deadline = time.monotonic() + 5
            while _marked(marker) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            leftover = _marked(marker)
            for line in leftover:
                try:
                    os.kill(int(line.split()[0]), signal.SIGKILL)
                except OSError:
                    pass
    done = subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())
    done.leftover = leftover  # type: ignore[attr-defined]
    return done


# --- the on-disk protocol (no torch) ---------------------------------------------------------


def _fake_checkpoint(root: Path, step: int) -> Path:
    path = root / iter_name(step)
    path.mkdir(parents=True)
    (path / "checkpoint.json").write_text(CheckpointInfo(step=step, consumed_samples=8 * step).to_json())
    return path


def test_tracker_names_only_complete_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "run" / "checkpoints"
    assert latest_checkpoint(tmp_path / "run") is None
    _fake_checkpoint(root, 2)
    (root / "iter_0000004.tmp").mkdir()  # a save that died
    write_tracker(root, iter_name(2))
    assert latest_checkpoint(tmp_path / "run") == root / "iter_0000002"
    assert resolve_checkpoint(tmp_path / "run") == root / "iter_0000002"
    assert read_info(root / "iter_0000002").consumed_samples == 16
    assert not list(root.glob(".*tmp"))  # the tracker's temp file was renamed away
    write_tracker(root, iter_name(4))
    with pytest.raises(CheckpointError, match="names iter_0000004, which is missing"):
        latest_checkpoint(tmp_path / "run")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        resolve_checkpoint(tmp_path / "nowhere")


def test_prune_keeps_the_newest_and_the_tracked(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        _fake_checkpoint(root, step)
    (root / "iter_0000010.tmp").mkdir()
    write_tracker(root, iter_name(2))  # e.g. a run resumed from an older one on purpose
    prune(root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "iter_0000006",
                                                       "iter_0000008", "latest"]
    prune(root, keep=None)  # keep all, but stale .tmp saves still go
    assert read_tracker(root) == "iter_0000002"


def test_incompatibilities_are_one_line_each() -> None:
    info = CheckpointInfo(
        step=40, consumed_samples=320, model={"hidden_size": 64, "num_layers": 4},
        layout={"tp": 2, "pp": 1, "dp": 2}, training={
            "global_batch_size": 8, "seed": 7, "use_distributed_optimizer": True,
            "optimizer_format": "dp_reshardable"})
    reasons = compat.incompatibilities(
        info, model={"hidden_size": 128, "num_layers": 4}, layout={"tp": 1, "pp": 1, "dp": 4},
        training={"global_batch_size": 16, "seed": 7, "use_distributed_optimizer": True})
    assert reasons == [
        ("the checkpoint at step 40 holds a different model: hidden_size 128 (checkpoint: 64); "
         "valid: the model it was trained with"),
        "training.global_batch_size=16 but the checkpoint at step 40 was saved with 8; valid: 8",
        ("parallel size tp=1 but the checkpoint's optimizer state (dp_reshardable) was saved with "
         "tp=2 and can only change data parallelism; valid: tp=2"),
    ]
    info.training["optimizer_format"] = "fully_reshardable"
    same = {"global_batch_size": 8, "seed": 7, "use_distributed_optimizer": True}
    assert compat.incompatibilities(info, info.model, {"tp": 1, "pp": 2, "dp": 1}, same) == []
    assert compat.describe_changes(info, {"tp": 1, "pp": 2, "dp": 1}) == "tp 2->1, pp 1->2, dp 2->1"


def test_synchronous_saves_write_views_in_place_and_only_their_bytes() -> None:
    """A shard that is a view into a larger buffer (DDP's parameter buffer, the optimizer's
    flat state, a factory's chunk) is written from where it is, not cloned: the tensor handed
    to torch.save shares its memory, serializes only its own bytes, and stays valid after the
    buffer's last other reference is gone (fully_reshardable's gathered temporaries)."""
    import gc
    import io

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from hpc_mca.checkpoint.checkpointer import _unclonable

    buffer = torch.nn.Parameter(torch.randn(4096))
    param = buffer[1024:2048].view(32, 32)                      # a view, like DDP's params
    gathered = torch.arange(3000, dtype=torch.bfloat16)
    temporary = gathered[1000:2000]                              # only the state dict keeps it
    expected_temporary = temporary.clone()
    fc1 = torch.randn(64, 16)                                    # split into gate and up

    def split(key, data, replica_id, flattened_range):
        gate, up = torch.chunk(data, 2)
        return {"gate": ShardedTensor.from_rank_offsets(f"{key}.gate", gate, replica_id=replica_id),
                "up": ShardedTensor.from_rank_offsets(f"{key}.up", up, replica_id=replica_id)}

    strided = torch.randn(16, 16).t()                            # not contiguous: cloned as before
    state = {"param": ShardedTensor.from_rank_offsets("param", param),
             "opt": [ShardedTensor.from_rank_offsets("opt", temporary)],
             "fc1": ShardedTensorFactory("fc1", fc1, split, lambda sub: None),
             "strided": ShardedTensor.from_rank_offsets("strided", strided)}
    del gathered, temporary
    state = _unclonable(state)
    gc.collect()
    [torch.randn(3000) for _ in range(50)]  # reuse freed memory, if any was freed

    shards = {"param": state["param"].data, "opt": state["opt"][0].data,
              "gate": state["fc1"]["gate"].data, "up": state["fc1"]["up"].data}
    assert shards["param"].data_ptr() == param.data_ptr()
    assert shards["gate"].data_ptr() == fc1.data_ptr()
    assert shards["up"].data_ptr() == fc1[32:].data_ptr()
    assert torch.equal(shards["opt"], expected_temporary)
    assert torch.equal(shards["param"], param) and torch.equal(shards["up"], fc1[32:])
    for name, shard in shards.items():
        assert shard.untyped_storage().nbytes() == shard.numel() * shard.element_size(), name
        written = io.BytesIO()
        torch.save(shard, written)
        assert written.tell() < shard.numel() * shard.element_size() + 2048, name
    assert state["strided"].data is strided


def test_signal_file_records(tmp_path: Path) -> None:
    path = tmp_path / "signal_received"
    assert read_signal_file(path) == (0, None)
    path.write_text("TERM 1700000005 job=1 restart=0\n")
    assert read_signal_file(path) == (2, 1700000005.0)
    path.write_text("USR1 1700000000.250 job=1 restart=0\nTERM 1700000009 job=1 restart=0\n")
    assert read_signal_file(path) == (2, 1700000000.25)
    path.write_text("TERM 1700000009.5 job=1 restart=0 cause=cancelled\n")  # the shell's verdict
    assert read_signal_file(path) == (2, 1700000009.5)


# --- training runs (torchrun, 2 ranks) -------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An uninterrupted 10-step DP=2 run with the distributed optimizer, a checkpoint every 2
    steps."""
    root = tmp_path_factory.mktemp("checkpoint")
    config = write_config(root, make_model_dir(root), make_sft_data(root, 256, seed=1, name="train"),
                          training={"save_steps": 2, "logging_steps": 1, "export_hf_dir": "hf"})
    proc = run_train(config, root / "reference", 2, *DIST_OPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return config, root / "reference"


@pytest.mark.slow
def test_reference_saved_every_interval_and_finished(reference: tuple[Path, Path]) -> None:
    config, run = reference
    assert [s["step"] for s in steps(run)] == list(range(1, 11))
    assert [step for step, _ in complete_checkpoints(run / "checkpoints")] == [2, 4, 6, 8, 10]
    assert read_tracker(run / "checkpoints") == "iter_0000010"
    info = read_info(run / "checkpoints" / "iter_0000006")
    assert (info.step, info.consumed_samples, info.reason) == (6, 48, "interval")
    assert info.layout["dp"] == 2 and info.training["optimizer_format"] == "model_space"
    assert json.loads((run / "finished").read_text())["step"] == 10
    progress = json.loads((run / "progress.json").read_text())
    assert progress["finished"] is True and progress["last_checkpoint"]["step"] == 10
    # The HF export at the end: same tensor names as the source model, new values.
    from safetensors.torch import load_file

    exported = load_file(run / "hf" / "model.safetensors")
    source = load_file(config.parent / "model" / "model.safetensors")
    assert exported.keys() == source.keys()
    assert not all((exported[k] == source[k]).all() for k in source)


@pytest.mark.slow
def test_resume_continues_exactly(reference: tuple[Path, Path], tmp_path: Path) -> None:
    """Killed after step 4's checkpoint (steps 5-6 were logged, not saved): the resumed run
    (async saves, keep-last-2) logs exactly the uninterrupted run's numbers."""
    config, ref = reference
    run = rewind(ref, tmp_path / "run", 4)
    assert [s["step"] for s in steps(run)][-1] == 10  # lines 5..10 will be trained again
    proc = run_train(config, run, 2, *DIST_OPT, "async_save=true", "save_total_limit=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'iter_0000004'} at step 4 (32 samples)" in proc.stdout
    assert numbers(run) == numbers(ref)
    assert [p.name for _, p in complete_checkpoints(run / "checkpoints")] == ["iter_0000008",
                                                                               "iter_0000010"]
    assert read_tracker(run / "checkpoints") == "iter_0000010"


@pytest.mark.slow
def test_sigkill_during_save_leaves_the_previous_checkpoint(reference: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    """Three runs, each SIGKILLed during a save at a different point of the commit protocol;
    after each, the tracker names the previous complete checkpoint and the next run resumes
    from it. The fourth run finishes; its log equals the uninterrupted run's."""
    config, ref = reference
    run = tmp_path / "run"
    # The second run saves asynchronously: its writer's helper process must die with the rank.
    kills = [("4:after_write:1", 2, ()), ("6:before_write:1", 4, ("async_save=true",)),
             ("8:before_tracker:0", 6, ())]
    for spec, previous, extra in kills:
        proc = train_killed(config, run, spec, *DIST_OPT, *extra)
        assert proc.returncode != 0 and "test hook: SIGKILL" in proc.stdout, proc.stdout[-2000:]
        assert proc.leftover == [], (spec, proc.leftover)  # nothing outlives the killed rank
        assert read_tracker(run / "checkpoints") == iter_name(previous), spec
        assert read_info(latest_checkpoint(run)).step == previous
        assert not (run / "finished").exists()
    assert (run / "checkpoints" / "iter_0000008" / "checkpoint.json").is_file()  # renamed, not tracked
    proc = run_train(config, run, 2, *DIST_OPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 6 (48 samples)" in proc.stdout
    assert numbers(run) == numbers(ref)
    assert not list((run / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_incompatible_or_missing_checkpoints_fail_in_one_line(reference: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    config, ref = reference
    run = rewind(ref, tmp_path / "run", 4)
    before = (run / "steps.jsonl").read_text()
    proc = run_train(config, run, 1, *DIST_OPT, "global_batch_size=16")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"hpc-mca train: error: cannot resume from {run / 'checkpoints' / 'iter_0000004'}: "
        "training.global_batch_size=16 but the checkpoint at step 4 was saved with 8; valid: 8")
    proc = run_train(config, run, 1, "resume_from_checkpoint=" + str(tmp_path / "none"))
    assert proc.returncode == 2 and "resume_from_checkpoint=" in proc.stderr
    assert "no checkpoint at" in proc.stderr.strip().splitlines()[-1]
    assert (run / "steps.jsonl").read_text() == before  # nothing was touched
    # A finished run started again trains nothing and says so in one line, before any
    # process group comes up; it stays finished.
    proc = run_train(config, ref, 1, *DIST_OPT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == (
        f"run {ref} finished at step 10 and this config trains to step 10: nothing to train. To "
        "extend it: max_steps=N with N > 10 (or more num_train_epochs; hpc-mca resume JOBID "
        "max_steps=N does it as a job); to start afresh: another output_dir")
    assert len(steps(ref)) == 10 and json.loads((ref / "finished").read_text())["step"] == 10


@pytest.mark.slow
def test_finished_run_extends_with_the_schedule_of_its_new_total(reference: tuple[Path, Path],
                                                                 tmp_path: Path) -> None:
    """max_steps 10 -> 20 on a finished run: steps 1-10 stay, 11-20 are trained at the rates of
    the cosine schedule defined for 20 steps (transformers' own, warmup 2), and the run is
    finished again at 20."""
    from transformers import get_scheduler

    config, ref = reference
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    proc = run_train(config, run, 2, *DIST_OPT, "max_steps=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "extending the run that finished at step 10 to 20 steps" in proc.stdout
    assert "LR schedule re-derived for this config: lr_decay_steps 10->20" in proc.stdout
    got = numbers(run)
    assert [s["step"] for s in got] == list(range(1, 21)) and got[:10] == numbers(ref)
    assert all(math.isfinite(s["loss"]) for s in got)
    hf = get_scheduler("cosine", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3),
                       num_warmup_steps=2, num_training_steps=20)
    rates = []
    for _ in range(20):
        hf.step()
        rates.append(hf.get_last_lr()[0])
    assert [s["lr"] for s in got[10:]] == pytest.approx(rates[10:], rel=1e-12, abs=1e-18)
    assert json.loads((run / "finished").read_text())["step"] == 20


@pytest.mark.slow
def test_dp_reshardable_resumes_on_fewer_ranks_and_refuses_tp(reference: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    """The faster optimizer format (no gather over DP) continues on 1 rank within 1e-5 — with
    the right Adam step: each parameter gets its own step tensor back — and a TP change
    stops in one line before anything is loaded."""
    config, ref = reference
    fmt = "save_optimizer_format=dp_reshardable"
    proc = run_train(config, tmp_path / "full", 2, *DIST_OPT, fmt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert numbers(tmp_path / "full") == numbers(ref)  # the format changes no numerics
    run = rewind(tmp_path / "full", tmp_path / "run", 4)
    assert read_info(latest_checkpoint(run)).training["optimizer_format"] == "dp_reshardable"
    ranks = launch_ranks(2, ["train", str(config), f"training.output_dir={run}", *DIST_OPT, fmt,
                             "tensor_model_parallel_size=2"])
    # Each rank stops alone before any collective; rank 0 says why.
    assert_bad_input_on_every_rank(ranks, "the checkpoint's optimizer state (dp_reshardable) was "
                                          "saved with tp=1 and can only change data parallelism; "
                                          "valid: tp=1")
    proc = run_train(config, run, 1, *DIST_OPT, fmt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layout changed: dp 2->1, world_size 2->1" in proc.stdout
    for mine, want in zip(numbers(run), numbers(ref)):
        assert mine["loss"] == pytest.approx(want["loss"], abs=1e-5), (mine, want)
        assert mine["lr"] == pytest.approx(want["lr"], rel=1e-9)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A tmpfs of a given size (root only: mount), unmounted afterwards."""
    mounts = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.fail("the disk-full tests mount a tmpfs and need root (as bin/test has)")
        point = tmp_path / f"disk{len(mounts)}"
        point.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                       check=True)
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _ranks_failed_for_space(ranks: list[subprocess.CompletedProcess], message: str) -> None:
    assert_bad_input_on_every_rank(ranks, message)  # exit 2 (never requeued), one line


@pytest.mark.slow
def test_a_full_disk_is_said_plainly_and_the_last_checkpoint_resumes(
        reference: tuple[Path, Path], small_disk) -> None:
    """Room for one checkpoint (2.9 MB) but not two: the save of step 4 is refused before it
    starts (free bytes vs the last checkpoint's size), every rank exits 2 with one line
    naming the directory, the bytes and the last good checkpoint; nothing partial is left;
    once there is room the run continues from step 2 and equals the uninterrupted run."""
    config, ref = reference
    disk = small_disk("4500k")
    run = disk / "run"
    train = ["train", str(config), f"training.output_dir={run}", *DIST_OPT]
    ranks = launch_ranks(2, train)
    root = run / "checkpoints"
    _ranks_failed_for_space(ranks, f"checkpoint iter_0000004 does not fit: {root} needs about ")
    assert "; the last good checkpoint is iter_0000002; free space there" in ranks[0].stderr
    assert read_tracker(root) == "iter_0000002" and not list(root.glob("*.tmp"))
    assert (run / "bad_input").is_file() is False  # no batch script here: no record
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    proc = run_train(config, run, 2, *DIST_OPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 2 (16 samples)" in proc.stdout
    assert numbers(run) == numbers(ref)


@pytest.mark.slow
def test_a_save_that_hits_a_full_disk_is_said_plainly(reference: tuple[Path, Path],
                                                      small_disk) -> None:
    """No earlier checkpoint to size the first save by: the writes themselves fail (ENOSPC
    inside torch's writer); the partial iter_0000002.tmp is removed and the line says so, in
    a batch job's run directory the reason is recorded for the batch script."""
    config, _ = reference
    disk = small_disk("1m")
    run = disk / "run"
    run.mkdir()
    env_run_dir = {"HPC_MCA_RUN_DIR": str(run)}
    ranks = launch_ranks(2, ["train", str(config), f"training.output_dir={run}", *DIST_OPT],
                         extra_env=env_run_dir)
    root = run / "checkpoints"
    _ranks_failed_for_space(ranks, f"checkpoint iter_0000002 does not fit: {root} needs more "
                                   "room")
    assert "there is no earlier checkpoint" in ranks[0].stderr
    assert not list(root.glob("iter_*")), list(root.iterdir())
    assert (run / "bad_input").read_text().startswith("checkpoint iter_0000002 does not fit")


def test_room_is_made_by_pruning_what_keep_last_k_would_prune(small_disk) -> None:
    """3 MiB disk, two 1.4 MB checkpoints: the next does not fit. With save_total_limit=2 the
    older one would go after the save anyway, so it goes before; the tracked one never does;
    without a limit nothing may go, and the reason names the directory and the bytes."""
    from hpc_mca.checkpoint.space import make_room

    root = small_disk("3m") / "checkpoints"
    for step in (1, 2):
        path = _fake_checkpoint(root, step)
        (path / "shard").write_bytes(b"\0" * 1_400_000)
    write_tracker(root, iter_name(2))
    reason, pruned = make_room(root, None, iter_name(3))
    assert pruned == [] and reason.startswith(f"checkpoint iter_0000003 does not fit: {root} "
                                              "needs about 1.5 MB and its file system has ")
    assert "the last good checkpoint is iter_0000002" in reason
    assert [p.name for _, p in complete_checkpoints(root)] == ["iter_0000001", "iter_0000002"]
    assert make_room(root, 2, iter_name(3)) == (None, [root / "iter_0000001"])
    assert [p.name for _, p in complete_checkpoints(root)] == ["iter_0000002"]
