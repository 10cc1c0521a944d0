"""training.report_to: TensorBoard, W&B (offline) and MLflow (file store) hold the same scalars.

A 6-step run on each backend reports to all three at once. Each tracker is read back from its
own files: TensorBoard's event files, MLflow's file store through its client, and W&B's offline
run file (a LevelDB-style log of protobuf records, read by :func:`wandb_history`). Every
(name, step, value) must agree. A run extended afterwards continues the same W&B and MLflow
runs.
"""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path

import pytest
from trainer_fixtures import make_model_dir, make_sft_data, run_train, write_config

from hpc_mca.config.loading import load_config
from hpc_mca.config.sections import ConfigError

TRACKERS = "training.report_to=tensorboard,wandb,mlflow"


def tensorboard_scalars(run_dir: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for events in sorted((run_dir / "tensorboard").rglob("events.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found.update({(tag, e.step): e.value for e in acc.Scalars(tag)})
    return found


def mlflow_scalars(run_dir: Path) -> tuple[dict[tuple[str, int], float], object]:
    import os
    from unittest import mock

    from mlflow.tracking import MlflowClient

    # Only while reading: a variable left in this process's environment would reach (and be
    # compared by) every later launch of the session.
    with mock.patch.dict(os.environ, {"MLFLOW_ALLOW_FILE_STORE": "true"}):
        client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
        found = {(key, m.step): m.value for key in run.data.metrics
                 for m in client.get_metric_history(run.info.run_id, key)}
    return found, run


def wandb_history(run_file: Path) -> tuple[list[dict], dict]:
    """(history rows, config) of a W&B offline run file. Its format: a 7-byte header, then
    32 KiB blocks of records, each a 7-byte header (checksum, length, type: 1 whole,
    2 first, 3 middle, 4 last piece) and a piece of a serialized ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending = run_file.read_bytes(), 7, b""
    rows, config = [], {}
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            which = record.WhichOneof("record_type")
            if which == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
            elif which == "run":
                config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                               for i in record.run.config.update})
    return rows, config


def wandb_scalars(run_dir: Path) -> tuple[dict[tuple[str, int], float], dict, set[str]]:
    found, config, ids = {}, {}, set()
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        ids.add(Path(path).stem)
        rows, more = wandb_history(Path(path))
        config.update(more)
        for row in rows:
            step = row["train/global_step"]
            found.update({(k, step): v for k, v in row.items()
                          if not k.startswith("_") and k != "train/global_step"})
    return found, config, ids


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("trackers")
    return write_config(root, make_model_dir(root, layers=2),
                        make_sft_data(root, 64, seed=1, name="train"),
                        make_sft_data(root, 16, seed=9, name="eval"),
                        training={"max_steps": 6, "logging_steps": 2, "eval_steps": 3,
                                  "warmup_steps": 1})


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for key, value in a.items():
        assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (what, key)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["true", "false"])
def test_every_tracker_holds_the_same_scalars(config, tmp_path, monkeypatch, backend):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    proc = run_train(config, run_dir, 1, TRACKERS, f"training.use_mca={backend}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    board = tensorboard_scalars(run_dir)
    assert {("train/loss", 2), ("train/loss", 6), ("eval/loss", 3), ("eval/accuracy", 6),
            ("perf/tokens_per_s", 4), ("train/lr", 2)} <= board.keys()
    flow, run = mlflow_scalars(run_dir)
    _same(board, flow, "mlflow")
    wandb, wandb_config, _ = wandb_scalars(run_dir)
    _same(board, wandb, "wandb")
    # The config and the job are attached to both.
    assert run.data.params["training.max_steps"] == "6"
    assert run.data.params["training.use_mca"] == ("True" if backend == "true" else "False")
    assert run.data.tags["hpc_mca.job.restart_count"] == "0"
    assert wandb_config["training.learning_rate"] == pytest.approx(1e-3)
    assert "job.world_size" in wandb_config
    assert "wandb:" not in proc.stdout + proc.stderr  # W&B keeps out of the run log


@pytest.mark.slow
def test_an_extended_run_continues_its_tracker_runs(config, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    for steps in (4, 6):
        proc = run_train(config, run_dir, 1, TRACKERS, "training.use_mca=false",
                         f"training.max_steps={steps}", "training.eval_steps=100")
        assert proc.returncode == 0, proc.stderr[-4000:]
    flow, run = mlflow_scalars(run_dir)
    assert sorted(step for key, step in flow if key == "train/loss") == [2, 4, 6]
    wandb, _, ids = wandb_scalars(run_dir)
    assert len(ids) == 1  # one W&B run id for both jobs
    assert sorted(step for key, step in wandb if key == "train/loss") == [2, 4, 6]
    _same(tensorboard_scalars(run_dir), flow, "mlflow after the extension")


def test_none_beside_a_tracker_is_one_line(tmp_path):
    model = make_model_dir(tmp_path, layers=1)
    path = write_config(tmp_path, model, make_sft_data(tmp_path, 8, seed=1, name="train"))
    with pytest.raises(ConfigError) as err:
        load_config(path, ["training.report_to=none,wandb"]).resolve(world_size=1)
    assert str(err.value) == ("training.report_to=['none', 'wandb'] names none beside a "
                              "tracker; valid: none alone, or trackers without none")
    with pytest.raises(ConfigError, match="training.report_to='neptune': Neptune is not a tracker here; valid: "):
        load_config(path, ["training.report_to=neptune"]).resolve(world_size=1)


_IMPORTS = """
import sys
from hpc_mca.loop.trackers import skip_unused_tracker_imports
off = skip_unused_tracker_imports(sys.argv[1].split(",") if sys.argv[1] else [])
import megatron.core
import importlib.util
wandb = sys.modules.get("wandb")
print(off, wandb is not None and hasattr(wandb, "init"), importlib.util.find_spec("wandb") is not None)
"""


@pytest.mark.parametrize("report_to, off, loaded", [("tensorboard", ["wandb", "mlflow"], False),
                                                    ("wandb", ["mlflow"], True)])
def test_megatron_imports_wandb_only_for_runs_that_report_to_it(report_to, off, loaded):
    """megatron.core imports wandb at import time when it is installed (megatron.core.timers);
    a run that does not report to W&B keeps it out (and transformers sees no W&B)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _IMPORTS, report_to], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == f"{off} {loaded} {loaded}", done.stdout
