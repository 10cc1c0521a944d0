"""``hpc-mca export``: a run's checkpoint exported afterwards, on one process, equals the run's
own end-of-run export byte for byte, whatever layout the checkpoint was saved in.

Three runs of 2 steps: a dense Llama under TP2×PP2 (4 gloo ranks, full fine-tuning), a
Qwen3-MoE under EP2 with LoRA (its PEFT adapter and the merged model), and the standard
backend (transformers' checkpoint files). Each export is compared file by file with the run's
own (``training.export_hf_dir`` / ``export_merged_dir``); a partial checkpoint (a ``.tmp``
save, a shard file gone) and the wrong flags are refused in one line with exit status 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_fixtures import make_model_dir, make_sft_data, rank_env, run_ranks, run_train, write_config

TRAIN = {"max_steps": 2, "save_steps": 2, "global_batch_size": 4, "logging_steps": 1, "export_hf_dir": "hf"}


def _run(root: Path, nproc: int, *overrides: str, moe: bool = False, **training: object) -> Path:
    model = make_model_dir(root, layers=2 if moe else 4, moe=moe)
    config = write_config(root, model, make_sft_data(root, 32, 1, "train"), training={**TRAIN, **training})
    proc = run_train(config, root / "run", nproc, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root / "run"


def _export(*args: object) -> subprocess.CompletedProcess:
    return run_ranks(1, ["export", *map(str, args)])


def _same_files(got: Path, want: Path) -> None:
    """The same file names, each with the same bytes."""
    names = sorted(p.name for p in want.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    for name in names:
        assert (got / name).read_bytes() == (want / name).read_bytes(), name


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("hpc-mca export: error")]


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory.mktemp("tp2pp2"), 4, "parallel.tensor_model_parallel_size=2",
                "parallel.pipeline_model_parallel_size=2")


@pytest.fixture(scope="module")
def ep2_lora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory.mktemp("ep2"), 2, "parallel.expert_model_parallel_size=2",
                "finetuning.finetuning_type=lora", "finetuning.lora_rank=4", moe=True,
                export_hf_dir="adapter", export_merged_dir="merged")


@pytest.mark.slow
def test_tp2pp2_checkpoint_exports_on_one_process_as_the_run_did(tp2pp2: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    proc = _export(tp2pp2, "--to", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "saved under TP2 PP2" in proc.stdout and "under TP1 PP1 EP1 on 1 rank(s)" in proc.stdout
    assert "wrote model.safetensors" in proc.stdout
    _same_files(tmp_path / "hf", tp2pp2 / "hf")
    # The checkpoint's weights were read: the trained model is not the one it started from.
    base = load_file(tp2pp2.parent / "model" / "model.safetensors")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert any(not base[k].equal(exported[k]) for k in base)

    # Under a launcher (srun, torchrun): 2 ranks in a pipeline of 2 write the same files.
    proc = run_ranks(2, ["export", str(tp2pp2), "--to", str(tmp_path / "pp2"), "--pp", "2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "under TP1 PP2 EP1 on 2 rank(s)" in proc.stdout
    _same_files(tmp_path / "pp2", tp2pp2 / "hf")

    # Shards of at most 200 kB with their index: the same tensors.
    proc = _export(tp2pp2 / "checkpoints" / "iter_0000002", "--to", tmp_path / "sharded",
                   "--max-shard-size", "200KB")
    assert proc.returncode == 0, proc.stderr[-4000:]
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / "sharded" / s).stat().st_size <= 200_000 + 64_000 for s in shards)
    merged = {k: v for s in shards for k, v in load_file(tmp_path / "sharded" / s).items()}
    assert sorted(merged) == sorted(exported) and all(merged[k].equal(exported[k]) for k in exported)


@pytest.mark.slow
def test_ep2_lora_checkpoint_exports_its_adapter_and_the_merged_model(ep2_lora: Path, tmp_path: Path) -> None:
    proc = _export(ep2_lora, "--to", tmp_path / "adapter")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "exported PEFT adapter of step 2" in proc.stdout
    _same_files(tmp_path / "adapter", ep2_lora / "adapter")
    proc = _export(ep2_lora, "--to", tmp_path / "merged", "--merge-lora")
    assert proc.returncode == 0, proc.stderr[-4000:]
    _same_files(tmp_path / "merged", ep2_lora / "merged")


@pytest.mark.slow
def test_standard_backend_checkpoint_exports_as_the_run_did(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    run = _run(tmp_path, 1, "training.use_mca=false")
    proc = _export(run, "--to", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "standard backend" in proc.stdout
    _same_files(tmp_path / "hf", run / "hf")
    ids = torch.tensor([[3, 7, 11, 19, 23, 29]])
    with torch.no_grad():
        got, want = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
                     for path in (tmp_path / "hf", run / "hf"))
    assert torch.equal(got, want)


@pytest.mark.slow
def test_partial_checkpoints_and_wrong_requests_are_refused_in_one_line(tp2pp2: Path, tmp_path: Path) -> None:
    # A copy of the run whose checkpoint lost a shard file, and a save that never finished.
    run = tmp_path / "run"
    shutil.copytree(tp2pp2, run, ignore=shutil.ignore_patterns("hf", "tensorboard"))
    ckpt = run / "checkpoints" / "iter_0000002"
    shutil.copytree(ckpt, run / "checkpoints" / "iter_0000004.tmp")
    (ckpt / "__1_0.distcp").unlink()
    cases = [
        ([run], "is a partial checkpoint: __1_0.distcp missing"),
        ([run / "checkpoints" / "iter_0000004.tmp"], "is a partial checkpoint (a save in progress"),
        ([tp2pp2, "--merge-lora", "--to", tmp_path / "x"], "--merge-lora: the run's finetuning_type is 'full'"),
        ([tp2pp2, "--to", tp2pp2 / "hf"], "already holds an export (config.json, model.safetensors)"),
        ([tmp_path / "nothing"], "does not exist"),
    ]
    for args, message in cases:
        proc = _export(*args)
        assert proc.returncode == 2, (args, proc.stderr[-3000:])
        assert len(_errors(proc)) == 1 and message in _errors(proc)[0], (args, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr
    # The model directory the run names is gone: refused naming it, through the real CLI.
    (run / "resolved_config.yaml").write_text((run / "resolved_config.yaml").read_text().replace(
        str(tp2pp2.parent / "model"), str(tmp_path / "gone")))
    shutil.copytree(tp2pp2 / "checkpoints" / "iter_0000002", ckpt, dirs_exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "hpc_mca", "export", str(run)], env=rank_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _errors(proc) == [f"hpc-mca export: error: the run's model directory {tmp_path / 'gone'} "
                             f"(model.model_name_or_path in {run / 'resolved_config.yaml'}) does not exist; "
                             f"valid: the model directory the run was trained from"]


def test_export_help_imports_no_torch() -> None:
    """``hpc-mca --help`` lists export, and its own help imports nothing heavy (login node)."""
    code = ("import sys\nimport hpc_mca.cli\nfrom click.testing import CliRunner\n"
            "for args in (['--help'], ['export', '--help']):\n"
            "    result = CliRunner().invoke(hpc_mca.cli.main, args)\n"
            "    assert result.exit_code == 0, result.output\n"
            "    print(result.output)\n"
            "heavy = ('torch', 'megatron', 'transformers')\n"
            "print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout and "--merge-lora" in proc.stdout
    assert any(line.split()[:1] == ["export"] for line in proc.stdout.splitlines())
