"""``McaTrainer``: transformers' Trainer interface over the Megatron-Core training loop.

    trainer = McaTrainer(model=model, args=args, train_dataset=rows, eval_dataset=held_out,
                         data_collator=collator, callbacks=[MyCallback()], compute_metrics=fn)
    output = trainer.train()          # TrainOutput(global_step, training_loss, metrics)
    trainer.evaluate()                # EvalLoopOutput(metrics=..., num_samples=...)
    trainer.save_model("out/hf")

What a run does is ``hpc-mca train``'s (the YAML path is this class with the datasets its
config names): the stage's objective (``args.stage``: pt, sft, dpo and the other registered
stages; dpo's frozen reference, or ``ref_model``), Megatron DDP, the optimizer and LR schedule,
pipeline schedules, checkpoints into ``output_dir``, resuming from them, requeue on the
batch script's signal. Datasets are any map-style dataset of token dicts
(:mod:`hpc_mca.api.data`); ``None`` means the files ``args.dataset`` / ``args.eval_dataset``
name. Callbacks are transformers' ``TrainerCallback``s, ``compute_metrics`` transformers'
function of an ``EvalPrediction`` (greedy predictions and labels of the eval rows, aligned:
``label_ids[i, t]`` is the target of ``predictions[i, t]``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from hpc_mca.config.input import ConfigError
from hpc_mca.config.layout import layout_of
from hpc_mca.config.sections import TrainConfig
from hpc_mca.data.dataset import TrainingData, check_eval_rows, fix_tokenizer
from hpc_mca.data.tokenize import load_tokenizer, pad_id
from hpc_mca.errors import UserError
from hpc_mca.loop.preference import uses_reference
from hpc_mca.loop.records import StepResult
from hpc_mca.rundir import EXIT_STOPPED, clear_bad_input
from hpc_mca.runtime.distributed import describe_process_group, rank_zero_first
from hpc_mca.runtime.quiet import library_line
from hpc_mca.trainer.stages import objective_for
from hpc_mca.trainer.trainer import Trainer

from .arguments import TrainingArguments
from .data import CollatedRows, example_rows
from .model import McaModel
from .session import attention_backend_available, model_shape, open_session

__all__ = ["McaTrainer"]


class McaTrainer:
    """Trains ``model`` as ``args`` say (module docstring). Everything is built here, on every
    rank alike; bad input raises the project's one-line errors (``UserError``) first."""

    def __init__(self, model: McaModel, args: TrainingArguments, tokenizer: Any = None,
                 data_collator: Callable[[list[Any]], Any] | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, callbacks: Iterable[Any] | None = None,
                 compute_metrics: Callable[[Any], dict[str, float]] | None = None,
                 ref_model: McaModel | None = None, *, config: TrainConfig | None = None) -> None:
        self.model, self.args = model, args
        try:
            config = config or _config_of(args, model)
            _check_inputs(config, model, data_collator, train_dataset, eval_dataset, ref_model)
        except UserError as err:
            err.on_every_rank = True  # every rank has the same arguments and objects
            raise
        self.session = open_session(config) if config is not model.run_config else model.session
        self.config, ctx = config, self.session.ctx
        self.data_collator = data_collator
        if ref_model is not None:  # dpo's reference: the given model (frozen), named in the log
            config.finetuning.ref_model = ref_model.name_or_path or "a model given to McaTrainer"
        run_dir = Path(config.training.output_dir)
        if ctx.is_main:
            config.save_resolved(run_dir)
            clear_bad_input(run_dir)  # this run's inputs got it this far
        self.vocab_size = model_shape(config.model).vocab_size
        objective = objective_for(config, ctx, self.vocab_size)
        self.data = self._training_data(objective, tokenizer, train_dataset, eval_dataset)
        if ctx.is_main:
            if hasattr(self.data.train, "report"):
                print(self.data.describe(), flush=True)
            print(library_line(), flush=True)
            print(describe_process_group(), flush=True)
            print(attention_backend_available(config), flush=True)
        chunks = list(model.chunks)
        build = model.build_like if ref_model is None else (lambda *_, **__: list(ref_model.chunks))
        objective.attach(chunks, build)  # dpo's reference: a frozen copy of the starting model
        self.trainer = Trainer(config, ctx, chunks, self.data, objective=objective, run_dir=run_dir,
                               model_shape=model_shape(config.model), callbacks=list(callbacks or ()),
                               compute_metrics=compute_metrics)
        self.history: list[StepResult] = []

    # ---- transformers' Trainer methods --------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None) -> Any:
        """Train to ``max_steps`` (resuming from output_dir's checkpoint, as configured, or
        from ``resume_from_checkpoint``: True = the latest, a path = that checkpoint) and
        return transformers' ``TrainOutput``. Stopped early for a requeue (the batch script's
        lead-time signal), the run is saved and the process exits 75 (``SystemExit``), the
        batch script's "requeue me"; the script's later lines run when the job resumes."""
        from transformers.trainer_utils import TrainOutput

        started = time.perf_counter()
        history = self.run(resume_from_checkpoint)
        if self.trainer.loop.requeue:
            raise SystemExit(EXIT_STOPPED)
        runtime = time.perf_counter() - started
        losses = [step.loss for step in history if not step.skipped]
        loss = sum(losses) / len(losses) if losses else float("nan")
        state = self.trainer.state
        metrics = {"train_runtime": round(runtime, 4), "train_loss": loss,
                   "train_steps_per_second": round(len(history) / runtime, 3) if history else 0.0,
                   "epoch": state.epoch or 0.0}
        return TrainOutput(global_step=state.global_step, training_loss=loss, metrics=metrics)

    def run(self, resume_from_checkpoint: str | bool | None = None) -> list[StepResult]:
        """The run itself (:meth:`train` without its summary): this process's step results,
        the same on every rank; returns normally after a stop for requeue (``hpc-mca train``
        leaves that to the batch script's records)."""
        if resume_from_checkpoint is not None:
            self._resume_from(resume_from_checkpoint)
        self.history = self.trainer.train()
        return self.history

    def evaluate(self, eval_dataset: Any = None) -> Any:
        """Evaluate the model now on the eval rows (or ``eval_dataset``'s): transformers'
        ``EvalLoopOutput`` with ``metrics`` (``eval_loss``, the stage's metrics, the
        ``compute_metrics`` keys; also reported as at a step end) and ``num_samples`` (the
        examples evaluated: the tail that does not fill a step on every rank is left out)."""
        from transformers.trainer_utils import EvalLoopOutput

        if eval_dataset is not None:
            self.data.eval = self._rows(eval_dataset, "eval_dataset")
        if self.data.eval is None:
            raise ConfigError("McaTrainer.evaluate() without eval data; valid: an eval_dataset, "
                              "or data.eval_dataset / data.val_size in the args")
        run = self.config.data_run()
        check_eval_rows(self.data.eval, run)
        metrics = self.trainer.evaluate()
        named = {f"eval_{key.split('/', 1)[1]}": value for key, value in metrics.items()}
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=named,
                              num_samples=_evaluated_examples(self.data.eval, run))

    def save_model(self, output_dir: str | Path | None = None) -> None:
        """Write the model as the finetuning type exports it (HF model, or the PEFT adapter
        under LoRA) into ``output_dir`` (default: ``args.output_dir``). Every rank calls it."""
        self.trainer._gather_params()  # the distributed optimizer's last shards, everywhere
        self.model.save_pretrained(output_dir or self.config.training.output_dir)

    # ---- helpers ------------------------------------------------------------------------------

    def _training_data(self, objective: Any, tokenizer: Any, train: Any, evaluation: Any) -> TrainingData:
        """The rows: the config's files (None), tokenized by rank 0 first, or the script's
        datasets, read by every rank alike; bad data stops every rank with one line. Eval rows
        too few for one evaluation step are bad data too, found here rather than at the first
        evaluation."""
        run = self.config.data_run()
        if train is None:
            def build() -> TrainingData:
                data = objective.build_data()
                check_eval_rows(data.eval, run)
                return data

            data = rank_zero_first(build, self.session.ctx.is_main)  # shared: see rank_zero_first
            self.tokenizer = data.tokenizer
            return data
        if tokenizer is None:
            tokenizer = load_tokenizer(run.tokenizer_path)
            fix_tokenizer(tokenizer, self.config.data, run.stage)  # its pad id, as the YAML path's
        self.tokenizer = tokenizer
        try:
            data = TrainingData(self._rows(train, "train_dataset"), None, tokenizer)
            if evaluation is not None:
                data.eval = self._rows(evaluation, "eval_dataset")
            check_eval_rows(data.eval, run)
        except UserError as err:
            err.on_every_rank = True  # every rank read the same objects
            raise
        return data

    def _rows(self, dataset: Any, what: str) -> Any:
        pad = pad_id(self.tokenizer)
        if self.data_collator is not None:
            return CollatedRows(dataset, self.data_collator, pad, self.vocab_size, what)
        return example_rows(dataset, self.config, pad, self.vocab_size, what)

    def _resume_from(self, value: str | bool) -> None:
        from hpc_mca.checkpoint.compat import resume_check

        training = self.config.training
        training.resume_from_checkpoint = ("latest" if value is True else "never" if value is False
                                           else str(value))
        try:
            resume_check(self.config, self.session.ctx.env.world_size, model_shape(self.config.model))
        except UserError as err:
            err.on_every_rank = True  # found alike by every rank
            raise


def _config_of(args: TrainingArguments, model: McaModel) -> TrainConfig:
    """``args`` resolved for this job; the model's own config when they are the same run."""
    config = args.resolve(model.session.ctx.env.world_size)
    if config.to_dict() == model.run_config.to_dict():
        return model.run_config
    if layout_of(config.parallel) != layout_of(model.run_config.parallel):
        raise ConfigError(f"McaTrainer args have the layout {layout_of(config.parallel)} but the model "
                          f"was built for {layout_of(model.run_config.parallel)}; valid: the args the "
                          f"model was built with")
    return config


def _check_inputs(config: TrainConfig, model: McaModel, collator: Any, train: Any, evaluation: Any,
                  ref_model: Any) -> None:
    """What only the trainer can check: the datasets it is given against the config."""
    data, training = config.data, config.training
    problems = []
    if not training.use_mca:
        problems.append("training.use_mca=False: McaTrainer trains Megatron-Core models; valid: "
                        "use_mca true (the standard backend runs through hpc-mca train)")
    if train is None and not data.dataset and data.data_path is None:
        problems.append("McaTrainer has no train_dataset and data.dataset is empty; valid: a "
                        "train_dataset, or dataset files in the args")
    if collator is not None and data.sequence_packing:
        problems.append("data.sequence_packing=True with a data_collator: the collator makes the "
                        "rows; valid: data_collator=None (rows packed as hpc-mca train packs them) "
                        "or sequence_packing false")
    has_eval = evaluation is not None or (train is None and bool(data.eval_dataset or data.val_size))
    if training.eval_steps and not has_eval:
        problems.append(f"training.eval_steps={training.eval_steps} without eval data; valid: an "
                        "eval_dataset, or eval_steps unset")
    if train is not None and (data.dataset or data.data_path is not None):
        problems.append(f"train_dataset given with data.dataset={data.dataset or data.data_path!r} in "
                        "the args: the files would not be read; valid: no dataset files in the "
                        "args (dataset=[]) beside a train_dataset")
    if train is not None and (data.eval_dataset or data.val_size):
        problems.append("train_dataset given with data.eval_dataset / data.val_size in the args; "
                        "valid: eval_dataset= beside train_dataset")
    if model.name_or_path is not None and Path(model.name_or_path).resolve() != Path(
            config.model.model_name_or_path).resolve():
        problems.append(f"the model to train was built from {model.name_or_path!r} but "
                        f"model_name_or_path={config.model.model_name_or_path!r}; valid: the "
                        "run's own model (a ref_model= may come from another directory)")
    if ref_model is not None and not isinstance(ref_model, torch.nn.Module):
        problems.append(f"ref_model is a {type(ref_model).__name__}; valid: an AutoModel model")
    elif ref_model is not None and not uses_reference(config.finetuning):
        problems.append(f"ref_model given but stage {config.finetuning.stage!r} with pref_loss "
                        f"{config.finetuning.pref_loss!r} (use_ref_model {config.finetuning.use_ref_model}) "
                        "runs no reference; valid: no ref_model, or a loss with a reference")
    if problems:
        raise ConfigError("\n".join(problems))


def _evaluated_examples(rows: Any, run: Any) -> int:
    """Examples in the eval rows one evaluation covers (whole steps on every rank)."""
    from hpc_mca.stages import get_stage

    step = run.eval_batch_size * run.data_parallel_size
    count = len(rows) // step * step
    members = getattr(rows, "rows", None)
    if members is None or len(members) != len(rows):  # a script's collator; unpacked pairs
        return count
    return sum(len(members[i]) for i in range(count)) // get_stage(run.stage).rows_per_example
