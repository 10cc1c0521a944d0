"""Context parallelism in the trainer: 10-step loss curves of CP layouts equal one process.

Packed sft data with odd sample lengths, every sample padded to a multiple of 4 slots
(``data.pack_alignment=4``, what CP2 needs) in the reference too, so that every run trains on
the same rows. Dense Llama: CP2 with both attention exchanges, CP2×DP2, CP2×TP2 (and the
packed stream over PP2 without CP); Qwen3-MoE:
CP2×EP2 with both. A CP2 checkpoint resumes on one process and a one-process checkpoint on
CP2, within 1e-5 of the uninterrupted curve; eval loss, exact-match accuracy and the HF export
under CP equal the reference's. Bad CP input stops every rank with one line before anything is built.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from trainer_fixtures import (
    assert_bad_input_on_every_rank,
    launch_ranks,
    make_model_dir,
    make_sft_data,
    rewind,
    run_train,
    steps,
    write_config,
)

pytestmark = pytest.mark.slow

PACKED = ["data.sequence_packing=true", "data.pack_alignment=4"]
CP2 = "parallel.context_parallel_size=2"
A2A = "parallel.cp_comm_type=a2a"


def _setup(root, moe: bool):
    model = make_model_dir(root, moe=moe)
    evaluation = make_sft_data(root, 24, seed=3, name="eval")
    config = write_config(root, model, make_sft_data(root, 256, seed=1, name="train"), evaluation,
                          training={"eval_steps": 10, "save_steps": 4,
                                    "per_device_eval_batch_size": 2, "export_hf_dir": "hf"})
    reference = root / "reference"
    proc = run_train(config, reference, 1, *PACKED)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, config, steps(reference)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _setup(tmp_path_factory.mktemp("cp_dense"), moe=False)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return _setup(tmp_path_factory.mktemp("cp_moe"), moe=True)


def _same_curve(got: list[dict], want: list[dict], what: str) -> None:
    assert [s["step"] for s in got] == list(range(1, 11)), what
    for mine, ref in zip(got, want):
        assert mine["tokens"] == ref["tokens"], (what, mine, ref)
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-5), (what, mine, ref)


def _progress(run) -> dict:
    return json.loads((run / "progress.json").read_text())


@pytest.mark.parametrize("name, nproc, overrides", [
    ("cp2", 2, [CP2]),
    ("cp2_a2a", 2, [CP2, A2A]),
    ("cp2_dp2", 4, [CP2]),
    ("cp2_tp2", 4, [CP2, "parallel.tensor_model_parallel_size=2"]),
    # A packed stream between pipeline stages is one [B·S, 1] row (schedule_shape).
    ("pp2", 2, ["parallel.pipeline_model_parallel_size=2"]),
])
def test_dense_layouts_match_one_process(dense, name, nproc, overrides):
    root, config, ref = dense
    proc = run_train(config, root / name, nproc, *PACKED, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _same_curve(steps(root / name), ref, name)
    # Tokens are counted once over the CP ranks: the logged throughput's numerator agrees.
    assert [s["input_tokens"] for s in steps(root / name)] == \
        [s["input_tokens"] for s in steps(root / "reference")]
    got, want = _progress(root / name), _progress(root / "reference")
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=1e-5)
    assert got["eval_accuracy"] == want["eval_accuracy"]
    # The HF export at the end: each tensor written once, equal to the one-process weights.
    exported, reference = (load_file(run / "hf" / "model.safetensors")
                           for run in (root / name, root / "reference"))
    assert exported.keys() == reference.keys()
    for key, tensor in exported.items():
        assert (tensor - reference[key]).abs().max() < 1e-5, (name, key)


@pytest.mark.parametrize("name, overrides", [("cp2_ep2", []), ("cp2_ep2_a2a", [A2A])])
def test_moe_context_parallel_matches_one_process(moe, name, overrides):
    root, config, ref = moe
    proc = run_train(config, root / name, 4, *PACKED, CP2,
                     "parallel.expert_model_parallel_size=2", *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _same_curve(steps(root / name), ref, name)


def test_checkpoints_move_between_cp2_and_one_process(dense):
    """The CP2 run's step-4 checkpoint continues on one process, and the reference's on CP2."""
    root, config, ref = dense
    if not (root / "cp2" / "finished").exists():
        assert run_train(config, root / "cp2", 2, *PACKED, CP2).returncode == 0
    for source, target, nproc, extra in [("cp2", "cp2_to_cp1", 1, []),
                                         ("reference", "cp1_to_cp2", 2, [CP2])]:
        run = rewind(root / source, root / target, 4)
        proc = run_train(config, run, nproc, *PACKED, *extra)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "at step 4" in proc.stdout, proc.stdout[-2000:]
        _same_curve(steps(run), ref, target)


def test_bad_context_parallel_input_is_one_line_on_every_rank(dense, tmp_path):
    root, config, _ = dense
    cases = [
        (["data.cutoff_len=30"], "data.seq_length=30 is not a multiple of 2·CP=4"),
        (["data.sequence_packing=false", "data.cutoff_len=30"],
         "data.seq_length=30 is not a multiple of 2·CP=4"),
        ([A2A, "parallel.tensor_model_parallel_size=2"],
         "parallel.context_parallel_size=2 does not divide the 1 key/value heads per "
         "tensor-parallel rank that cp_comm_type='a2a' splits; valid: 1, or "
         "cp_comm_type='all_gather'"),
        (["data.pack_alignment=6"], "data.pack_alignment=6 is not a multiple of 2·CP=4"),
        (["parallel.cp_comm_type=p2p"], "cp_comm_type='p2p' needs the 'te' attention backend"),
        (["parallel.cp_comm_type=ring"], "parallel.cp_comm_type='ring' is not valid; valid: "
                                         "all_gather, a2a, p2p"),
    ]
    for number, (overrides, expected) in enumerate(cases):
        run = tmp_path / f"run{number}"
        world = 4 if "parallel.tensor_model_parallel_size=2" in overrides else 2
        ranks = launch_ranks(world, ["train", str(config), f"training.output_dir={run}",
                                     *PACKED, CP2, *overrides], timeout=240)
        assert_bad_input_on_every_rank(ranks, expected)
        assert not (run / "steps.jsonl").exists()
