"""Multi-token prediction in the trainer: main and per-depth MTP loss curves do not depend on
the layout, the packing or an interruption.

A Llama with weights; its MTP layers start from the layout-independent init of
hpc_mca/models/mtp.py. Packed sft data, samples aligned to 4 slots in every run (CP2's need).
MTP depths 1 and 2 on TP2, PP2, CP2 and DP2, and a Qwen3-MoE's depth 2 on EP2, equal one
process within 1e-5 each step; packed equals unpacked rows when every step holds the whole data
set; a run resumed from its step-4 checkpoint equals the uninterrupted one. A DeepSeek-V3-shaped
checkpoint's MTP module is loaded, trained and exported back as that module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_fixtures import make_model_dir, make_sft_data, rewind, run_train, steps, write_config

pytestmark = pytest.mark.slow

PACKED = ["data.sequence_packing=true", "data.pack_alignment=4"]
KEYS = ("loss", "mtp_loss_1", "mtp_loss_2")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    model = make_model_dir(root)
    config = write_config(root, model, make_sft_data(root, 256, seed=1, name="train"),
                          training={"save_steps": 4})
    references = {}
    for depths in (1, 2):
        run = root / f"reference{depths}"
        proc = run_train(config, run, 1, *PACKED, f"model.mtp_num_layers={depths}")
        assert proc.returncode == 0, proc.stderr[-4000:]
        references[depths] = steps(run)
    return root, config, references


def _same(got: list[dict], want: list[dict], what: str) -> None:
    assert [s["step"] for s in got] == [s["step"] for s in want], what
    for mine, ref in zip(got, want):
        assert mine["tokens"] == ref["tokens"], (what, mine, ref)
        for key in KEYS:
            if key in ref:
                assert mine[key] == pytest.approx(ref[key], abs=1e-5), (what, key, mine, ref)


def test_reference_trains_every_depth(setup):
    _, _, refs = setup
    for depths, ref in refs.items():
        assert [s["step"] for s in ref] == list(range(1, 11))
        assert sorted(k for k in ref[0] if k.startswith("mtp_loss_")) == \
            [f"mtp_loss_{k}" for k in range(1, depths + 1)]
        for key in [k for k in KEYS if k in ref[0]]:
            assert ref[-1][key] < ref[0][key] - 0.3, (depths, key, ref[0], ref[-1])
    # Depth 1 of the two-depth model is a different model's head: not compared.


@pytest.mark.parametrize("name, depths, overrides", [
    ("tp2", 2, ["parallel.tensor_model_parallel_size=2"]),
    ("pp2", 2, ["parallel.pipeline_model_parallel_size=2"]),
    ("cp2", 2, ["parallel.context_parallel_size=2"]),
    ("dp2", 2, []),
    ("tp2_depth1", 1, ["parallel.tensor_model_parallel_size=2"]),
    ("pp2_depth1", 1, ["parallel.pipeline_model_parallel_size=2"]),
    ("cp2_depth1", 1, ["parallel.context_parallel_size=2"]),
    ("dp2_depth1", 1, []),
])
def test_mtp_layouts_match_one_process(setup, name, depths, overrides):
    root, config, refs = setup
    proc = run_train(config, root / name, 2, *PACKED, f"model.mtp_num_layers={depths}",
                     *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _same(steps(root / name), refs[depths], name)
    # The HF export in output_dir (the model without its MTP layers, as the log says) holds the
    # one-process run's weights: under PP the last stage's embedding copy is not exported twice.
    assert "the MTP layers are not in the HF export" in proc.stdout
    _same_export(root / name, root / f"reference{depths}")


def _same_export(got: Path, want: Path) -> None:
    from safetensors.torch import load_file

    mine, ref = load_file(got / "model.safetensors"), load_file(want / "model.safetensors")
    assert mine.keys() == ref.keys() and not any(".mtp" in k or "mtp." in k for k in mine)
    for key, tensor in ref.items():
        assert (mine[key].float() - tensor.float()).abs().max() < 1e-5, key


def test_moe_mtp_on_expert_parallel_matches_one_process(tmp_path):
    """Qwen3-MoE with two MTP depths (each an MoE layer): EP2 equals one process."""
    model = make_model_dir(tmp_path, moe=True)
    config = write_config(tmp_path, model, make_sft_data(tmp_path, 64, seed=2, name="train"),
                          training={"max_steps": 6})
    runs = {"one": 1, "ep2": 2}
    for name, nproc in runs.items():
        ep = [f"parallel.expert_model_parallel_size={nproc}"]
        proc = run_train(config, tmp_path / name, nproc, *PACKED, "model.mtp_num_layers=2", *ep)
        assert proc.returncode == 0, proc.stderr[-4000:]
    ref = steps(tmp_path / "one")
    assert len(ref) == 6 and all(ref[-1][k] < ref[0][k] for k in KEYS), ref
    _same(steps(tmp_path / "ep2"), ref, "moe ep2")


def test_mtp_resumes_exactly(setup):
    root, config, refs = setup
    run = rewind(root / "reference2", root / "resumed", 4)
    proc = run_train(config, run, 1, *PACKED, "model.mtp_num_layers=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "at step 4" in proc.stdout, proc.stdout[-2000:]
    _same(steps(run), refs[2], "resumed")
    # The progress line shows each depth's loss: step 5's and step 10's.
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all(" | mtp1 " in line and " | mtp2 " in line for line in lines)


def test_packed_equals_unpacked_rows(setup, tmp_path):
    """Every step takes the whole 24-sample data set (as 24 padded rows, or as however many
    packed rows they fill), so both train on the same tokens with per-token losses."""
    from hpc_mca.config.loading import load_config
    from hpc_mca.data.dataset import build_datasets

    root, _, _ = setup
    data = make_sft_data(tmp_path, 24, seed=5, name="small")
    config = write_config(tmp_path, root / "model", data,
                          training={"max_steps": 3, "global_batch_size": None})
    packed = load_config(config, PACKED).resolve(1)
    packed_rows = len(build_datasets(packed.data, packed.data_run()).train)
    assert packed_rows < 24
    runs = {"unpacked": ["training.per_device_train_batch_size=4",
                         "training.global_batch_size=24"],
            "packed": [*PACKED, "training.per_device_train_batch_size=1",
                       f"training.global_batch_size={packed_rows}"]}
    for name, overrides in runs.items():
        proc = run_train(config, tmp_path / name, 1, "model.mtp_num_layers=1", *overrides)
        assert proc.returncode == 0, proc.stderr[-4000:]
    unpacked, packed = steps(tmp_path / "unpacked"), steps(tmp_path / "packed")
    assert len(packed) == 3
    _same(packed, unpacked, "packed vs unpacked")


def test_deepseek_mtp_module_trains_and_is_exported(tmp_path):
    """A DeepSeek-V3-shaped checkpoint holding an MTP module: the run loads it into its MTP
    layer, trains it, and exports it back as that module (the log says so); the module's copies
    of the vocabulary matrices are the exported embedding and head."""
    import json

    import torch
    from safetensors.torch import load_file
    from test_models import FAMILIES
    from test_mtp_weights import make_mtp_checkpoint
    from transformers import AutoTokenizer

    from hpc_mca.assets.demo.make_demo import build_tokenizer, tokenizer_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text(build_tokenizer().to_str())
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    config_class, overrides = FAMILIES["deepseek_v3"]
    vocab = len(AutoTokenizer.from_pretrained(model))
    make_mtp_checkpoint(model, config_class, {**overrides, "vocab_size": vocab}, 5)
    config = write_config(tmp_path, model, make_sft_data(tmp_path, 16, seed=3, name="train"),
                          training={"max_steps": 2})
    run = tmp_path / "run"
    proc = run_train(config, run, 1, *PACKED, "model.mtp_num_layers=1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "the MTP layers are in the HF export" in proc.stdout
    assert all(s["mtp_loss_1"] > 0 for s in steps(run))
    source, export = load_file(model / "model.safetensors"), load_file(run / "model.safetensors")
    assert export.keys() == source.keys()
    for name in ("enorm.weight", "eh_proj.weight", "mlp.gate.weight", "self_attn.kv_b_proj.weight"):
        assert not torch.equal(export[f"model.layers.2.{name}"], source[f"model.layers.2.{name}"]), name
    assert torch.equal(export["model.layers.2.embed_tokens.weight"], export["model.embed_tokens.weight"])
    assert torch.equal(export["model.layers.2.shared_head.head.weight"], export["lm_head.weight"])
