"""The bundled demo: reproducible assets, loadable tokenizer/model config, config, metric."""

import importlib.util
import json
from pathlib import Path

import torch

from hpc_mca.config.loading import load_config
from hpc_mca.data.addition import DEMO_DIR, make_problems
from hpc_mca.data.dataset import build_datasets
from hpc_mca.data.rows import collate_rows
from hpc_mca.data.tokenize import IGNORE_INDEX, load_tokenizer
from hpc_mca.loop.exact_match import response_exact_match
from hpc_mca.topology import ModelShape

GENERATED = ("tokenizer.json", "tokenizer_config.json", "config.json", "train.jsonl",
             "eval.jsonl", "dpo_train.jsonl", "dpo_eval.jsonl")


def test_make_demo_reproduces_the_committed_assets(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("make_demo", DEMO_DIR / "make_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path)
    for name in GENERATED:
        assert (tmp_path / name).read_bytes() == (DEMO_DIR / name).read_bytes(), name
    assert sum(p.stat().st_size for p in DEMO_DIR.iterdir()) < 2 * 1024 * 1024


def test_tokenizer_and_model_config_agree():
    tok = load_tokenizer(DEMO_DIR)
    config = json.loads((DEMO_DIR / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == len(tok)
    assert config["eos_token_id"] == tok.eos_token_id and config["pad_token_id"] == tok.pad_token_id
    assert 2 <= config["num_hidden_layers"] <= 4 and 64 <= config["hidden_size"] <= 128
    ModelShape.from_hf_config(DEMO_DIR)
    text = tok.apply_chat_template([{"role": "user", "content": "12+34="},
                                    {"role": "assistant", "content": "46"}], tokenize=False)
    assert text == "<|user|>12+34=<|assistant|>46<|end|>"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_eval_problems_are_disjoint_from_training():
    def pairs(name: str) -> set[str]:
        return {json.loads(line)["instruction"] for line in (DEMO_DIR / name).open()}
    assert not pairs("train.jsonl") & pairs("eval.jsonl")
    assert len(set(make_problems(50, seed=0, max_digits=2))) == 50


def test_demo_yaml_resolves_for_two_ranks_and_builds_packed_rows(tmp_path: Path):
    config = load_config(DEMO_DIR / "sft_addition.yaml",
                         [f"preprocessing_cache_dir={tmp_path}", f"output_dir={tmp_path}"])
    resolved = config.resolve(world_size=2)
    assert resolved.parallel.data_parallel_size == 2
    assert resolved.data.sequence_packing and resolved.finetuning.stage == "sft"
    data = build_datasets(resolved.data, resolved.data_run())
    assert data.train.report.efficiency > 0.95
    assert len(data.eval.samples) == 512


def test_dpo_demo_yaml_resolves_and_packs_whole_pairs(tmp_path: Path):
    config = load_config(DEMO_DIR / "dpo_addition.yaml",
                         [f"preprocessing_cache_dir={tmp_path}", f"output_dir={tmp_path}"])
    resolved = config.resolve(world_size=2)
    assert resolved.finetuning.stage == "dpo" and resolved.data.sequence_packing
    data = build_datasets(resolved.data, resolved.data_run())
    assert data.train.samples.stats["pairs"] == 3000 and data.eval.samples.stats["pairs"] == 256
    assert all(len(row) % 2 == 0 and row[0::2] == [i - 1 for i in row[1::2]]
               for row in data.train.rows)


def test_exact_match_on_packed_and_padded_batches():
    labels = torch.tensor([[5, IGNORE_INDEX, 7, 8, IGNORE_INDEX, 9, IGNORE_INDEX],
                           [IGNORE_INDEX, 3, 4, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX,
                            IGNORE_INDEX]])
    docs = torch.tensor([[1, 1, 2, 2, 3, 3, 0], [1, 1, 1, 2, 2, 0, 0]])  # doc 2 of row 1: none
    assert response_exact_match(labels.clamp(min=0), labels, docs).tolist() == [4, 4]
    wrong = labels.clamp(min=0).clone()
    wrong[0, 3] = 0  # second sample of row 0
    wrong[0, 1] = 0  # an untrained position does not count
    assert response_exact_match(wrong, labels, docs).tolist() == [3, 4]
    padded = (docs > 0).long()
    assert response_exact_match(wrong, labels, padded).tolist() == [1, 2]


def test_exact_match_on_real_demo_rows(tmp_path: Path):
    config = load_config(DEMO_DIR / "sft_addition.yaml",
                         [f"preprocessing_cache_dir={tmp_path}", f"output_dir={tmp_path}",
                          "max_samples=20"]).resolve(world_size=1)
    data = build_datasets(config.data, config.data_run())
    batch = collate_rows([data.eval[i] for i in range(len(data.eval))])
    perfect = batch["labels"].clamp(min=0)
    assert response_exact_match(perfect, batch["labels"], batch["attention_mask"]).tolist() \
        == [20, 20]
