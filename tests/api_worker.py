"""A script of the Python API, run on every rank by tests/test_api.py:

    python tests/api_worker.py MODE OUT [key=value ...]

MODE ``sft``: the demo's addition problems as the script's own ``torch.utils.data.Dataset`` of
token dicts (tokenized here, as the demo's ``chat`` template renders them), its own padding
collator, a recording callback and a ``compute_metrics``; train, evaluate, save the model.
MODE ``dpo``: the demo's preference pairs as pair dicts through the default collator;
``dpo_ref REF_DIR``: the same against ``ref_model=AutoModel.from_pretrained(REF_DIR, args)``.
MODE ``refusals``: what McaTrainer refuses, each message recorded.
MODE ``bad_collator KIND``: the sft run with a collator that breaks its contract as KIND says
(tests/test_roll_script.py: every rank must stop with one line).
MODE ``from_config`` / ``from_pretrained``: the demo's model built one way or the other (its
directory has no weights: the seeded init), written by ``save_pretrained`` to ``OUT/init``.
Rank 0 writes ``OUT/api_report.json``: the TrainOutput, the callback's records, evaluate().
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, TrainerCallback

import hpc_mca
import hpc_mca.errors
from hpc_mca.config.loading import load_config
from hpc_mca.models import AutoModel
from hpc_mca.trainer import McaTrainer
from hpc_mca.training_args import Seq2SeqTrainingArguments

DEMO = Path(hpc_mca.__file__).parent / "assets" / "demo"
TOKENIZER = AutoTokenizer.from_pretrained(DEMO)


def encode(prompt: str, answer: str) -> dict[str, list[int]]:
    """One example as the chat template renders it: <|user|>PROMPT<|assistant|>ANSWER<|end|>,
    the loss on the answer and its end token."""
    head = TOKENIZER.encode(f"<|user|>{prompt}<|assistant|>", add_special_tokens=False)
    tail = TOKENIZER.encode(f"{answer}<|end|>", add_special_tokens=False)
    return {"input_ids": head + tail, "labels": [-100] * len(head) + tail}


class Problems(torch.utils.data.Dataset):
    """The script's own dataset: one token dict per alpaca record of ``path``."""

    def __init__(self, path: Path) -> None:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        self.examples = [encode(r["instruction"], r["output"]) for r in records]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.examples[index]


class Pairs(Problems):
    def __init__(self, path: Path) -> None:
        self.examples = []
        for line in path.read_text().splitlines():
            r = json.loads(line)
            chosen, rejected = encode(r["instruction"], r["chosen"]), encode(r["instruction"], r["rejected"])
            self.examples.append({"chosen_input_ids": chosen["input_ids"], "chosen_labels": chosen["labels"],
                                  "rejected_input_ids": rejected["input_ids"],
                                  "rejected_labels": rejected["labels"]})


class PadTo:
    """The script's own collator: rows padded to ``length`` slots."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        ids = torch.full((len(examples), self.length), TOKENIZER.pad_token_id or 0)
        labels = torch.full((len(examples), self.length), -100)
        mask = torch.zeros((len(examples), self.length), dtype=torch.long)
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            ids[row, :n] = torch.tensor(example["input_ids"])
            labels[row, :n] = torch.tensor(example["labels"])
            mask[row, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class Recorder(TrainerCallback):
    """What a script's callback sees: steps, logged losses, evaluations."""

    def __init__(self, script_args=None) -> None:
        self.steps: list[int] = []
        self.logs: list[dict] = []
        self.evals: list[dict] = []
        self.script_args, self.args_seen = script_args, set()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)
        self.args_seen.add((type(args).__name__, args is self.script_args))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({"step": state.global_step, "loss": logs["loss"]})

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evals.append({"step": state.global_step, **metrics})


def exact_and_token_accuracy(prediction) -> dict[str, float]:
    """compute_metrics: a row is right when every trained slot's greedy token is its label."""
    predictions, labels = prediction.predictions, prediction.label_ids
    trained = labels != -100
    right = ((predictions == labels) | ~trained).all(axis=1)
    rows = trained.any(axis=1)
    return {"exact": float(right[rows].mean()),
            "token_accuracy": float((predictions == labels)[trained].mean())}


class BadCollator(PadTo):
    """PadTo, broken as ``kind`` says (tests/test_roll_script.py)."""

    def __init__(self, length: int, kind: str) -> None:
        super().__init__(length)
        self.kind, self.calls = kind, 0

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict:
        self.calls += 1
        batch = super().__call__(examples)
        if self.kind == "labels_none":
            batch["labels"] = None
        elif self.kind == "no_input_ids":
            del batch["input_ids"]
        elif self.kind == "float_labels":
            batch["labels"] = batch["labels"].float()
        elif self.kind == "too_long":
            return PadTo(80)(examples)
        elif self.kind == "neither" or (self.kind == "late_bad_batch" and self.calls >= 4
                                        and torch.distributed.get_rank() == 1):
            # (late: rank 1's fourth call, the batch of step 3 after the probe and steps 1-2)
            batch["labels"] = torch.where(batch["labels"] == -100, -100, 5)
        return batch


def main(mode: str, out: str, overrides: list[str]) -> None:
    reference = overrides.pop(0) if mode == "dpo_ref" else None
    kind = overrides.pop(0) if mode == "bad_collator" else None
    resume = overrides.pop(0) if mode == "sft_resume_from" else None  # train(resume_from_checkpoint=)
    yaml = ("sft_addition.yaml" if mode in ("sft", "sft_resume_from", "refusals", "bad_collator")
            else "dpo_addition.yaml")
    config = load_config(DEMO / yaml, ["dataset=[]", "eval_dataset=[]", f"output_dir={out}",
                                       "report_to=none", *overrides])
    args = Seq2SeqTrainingArguments.from_config(config)
    if mode == "from_config":
        from transformers import AutoConfig

        model = AutoModel.from_config(AutoConfig.from_pretrained(DEMO), args)
    else:
        model = AutoModel.from_pretrained(config.model.model_name_or_path, args)
    if mode.startswith("from_"):
        return model.save_pretrained(Path(out) / "init")
    if mode == "refusals":
        return refusals(model, config, Path(out))
    recorder = Recorder(args)
    if kind is not None:
        collator = BadCollator(config.data.seq_length or config.data.cutoff_len, kind)
        return McaTrainer(model=model, args=args, tokenizer=TOKENIZER, data_collator=collator,
                          train_dataset=Problems(DEMO / "train.jsonl")).train()
    if mode.startswith("dpo"):
        ref_model = AutoModel.from_pretrained(reference, args) if reference else None
        trainer = McaTrainer(model=model, args=args, train_dataset=Pairs(DEMO / "dpo_train.jsonl"),
                             eval_dataset=Pairs(DEMO / "dpo_eval.jsonl"), callbacks=[recorder],
                             ref_model=ref_model)
    else:
        collator = None if config.data.sequence_packing else PadTo(config.data.seq_length or config.data.cutoff_len)
        trainer = McaTrainer(model=model, args=args, processing_class=TOKENIZER, data_collator=collator,
                             train_dataset=Problems(DEMO / "train.jsonl"),
                             eval_dataset=Problems(DEMO / "eval.jsonl"), callbacks=[recorder],
                             compute_metrics=exact_and_token_accuracy)
    added = Recorder()
    trainer.add_callback(added)  # after the trainer is built, as ROLL's script adds one
    output = trainer.train() if resume is None else trainer.train(resume_from_checkpoint=resume)
    evaluated = trainer.evaluate()
    extra = {}
    if mode == "sft":  # transformers' Trainer methods a script calls after training
        extra["test"] = trainer.evaluate(metric_key_prefix="test")
        trainer.log_metrics("train", output.metrics)
        trainer.save_metrics("train", output.metrics)
        trainer.save_state()
        try:
            trainer.predict(Problems(DEMO / "eval.jsonl"))
        except hpc_mca.errors.UserError as err:
            extra["predict"] = str(err)
    trainer.save_model(Path(out) / "saved")
    if torch.distributed.get_rank() == 0:
        report = {"global_step": output.global_step, "training_loss": output.training_loss,
                  "metrics": output.metrics, "steps": recorder.steps, "logs": recorder.logs,
                  "evals": recorder.evals, "evaluate": evaluated, "added_steps": added.steps,
                  "num_samples": evaluated["eval_num_samples"], "args_seen": sorted(recorder.args_seen),
                  **extra}
        (Path(out) / "api_report.json").write_text(json.dumps(report))


def refusals(model, config, out: Path) -> None:
    """Each McaTrainer refusal's message (rank 0 writes them)."""
    import copy

    from hpc_mca.config.loading import set_value
    from hpc_mca.errors import UserError

    def args(**changes):
        """The arguments of the run config with ``changes`` (keys of the YAML)."""
        changed = copy.deepcopy(config)
        for key, value in changes.items():
            set_value(changed, key, value)
        return Seq2SeqTrainingArguments.from_config(changed)

    data = Problems(DEMO / "eval.jsonl")
    cases = {
        "collator_with_packing": lambda: McaTrainer(model, args(sequence_packing=True),
                                                    train_dataset=data, data_collator=PadTo(64)),
        "no_data": lambda: McaTrainer(model, args()),
        "eval_steps_without_eval": lambda: McaTrainer(model, args(eval_steps=5), train_dataset=data),
        "other_layout": lambda: McaTrainer(model, args(tensor_model_parallel_size=2), train_dataset=data),
        "missing_key": lambda: McaTrainer(model, args(), train_dataset=[{"ids": [1, 2]}]).train(),
        "files_beside_dataset": lambda: McaTrainer(model, args(dataset=["train.jsonl"]),
                                                   train_dataset=data),
    }
    messages = {}
    for name, make in cases.items():
        try:
            make()
            messages[name] = None
        except UserError as err:
            messages[name] = str(err)
    if torch.distributed.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "api_report.json").write_text(json.dumps(messages))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
