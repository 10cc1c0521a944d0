"""The sft demo (two-digit addition) through hpc-mca's Python API, with this script's own
``torch.utils.data.Dataset`` of token dicts and its own collator.

    python hpc_mca/assets/demo/api_sft.py output_dir=runs/api_sft max_steps=100
    torchrun --nproc-per-node 2 -m hpc_mca run hpc_mca/assets/demo/api_sft.py output_dir=runs/api_sft
    hpc-mca submit --gpu CPU --nodes 2 --gpus-per-node 1 --model hpc_mca/assets/demo \\
        hpc_mca/assets/demo/api_sft.py max_steps=100

The arguments are ``key=value`` overrides of sft_addition.yaml (next to this file), the run
config whose model, data files and hyperparameters this script trains with; the script's
``Seq2SeqTrainingArguments`` are that config's view (``from_config``). Rows are padded,
one problem each (``sequence_packing=false``): the same token rows, in the same order, as
``hpc-mca train hpc_mca/assets/demo/sft_addition.yaml sequence_packing=false``, so both give
the same losses. Under ``hpc-mca submit`` the job's run directory is the output_dir and the
planned layout fills the parallel sizes the config leaves at their defaults.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from hpc_mca.config.loading import load_config
from hpc_mca.config.sections import TrainConfig
from hpc_mca.data.samples import infer_seqlen  # LLaMA-Factory's cutoff rule, as the YAML path cuts
from hpc_mca.models import AutoModel
from hpc_mca.trainer import McaTrainer
from hpc_mca.training_args import Seq2SeqTrainingArguments

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONFIG = Path(__file__).resolve().with_name("sft_addition.yaml")
IGNORE_INDEX = -100
"""transformers' label for a position without loss."""


class AdditionProblems(torch.utils.data.Dataset):
    """Alpaca records (``{"instruction": "57+86=", "output": "143"}``) as token dicts in
    transformers' causal-LM convention: ``input_ids`` the prompt and the answer as the
    tokenizer's chat template renders them, ``labels`` -100 on the prompt and the answer's ids
    after it (unshifted: the trainer shifts)."""

    def __init__(self, path: str, tokenizer: PreTrainedTokenizerBase, cutoff_len: int) -> None:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        self.examples = [encode(record, tokenizer, cutoff_len) for record in records]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.examples[index]


def encode(record: dict[str, str], tokenizer: PreTrainedTokenizerBase, cutoff_len: int) -> dict[str, list[int]]:
    """One record's token dict: the conversation rendered and tokenized in one piece, split
    where the answer's text starts, both sides kept within ``cutoff_len`` tokens."""
    question = "\n".join(part for part in (record["instruction"], record.get("input") or "") if part)
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": record["output"]}]
    # tokenize=False: the rendered text.
    prompt_text = cast(str, tokenizer.apply_chat_template(turns[:1], tokenize=False, add_generation_prompt=True))
    text = cast(str, tokenizer.apply_chat_template(turns, tokenize=False))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    prompt_len = sum(1 for start, _ in encoded["offset_mapping"] if start < len(prompt_text))
    keep_prompt, keep_answer = infer_seqlen(prompt_len, len(ids) - prompt_len, cutoff_len)
    prompt, answer = ids[:keep_prompt], ids[prompt_len:prompt_len + keep_answer]
    return {"input_ids": prompt + answer, "labels": [IGNORE_INDEX] * len(prompt) + answer}


class PadToLength:
    """Pads a micro-batch of token dicts to ``length`` tokens: ``input_ids`` with the pad id,
    ``labels`` with -100, ``attention_mask`` 1 on the real tokens."""

    def __init__(self, pad_token_id: int, length: int) -> None:
        self.pad_token_id, self.length = pad_token_id, length

    def __call__(self, examples: Sequence[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        shape = (len(examples), self.length)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        for row, example in enumerate(examples):
            size = len(example["input_ids"])
            if size > self.length:
                raise ValueError(f"example of {size} tokens; this collator pads to {self.length}")
            input_ids[row, :size] = torch.tensor(example["input_ids"])
            labels[row, :size] = torch.tensor(example["labels"])
            attention_mask[row, :size] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def run_config(argv: Sequence[str]) -> TrainConfig:
    """The demo config with rows padded, then the command line's ``key=value`` items. In a
    job of the batch script the run directory is the output_dir: the config's is dropped."""
    fixed = ["sequence_packing=false"]
    if os.environ.get("HPC_MCA_RUN_DIR"):
        fixed.append("output_dir=")
    return load_config(CONFIG, [*fixed, *argv])


def main(argv: Sequence[str]) -> None:
    from transformers import AutoTokenizer

    config = run_config(argv)
    # This script reads the config's data files itself (its own Dataset), so the run config
    # names none: the trainer refuses files it would not read beside dataset objects.
    train_files, eval_files = config.data.dataset, config.data.eval_dataset
    config.data.dataset, config.data.eval_dataset = [], None
    args = Seq2SeqTrainingArguments.from_config(config)
    model_dir, cutoff_len = config.model.model_name_or_path, config.data.cutoff_len
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, args)
    train = AdditionProblems(train_files[0], tokenizer, cutoff_len)
    held_out = AdditionProblems(eval_files[0], tokenizer, cutoff_len) if eval_files else None
    # The labels are aligned (transformers' convention): the trainer shifts them, so a row
    # of seq_length tokens holds a whole problem of up to cutoff_len tokens.
    collator = PadToLength(tokenizer.pad_token_id, config.data.seq_length or cutoff_len)
    trainer = McaTrainer(model=model, args=args, tokenizer=tokenizer, data_collator=collator,
                         train_dataset=train, eval_dataset=held_out)
    out = trainer.train()
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"api_sft: global_step={out.global_step} training_loss={out.training_loss:.6f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
