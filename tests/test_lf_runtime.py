"""LLaMA-Factory's run keys that change what a run does (issue #39): overwrite_output_dir,
resume_from_checkpoint: true, dataloader_num_workers, save_only_model, plot_loss and
ddp_timeout, on both backends.

Each backend trains the demo twice for 2 steps (one rank): a reference with the defaults and
a run with the LF keys set (module fixtures); the tests read what the two left behind. The
requeue case of overwrite_output_dir is shown at unit level, with the environment Slurm gives
a requeued job (SLURM_RESTART_COUNT) and the files a run directory keeps.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path

import pytest
from trainer_fixtures import rank_env, run_ranks, steps

from hpc_mca.checkpoint import afresh
from hpc_mca.checkpoint.compat import checkpoint_to_load
from hpc_mca.config.input import ConfigError
from hpc_mca.config.loading import load_config
from hpc_mca.launch.run import start_afresh_if_asked
from hpc_mca.rundir import MANIFEST_FILE, PROGRESS_FILE
from hpc_mca.runtime.env import from_environ

DEMO = Path(__file__).resolve().parents[1] / "hpc_mca" / "assets" / "demo" / "sft_addition.yaml"
SHORT = ("max_steps=2", "logging_steps=1", "save_steps=1", "report_to=none")
LF_KEYS = ("plot_loss=true", "save_only_model=true", "ddp_timeout=180000000",
           "dataloader_num_workers=2")
BACKENDS = {"megatron": "use_mca=true", "standard": "use_mca=false"}


def _env() -> dict[str, str]:
    """The test environment without the suite's short collective timeout, so that the run's
    own ddp_timeout is the one in force."""
    env = rank_env()
    env.pop("HPC_MCA_DIST_TIMEOUT", None)
    return env


def _train(run_dir: Path, *overrides: str):
    return run_ranks(1, ["train", str(DEMO), f"output_dir={run_dir}", *SHORT, *overrides],
                     env=_env(), timeout=300)


@pytest.fixture(scope="module", params=list(BACKENDS))
def runs(request, tmp_path_factory):
    """(backend, reference run, its log, LF-keys run, its log)."""
    root = tmp_path_factory.mktemp(f"lf_{request.param}")
    done = {}
    for name, keys in (("reference", ()), ("lf", LF_KEYS)):
        proc = _train(root / name, BACKENDS[request.param], *keys)
        assert proc.returncode == 0, proc.stderr[-3000:]
        done[name] = proc
    return request.param, root / "reference", done["reference"], root / "lf", done["lf"]


# --- dataloader_num_workers ---------------------------------------------------------------


def test_dataloader_num_workers(runs, tmp_path):
    """Worker processes hand out the very batches the training process reads itself, for the
    training stream (from a resumed position too) and the evaluation pass: the runs' curves
    are equal."""
    from hpc_mca.data.dataset import build_datasets, eval_dataloader, train_dataloader

    config = load_config(DEMO, [f"output_dir={tmp_path}"]).resolve(1)
    data = build_datasets(config.data, config.data_run())

    def batches(workers: int) -> list:
        view = load_config(DEMO, [f"output_dir={tmp_path}", f"dataloader_num_workers={workers}"]
                           ).resolve(1).data_run()
        assert view.num_workers == workers
        train = train_dataloader(data.train, view, data_parallel_rank=0, consumed_samples=8)
        got = [b for b, _ in zip(train, range(5))]
        return got + list(eval_dataloader(data.eval, view, data_parallel_rank=0))

    for mine, ref in zip(batches(2), batches(0), strict=True):
        for key in ("input_ids", "position_ids", "labels"):
            assert getattr(mine, key).equal(getattr(ref, key)), key
    _, reference, _, lf, _ = runs
    for mine, ref in zip(steps(lf), steps(reference), strict=True):
        assert (mine["loss"], mine["grad_norm"]) == (ref["loss"], ref["grad_norm"])
    with pytest.raises(ConfigError, match="dataloader_num_workers=-1"):
        load_config(DEMO, ["dataloader_num_workers=-1"]).resolve(1)


def test_dataloader_prefetch_factor(tmp_path):
    """Workers that prepare more micro-batches ahead hand out the very same batches; the
    setting is refused where torch would not prefetch (no workers) or below one batch."""
    from hpc_mca.data.dataset import build_datasets, train_dataloader

    config = load_config(DEMO, [f"output_dir={tmp_path}"]).resolve(1)
    data = build_datasets(config.data, config.data_run())

    def batches(*overrides: str) -> list:
        view = load_config(DEMO, [f"output_dir={tmp_path}", *overrides]).resolve(1).data_run()
        loader = train_dataloader(data.train, view, data_parallel_rank=0, consumed_samples=8)
        assert loader.prefetch_factor == (view.prefetch_factor if view.num_workers else None)
        return [b for b, _ in zip(loader, range(6))]

    for mine, ref in zip(batches("dataloader_num_workers=2", "dataloader_prefetch_factor=4"), batches(),
                         strict=True):
        for key in ("input_ids", "position_ids", "labels"):
            assert getattr(mine, key).equal(getattr(ref, key)), key
    for bad in (["dataloader_prefetch_factor=2"], ["dataloader_num_workers=1", "dataloader_prefetch_factor=0"]):
        with pytest.raises(ConfigError, match="dataloader_prefetch_factor=.*valid: null"):
            load_config(DEMO, bad).resolve(1)


# --- save_only_model ----------------------------------------------------------------------


def _saved_parts(checkpoint: Path, backend: str) -> set[str]:
    if backend == "standard":
        return {p.name for p in checkpoint.iterdir()}
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {key.split(".")[0].split("/")[0] for key in keys}


def test_save_only_model(runs):
    """Its checkpoints hold the model without the optimizer (and scheduler) state the
    reference's hold; a resume from one, as a requeue would make it, is refused in one line
    naming the setting, before anything trains."""
    backend, reference, _, lf, _ = runs
    name = "checkpoints/iter_0000002"
    full, model_only = _saved_parts(reference / name, backend), _saved_parts(lf / name, backend)
    state = {"optimizer.pt", "scheduler.pt"} if backend == "standard" else {"optimizer"}
    assert state <= full and not state & model_only, (full, model_only)
    assert json.loads((lf / name / "checkpoint.json").read_text())["training"]["save_only_model"]
    proc = _train(lf, BACKENDS[backend], "max_steps=4")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "saved with training.save_only_model=true" in proc.stderr
    assert "step 3" not in proc.stdout


# --- plot_loss ----------------------------------------------------------------------------


def test_plot_loss(runs):
    """Rank 0 draws the curves into output_dir at the end (the reference draws nothing)."""
    _, reference, _, lf, proc = runs
    png = lf / "training_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"training.plot_loss: wrote {png}: loss" in proc.stdout
    assert not (reference / "training_loss.png").exists()


# --- ddp_timeout --------------------------------------------------------------------------


def test_ddp_timeout(runs):
    """The process group's collectives wait as long as ddp_timeout says (LF's 180000000 s is
    accepted), read back from the group; the default is transformers' 1800 s. Not positive:
    refused in one line."""
    _, _, ref_proc, _, lf_proc = runs
    assert "process group: gloo, 1 rank(s), collective timeout 1800 s" in ref_proc.stdout
    assert "collective timeout 180000000 s" in lf_proc.stdout
    with pytest.raises(ConfigError, match="ddp_timeout=0 must be a positive"):
        load_config(DEMO, ["ddp_timeout=0"]).resolve(1)


# --- resume_from_checkpoint: true ---------------------------------------------------------


def test_resume_from_checkpoint_true(runs, tmp_path):
    """true means output_dir's latest checkpoint (transformers' meaning), refused in one line
    when there is none (null stays auto: start afresh then)."""
    backend, reference, _, _, _ = runs
    training = load_config(DEMO, [f"output_dir={reference}", "resume_from_checkpoint=true"]).training
    assert training.resume_from_checkpoint == "latest"
    assert checkpoint_to_load(training) == reference / "checkpoints" / "iter_0000002"
    null = load_config(DEMO, [f"output_dir={tmp_path}", "resume_from_checkpoint=null"]).training
    assert null.resume_from_checkpoint == "auto" and checkpoint_to_load(null) is None
    proc = _train(tmp_path / "empty", BACKENDS[backend], "resume_from_checkpoint=true")
    assert proc.returncode == 2
    assert "resume_from_checkpoint=latest (true): output_dir" in proc.stderr
    assert "holds no checkpoint" in proc.stderr


# --- overwrite_output_dir -----------------------------------------------------------------


def test_overwrite_output_dir(runs, tmp_path):
    """A finished run started again with overwrite_output_dir (and LF's resume: null) is
    moved aside whole to <output_dir>.previous-<UTC time>, and the new run trains from step 1
    instead of stopping with "nothing to train"."""
    backend, reference, _, _, _ = runs
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    proc = _train(run, BACKENDS[backend], "overwrite_output_dir=true", "resume_from_checkpoint=null",
                  "max_steps=1", "save_steps=null")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (previous,) = tmp_path.glob("run.previous-*")
    assert sorted(str(p.relative_to(previous)) for p in previous.rglob("*")) == before
    assert "resumed from" not in proc.stdout
    assert [s["step"] for s in steps(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*")) == ["iter_0000001"]


def _old_run(run_dir: Path, job_id: str | None = None) -> Path:
    """A run directory as a run leaves it: a checkpoint and progress.json by ``job_id``."""
    (run_dir / "checkpoints" / "iter_0000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "iter_0000002" / "checkpoint.json").write_text(
        json.dumps({"step": 2, "job_id": job_id}))
    (run_dir / "checkpoints" / "latest").write_text("iter_0000002")
    (run_dir / PROGRESS_FILE).write_text(json.dumps({"step": 2, "job_id": job_id}))
    return run_dir


def _start(run_dir: Path, **slurm: str) -> tuple[str, str]:
    """start_afresh_if_asked as rank 0 of a job with these SLURM_* variables (no launcher:
    one process); what resume_from_checkpoint became and what is left at run_dir."""
    training = load_config(DEMO, [f"output_dir={run_dir}", "overwrite_output_dir=true"]).training
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
    env.update({f"SLURM_{k.upper()}": v for k, v in slurm.items()}, MASTER_PORT="29999")
    fresh = start_afresh_if_asked(training, from_environ(env))
    left = ",".join(sorted(p.name for p in run_dir.parent.iterdir()))
    return "never" if fresh else training.resume_from_checkpoint, left


def test_overwrite_output_dir_leaves_a_requeued_or_continued_run(tmp_path, monkeypatch):
    """Only a run's first start moves it: a Slurm requeue (SLURM_RESTART_COUNT > 0, the same
    command run again) or torchrun's restart, a restart of the job that wrote progress.json or
    the checkpoint, and a continuation job the manifest lists all resume it where it is; an
    empty directory (or one with only the submission's manifest) is no run to move."""
    run = _old_run(tmp_path / "a" / "run", job_id="41")
    assert _start(run, job_id="41", restart_count="1") == ("auto", "run")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _start(run) == ("auto", "run")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert _start(run, job_id="41") == ("auto", "run")  # SLURM_RESTART_COUNT not passed on
    (run / MANIFEST_FILE).write_text(json.dumps({"job_ids": ["41", "57"]}))
    assert _start(run, job_id="57") == ("auto", "run")  # hpc-mca resume's job
    assert afresh.continued_by(run, "57", 0) == "job 57 is one of the run's jobs (manifest.json)"
    fresh = tmp_path / "b" / "run"
    fresh.mkdir(parents=True)
    (fresh / MANIFEST_FILE).write_text(json.dumps({"job_ids": ["60"]}))
    assert _start(fresh, job_id="60") == ("auto", "run")
    # A new job (or a launch outside Slurm) over the old run: moved aside, nothing resumed.
    resume, left = _start(run, job_id="99")
    assert resume == "never" and left.startswith("run.previous-") and "," not in left
    resume, left = _start(_old_run(tmp_path / "c" / "run"))
    assert resume == "never" and left.startswith("run.previous-")


def test_overwrite_output_dir_moves_only_on_rank_zero(tmp_path):
    """Every rank reaches the same verdict; only global rank 0 renames, and never over an
    earlier move of the same second."""
    run = _old_run(tmp_path / "run")
    assert afresh.start_afresh(run, job_id=None, restart_count=0, is_main=False) == run
    assert run.is_dir()
    first = afresh.start_afresh(run, job_id=None, restart_count=0, is_main=True)
    assert first is not None and first.name.startswith("run.previous-") and not run.exists()
    _old_run(run)
    same_second = datetime.datetime.strptime(first.name.split("previous-")[1], "%Y%m%dT%H%M%SZ")
    second = afresh.move_aside(run, now=same_second.replace(tzinfo=datetime.timezone.utc))
    assert second.name == f"{first.name}-1"
    assert afresh.start_afresh(tmp_path / "nothing", job_id=None, restart_count=0, is_main=True) is None
