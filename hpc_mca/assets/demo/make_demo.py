"""Regenerate the demo assets next to this file (deterministic; the output is committed).

    .venv/bin/python hpc_mca/assets/demo/make_demo.py [--out DIR]

Writes, without any network access:

* ``tokenizer.json`` + ``tokenizer_config.json``: a character-level tokenizer (printable ASCII,
  newline, six special tokens) built with the ``tokenizers`` library, loadable with
  ``transformers.AutoTokenizer`` as a PreTrainedTokenizerFast, with a small chat template
  (``<|user|>prompt<|assistant|>answer<|end|>``).
* ``config.json``: a tiny llama-style model whose vocabulary is the tokenizer's.
* ``train.jsonl`` / ``eval.jsonl``: alpaca records of multi-digit additions, disjoint.
* ``dpo_train.jsonl`` / ``dpo_eval.jsonl``: pairwise records of the first problems of each
  (chosen: the sum; rejected: a near miss).
* ``lora_train.jsonl`` / ``lora_eval.jsonl``: the same operands as subtractions (larger minus
  smaller), which the LoRA demo teaches the trained addition model.

``sft_addition.yaml``, ``dpo_addition.yaml`` and ``lora_subtraction.yaml`` (the run configs)
are written by hand and not touched here.
"""

from __future__ import annotations

import argparse
import json
import string
from collections.abc import Callable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from hpc_mca.data.addition import alpaca_record, make_problems, preference_record, subtraction_record

SPECIAL_TOKENS = ["<pad>", "<unk>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
MAX_DIGITS = 2
TRAIN_SIZE = 6000
EVAL_SIZE = 512
DPO_TRAIN_SIZE = 3000
DPO_EVAL_SIZE = 256
LORA_TRAIN_SIZE = 6000
LORA_EVAL_SIZE = 512
SEED = 1234
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "initializer_range": 0.02,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def build_tokenizer() -> Tokenizer:
    """One token per character; the special tokens are matched before splitting."""
    chars = list(string.printable[:95]) + ["\n"]  # digits, letters, punctuation, space
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIAL_TOKENS])
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "eos_token": "<|end|>",
        "model_max_length": MODEL["max_position_embeddings"],
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def model_config(tokenizer: Tokenizer) -> dict:
    vocab = tokenizer.get_vocab()
    return {**MODEL, "vocab_size": tokenizer.get_vocab_size(), "pad_token_id": vocab["<pad>"],
            "eos_token_id": vocab["<|end|>"], "bos_token_id": None}


def write_jsonl(path: Path, problems: list[tuple[int, int]],
                record: Callable[[int, int], dict[str, str]] = alpaca_record) -> None:
    with path.open("w") as out:
        for a, b in problems:
            out.write(json.dumps(record(a, b)) + "\n")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config())
    write_json(out / "config.json", model_config(tokenizer))
    train = make_problems(TRAIN_SIZE, seed=SEED, max_digits=MAX_DIGITS)
    evaluation = make_problems(EVAL_SIZE, seed=SEED + 1, max_digits=MAX_DIGITS,
                               exclude=set(train))
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", evaluation)
    write_jsonl(out / "dpo_train.jsonl", train[:DPO_TRAIN_SIZE], preference_record)
    write_jsonl(out / "dpo_eval.jsonl", evaluation[:DPO_EVAL_SIZE], preference_record)
    write_jsonl(out / "lora_train.jsonl", train[:LORA_TRAIN_SIZE], subtraction_record)
    write_jsonl(out / "lora_eval.jsonl", evaluation[:LORA_EVAL_SIZE], subtraction_record)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    main(parser.parse_args().out)
