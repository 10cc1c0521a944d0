"""What the vision-language training tests share: the bundled demo (hpc_mca/assets/demo_vl), its
Qwen2-VL written out with random weights (a directory a user brings), run configs written as
YAML files, and runs read back as their steps.jsonl records."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from trainer_fixtures import run_train, steps

DEMO = Path(__file__).resolve().parent.parent / "hpc_mca" / "assets" / "demo_vl"
LORA = {"finetuning_type": "lora", "lora_target": "all", "lora_rank": 8}


def demo_model_dir(root: Path) -> Path:
    """The demo's Qwen2-VL with random weights (seed 3) saved in ``root``, beside the demo's
    tokenizer and image processor."""
    import torch
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(DEMO / name, root / name)
    torch.manual_seed(3)
    Qwen2VLForConditionalGeneration(AutoConfig.from_pretrained(DEMO)).save_pretrained(root)
    return root


def write_config(root: Path, config: dict[str, object]) -> Path:
    """``config`` as a new YAML file in ``root`` (config0.yaml, config1.yaml, ...)."""
    path = root / f"config{len(list(root.glob('config*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(config: Path, run: Path, nproc: int, *overrides: str) -> list[dict]:
    """``hpc-mca train`` on ``nproc`` local ranks, which must succeed; its steps' records."""
    proc = run_train(config, run, nproc, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return steps(run)
