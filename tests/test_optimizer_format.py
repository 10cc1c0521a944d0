"""The model_space optimizer format (hpc_mca.checkpoint.model_space): the box decomposition,
and resumes of a DP=2 distributed-optimizer run on other TP/PP/EP/DP layouts that continue the
uninterrupted run's losses (2 ranks under torchrun, CPU, fixed seeds)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_fixtures import make_model_dir, make_sft_data, rewind, run_train, steps, write_config

from hpc_mca.checkpoint.model_space import flat_boxes
from hpc_mca.checkpoint.store import complete_checkpoints, iter_name, read_info

DIST_OPT = "use_distributed_optimizer=true"


# --- boxes -------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_boxes_tile_a_flat_range_in_order(shape: list[int], data: st.DataObject) -> None:
    """Every element of [start, stop) is in exactly one box, boxes come in flat order and each
    is contiguous: box i is the next prod(sizes) elements (what the format relies on)."""
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    index = torch.arange(numel).view(shape)
    position = start
    boxes = flat_boxes(tuple(shape), start, stop)
    for offsets, sizes in boxes:
        region = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert region.reshape(-1).tolist() == list(range(position, position + region.numel()))
        position += region.numel()
    assert position == stop
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_boxes_of_a_partial_matrix() -> None:
    # Elements 3..12 of a 4x5 matrix: the tail of row 0, row 1 whole, the head of row 2.
    assert flat_boxes((4, 5), 3, 13) == [((0, 3), (1, 2)), ((1, 0), (1, 5)), ((2, 0), (1, 3))]
    assert flat_boxes((4, 5), 5, 15) == [((1, 0), (2, 5))]
    assert flat_boxes((4, 5), 7, 7) == []


# --- resumes on other layouts ------------------------------------------------------------------


def numbers(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(s["step"], s["loss"], s["lr"]) for s in steps(run_dir)]


def assert_continues(run: Path, ref: Path) -> None:
    mine, want = numbers(run), numbers(ref)
    assert [s for s, _, _ in mine] == [s for s, _, _ in want]
    for (step, loss, lr), (_, want_loss, want_lr) in zip(mine, want):
        assert loss == pytest.approx(want_loss, abs=1e-5), (step, loss, want_loss)
        assert lr == pytest.approx(want_lr, rel=1e-9), step


def split_rows(checkpoint: Path) -> list[str]:
    """Optimizer tensors of ``checkpoint`` stored in pieces that cut a row (so the resume
    tests exercise partial-row boxes, not only whole-tensor ones)."""
    from torch.distributed.checkpoint import FileSystemReader

    cut = []
    for key, meta in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.items():
        if key.startswith("optimizer.state.exp_avg.") and len(meta.size) >= 2 and any(
                chunk.sizes[-1] != meta.size[-1] for chunk in meta.chunks):
            cut.append(key)
    return cut


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An uninterrupted 8-step DP=2 run with the distributed optimizer (fp32), a checkpoint
    every 2 steps in the default (model_space) format. Tied embeddings (an untied pair of
    equal size made the two DP halves end on a parameter boundary) and rows of 48 and 100
    elements, so the DP slices cut a row."""
    root = tmp_path_factory.mktemp("model_space")
    model = make_model_dir(root, hidden_size=48, intermediate_size=100,
                           tie_word_embeddings=True)
    config = write_config(root, model, make_sft_data(root, 256, seed=3, name="train"),
                          training={"save_steps": 2, "logging_steps": 1, "max_steps": 8})
    proc = run_train(config, root / "reference", 2, DIST_OPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return config, root / "reference"


@pytest.mark.slow
@pytest.mark.parametrize("ranks, layout", [
    (2, ("tensor_model_parallel_size=2",)),
    (2, ("pipeline_model_parallel_size=2",)),
    (1, ()),
], ids=["dp2-to-tp2", "dp2-to-pp2", "dp2-to-one-rank"])
def test_model_space_resumes_on_another_layout(dense: tuple[Path, Path], tmp_path: Path,
                                               ranks: int, layout: tuple[str, ...]) -> None:
    config, ref = dense
    saved = ref / "checkpoints" / iter_name(4)
    assert read_info(saved).training["optimizer_format"] == "model_space"
    assert split_rows(saved), "no optimizer tensor was cut mid-row by the DP slices"
    run = rewind(ref, tmp_path / "run", 4)
    proc = run_train(config, run, ranks, DIST_OPT, *layout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 4 (32 samples)" in proc.stdout and "layout changed" in proc.stdout
    assert_continues(run, ref)


@pytest.mark.slow
def test_older_format_checkpoint_resumes_under_the_default(dense: tuple[Path, Path],
                                                           tmp_path: Path) -> None:
    """A checkpoint written as Megatron's fully_reshardable is read in that format by a run
    configured with the default (and the next checkpoints are model_space)."""
    config, ref = dense
    first = tmp_path / "first"
    proc = run_train(config, first, 2, DIST_OPT, "save_optimizer_format=fully_reshardable")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert numbers(first) == numbers(ref)  # the format changes no numerics
    run = rewind(first, tmp_path / "run", 4)
    proc = run_train(config, run, 2, DIST_OPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    formats = {step: read_info(path).training["optimizer_format"]
               for step, path in complete_checkpoints(run / "checkpoints")}
    assert formats == {2: "fully_reshardable", 4: "fully_reshardable", 6: "model_space",
                       8: "model_space"}
    assert numbers(run) == numbers(ref)


@pytest.mark.slow
def test_bf16_main_weights_and_moments_resume_exactly(dense: tuple[Path, Path],
                                                      tmp_path: Path) -> None:
    """With bf16 the fp32 main weights are not the model's weights: a resume that lost or
    misplaced them (or the moments) would drift from the uninterrupted run."""
    config, _ = dense
    ref = tmp_path / "ref"
    proc = run_train(config, ref, 2, DIST_OPT, "bf16=true", "max_steps=6", "save_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = rewind(ref, tmp_path / "run", 3)
    proc = run_train(config, run, 2, DIST_OPT, "bf16=true", "max_steps=6", "save_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 3 (24 samples)" in proc.stdout
    assert numbers(run) == numbers(ref)


@pytest.mark.slow
def test_moe_expert_state_reshards_over_ep(tmp_path: Path) -> None:
    """Qwen3-MoE with EP=2 (a dense and an expert distributed optimizer, chained), resumed on
    one rank (EP=1): the expert moments land on the right experts."""
    make_model_dir(tmp_path, layers=2, moe=True)
    config = write_config(tmp_path, tmp_path / "model", make_sft_data(tmp_path, 64, seed=5, name="t"),
                          training={"max_steps": 6, "save_steps": 3, "logging_steps": 1})
    ref = tmp_path / "ref"
    proc = run_train(config, ref, 2, DIST_OPT, "parallel.expert_model_parallel_size=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = rewind(ref, tmp_path / "run", 3)
    proc = run_train(config, run, 1, DIST_OPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layout changed: ep 2->1" in proc.stdout
    assert_continues(run, ref)
