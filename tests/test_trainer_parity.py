"""The trainer's loss curve does not depend on the layout: 10 steps of TP=2, PP=2, an uneven
PP=2 split (1|3 layers), DP=2, interleaved PP (2 x 2 chunks), DP=2 with the distributed
optimizer, that with the gradient reduction overlapped, and context parallelism over
padded rows (CP2, CP4), equal one process."""

from __future__ import annotations

import pytest
from trainer_fixtures import make_model_dir, make_sft_data, rewind, run_train, steps, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    model = make_model_dir(root)
    config = write_config(root, model, make_sft_data(root, 256, seed=1, name="train"))
    reference = root / "reference"
    proc = run_train(config, reference)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, config, steps(reference)


def test_reference_learns(setup):
    _, _, ref = setup
    assert [s["step"] for s in ref] == list(range(1, 11))
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.5
    assert not any(s["skipped"] for s in ref)


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("tp2", ["parallel.tensor_model_parallel_size=2"]),
        ("pp2", ["parallel.pipeline_model_parallel_size=2"]),
        ("pp2_uneven", ["parallel.pipeline_model_parallel_size=2", "parallel.pipeline_layout=1,3"]),
        ("dp2", []),
        ("vpp", ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2"]),
        ("dp2_distopt", ["parallel.use_distributed_optimizer=true"]),
        # What the planner emits for DP > 1: gradients reduced during the last backward.
        ("dp2_overlap", ["parallel.use_distributed_optimizer=true",
                         "parallel.overlap_grad_reduce=true"]),
    ],
)
def test_layout_matches_single_process(setup, name, overrides):
    root, config, ref = setup
    proc = run_train(config, root / name, 2, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = steps(root / name)
    assert len(got) == len(ref) == 10
    for mine, want in zip(got, ref):
        assert mine["tokens"] == want["tokens"]
        assert mine["loss"] == pytest.approx(want["loss"], abs=1e-5), (name, mine, want)
        assert mine["lr"] == pytest.approx(want["lr"], rel=1e-9)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_splits_padded_rows(setup, cp):
    """Unpacked rows of 32 slots cut into 2·CP chunks per rank (8 slots each on CP4)."""
    root, config, ref = setup
    proc = run_train(config, root / f"cp{cp}", cp, f"parallel.context_parallel_size={cp}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = steps(root / f"cp{cp}")
    assert [s["step"] for s in got] == list(range(1, 11))
    for mine, want in zip(got, ref):
        assert mine["tokens"] == want["tokens"]
        assert mine["loss"] == pytest.approx(want["loss"], abs=1e-5), (cp, mine, want)


def test_an_uneven_pipeline_resumes_on_another_split(setup):
    """The 1|3 run's checkpoint of step 4 continues as 3|1 (the same layers, other stages):
    losses equal the one-process run's within 1e-5; the resume line names the split change."""
    root, config, ref = setup
    uneven = ["parallel.pipeline_model_parallel_size=2", "save_steps=4"]
    first = run_train(config, root / "uneven_full", 2, *uneven, "parallel.pipeline_layout=1,3")
    assert first.returncode == 0, first.stderr[-4000:]
    run = rewind(root / "uneven_full", root / "uneven_resumed", 4)
    proc = run_train(config, run, 2, *uneven, "parallel.pipeline_layout=3,1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "at step 4" in proc.stdout and "pipeline_layout [1, 3]->[3, 1]" in proc.stdout
    got = steps(run)
    assert [s["step"] for s in got] == list(range(1, 11))
    for mine, want in zip(got, ref):
        assert mine["loss"] == pytest.approx(want["loss"], abs=1e-5), (mine, want)
