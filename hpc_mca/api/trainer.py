"""``McaTrainer`` and ``DPOTrainer``: transformers' Trainer interface over the Megatron-Core
training loop, under mcore_adapter's names and signatures.

    trainer = McaTrainer(model=model, args=training_args, tokenizer=tokenizer,
                         data_collator=collator, train_dataset=rows, eval_dataset=held_out,
                         callbacks=[MyCallback()], compute_metrics=fn)
    output = trainer.train()          # TrainOutput(global_step, training_loss, metrics)
    trainer.evaluate()                # the metrics, eval_loss first
    trainer.save_model("out/hf")
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=training_args,
                         train_config=DPOConfig(beta=0.1, pref_loss="sigmoid"), ...)

What a run does is ``hpc-mca train``'s (the YAML path is this class with the datasets its
config names): the stage's objective (the run config's stage; ``DPOTrainer``: dpo with its
``DPOConfig``; dpo's frozen reference, or ``ref_model``), Megatron DDP, the optimizer and LR
schedule, pipeline schedules, checkpoints into ``output_dir``, resuming from them, requeue on
the batch script's signal. The run config is the arguments' view
(:mod:`hpc_mca.training_args`) with the model's directory, and LoRA read from the model when
the script applied peft's (:mod:`hpc_mca.models.lora_peft`). Datasets are any map-style
dataset of token dicts, through the default collator (:mod:`hpc_mca.api.data`) or the
script's own (:mod:`hpc_mca.api.collated`: both label conventions, LLaMA-Factory's pair
layout); ``None`` means the files the run config names. Callbacks are transformers'
``TrainerCallback``s, ``compute_metrics`` transformers' function of an ``EvalPrediction``
(greedy predictions and labels of the eval rows, aligned).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sized
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from transformers import TrainingArguments as HFArguments
from transformers import trainer_pt_utils

from hpc_mca.config.input import ConfigError
from hpc_mca.config.layout import layout_of
from hpc_mca.config.sections import TrainConfig
from hpc_mca.data.dataset import TrainingData, check_eval_rows, fix_tokenizer
from hpc_mca.data.tokenize import load_tokenizer, pad_id
from hpc_mca.errors import UserError
from hpc_mca.loop.preference import uses_reference
from hpc_mca.loop.records import StepResult
from hpc_mca.models.lora_peft import finetuning_from_peft, trained_chunks
from hpc_mca.rundir import EXIT_STOPPED, clear_bad_input
from hpc_mca.runtime.distributed import describe_process_group, rank_zero_first
from hpc_mca.runtime.quiet import library_line
from hpc_mca.stages import PREFERENCE_PAIR, get_stage
from hpc_mca.trainer.dpo_config import DPOConfig
from hpc_mca.trainer.stages import objective_for
from hpc_mca.trainer.trainer import Trainer

from .collated import CollatedRows
from .data import example_rows
from .model import McaModel, run_config_for
from .session import attention_backend_available, model_shape, open_session

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, TrainerCallback, TrainerState

    from hpc_mca.data.arguments import DataRun
    from hpc_mca.trainer.objective import Objective
    from hpc_mca.training_args import MegatronArguments

    from .data import ExampleDataset

__all__ = ["DPOTrainer", "McaTrainer"]

UNSUPPORTED = {
    "model_init": "build the model with AutoModel and pass it as model=",
    "optimizers": "the optimizer and LR schedule come from the arguments (optim, learning_rate, "
                  "lr_scheduler_type ...)",
    "optimizer_cls_and_kwargs": "the optimizer comes from the arguments (optim, adam_*)",
    "compute_loss_func": "the stage's objective computes the loss (pt, sft, dpo ...)",
    "preprocess_logits_for_metrics": "compute_metrics gets the greedy predictions already",
}
"""transformers' Trainer arguments refused here, with what to use instead."""


class McaTrainer:
    """Trains ``model`` as ``args`` say (module docstring). Everything is built here, on every
    rank alike; bad input raises the project's one-line errors (``UserError``) first."""

    def __init__(self, model: McaModel, args: MegatronArguments | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 data_collator: Callable[[list[Any]], Any] | None = None, train_dataset: ExampleDataset | None = None,
                 eval_dataset: ExampleDataset | None = None, callbacks: Iterable[TrainerCallback] | None = None,
                 compute_metrics: Callable[[Any], dict[str, float]] | None = None,
                 ref_model: McaModel | None = None, *, processing_class: PreTrainedTokenizerBase | None = None,
                 config: TrainConfig | None = None, train_config: DPOConfig | None = None,
                 **kwargs: object) -> None:
        try:
            _refuse_unsupported(kwargs)
            config = config or _trainer_config(args, model, train_config)
            _check_inputs(config, model, data_collator, train_dataset, eval_dataset, ref_model)
        except UserError as err:
            err.on_every_rank = True  # every rank has the same arguments and objects
            raise
        self.model = model
        self.args: Any = args if args is not None else config.training
        """The script's arguments (``hpc-mca train``: the run config's training section)."""
        if ref_model is not None:  # dpo's reference: the given model (frozen), named in the log
            config = config.amended("finetuning", ref_model=ref_model.name_or_path or "a model given to DPOTrainer")
        self.session = open_session(config) if config is not model.run_config else model.session
        self.config, ctx = self.session.config, self.session.ctx
        self.data_collator = data_collator
        run_dir = Path(config.training.output_dir)
        if ctx.is_main:
            config.save_resolved(run_dir)
            clear_bad_input(run_dir)  # this run's inputs got it this far
        self.vocab_size = model_shape(config.model).vocab_size
        objective = objective_for(config, ctx, self.vocab_size)
        tokenizer = processing_class if processing_class is not None else tokenizer
        self.data = self._training_data(objective, tokenizer, train_dataset, eval_dataset, args is None)
        if ctx.is_main:
            if hasattr(self.data.train, "report"):
                print(self.data.describe(), flush=True)
            print(library_line(), flush=True)
            print(describe_process_group(), flush=True)
            print(attention_backend_available(config), flush=True)
        chunks = trained_chunks(list(model.models))
        build = model.build_like if ref_model is None else (lambda *_, **__: trained_chunks(list(ref_model.models)))
        objective.attach(chunks, build)  # dpo's reference: a frozen copy of the starting model
        self.trainer = Trainer(config, ctx, chunks, self.data, objective=objective, run_dir=run_dir,
                               model_shape=model_shape(config.model), callbacks=list(callbacks or ()),
                               compute_metrics=compute_metrics,
                               # (a script's arguments are transformers' class and the Megatron fields)
                               script_args=args if isinstance(args, HFArguments) else None)
        self.history: list[StepResult] = []

    # ---- transformers' Trainer methods --------------------------------------------------------

    @property
    def state(self) -> TrainerState:
        """transformers' ``TrainerState`` of the run (global_step, log_history ...)."""
        return self.trainer.state

    @property
    def processing_class(self) -> Any:
        """The tokenizer (transformers' newer name for it)."""
        return self.tokenizer

    def is_world_process_zero(self) -> bool:
        return self.session.ctx.is_main

    def is_local_process_zero(self) -> bool:
        return self.session.ctx.env.local_rank == 0

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Add a transformers callback (or callback class) to the run's callbacks."""
        self.trainer.callbacks.add_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.trainer.callbacks.remove_callback(callback)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        return self.trainer.callbacks.pop_callback(callback)

    # transformers' own: a formatted metrics block on rank 0, {split}_results.json and
    # all_results.json, trainer_state.json, in args.output_dir.
    log_metrics = trainer_pt_utils.log_metrics
    save_metrics = trainer_pt_utils.save_metrics
    save_state = trainer_pt_utils.save_state
    metrics_format = trainer_pt_utils.metrics_format

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: object) -> Any:
        """Train to ``max_steps`` (resuming from output_dir's checkpoint, as configured, or
        from ``resume_from_checkpoint``: True = the latest, a path = that checkpoint) and
        return transformers' ``TrainOutput``. Stopped early for a requeue (the batch script's
        lead-time signal), the run is saved and the process exits 75 (``SystemExit``), the
        batch script's "requeue me"; the script's later lines run when the job resumes."""
        from transformers.trainer_utils import TrainOutput

        if kwargs:
            raise ConfigError(f"McaTrainer.train({', '.join(sorted(kwargs))}=...): valid: "
                              "resume_from_checkpoint only (trials and ignore_keys_for_eval are "
                              "transformers' hyperparameter search and metric filters)")
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

    def evaluate(self, eval_dataset: ExampleDataset | None = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate the model now on the eval rows (or ``eval_dataset``'s) and return the
        metrics named ``{metric_key_prefix}_...`` as transformers' does (``eval_loss``, the
        stage's metrics, the ``compute_metrics`` keys; also reported as at a step end), with
        ``{metric_key_prefix}_num_samples``, the examples evaluated (the tail that does not
        fill a step on every rank is left out)."""
        if ignore_keys:
            raise ConfigError(f"McaTrainer.evaluate(ignore_keys={ignore_keys!r}): the model's "
                              "outputs are not gathered here; valid: None")
        if eval_dataset is not None:
            self.data.eval = self._rows(eval_dataset, "eval_dataset", self._max_length)
        if self.data.eval is None:
            raise ConfigError("McaTrainer.evaluate() without eval data; valid: an eval_dataset, "
                              "or data.eval_dataset / data.val_size in the run config")
        run = self.config.data_run()
        check_eval_rows(self.data.eval, run)
        metrics = self.trainer.evaluate()
        named = {f"{metric_key_prefix}_{key.split('/', 1)[1]}": value for key, value in metrics.items()}
        named[f"{metric_key_prefix}_num_samples"] = _evaluated_examples(self.data.eval, run)
        return named

    def predict(self, test_dataset: ExampleDataset, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> NoReturn:
        """Refused: transformers' predict returns every token's logits, which this trainer
        does not gather over the vocabulary-parallel ranks."""
        raise ConfigError("McaTrainer.predict(): the logits of every token are not gathered here "
                          "(they are vocabulary-parallel); valid: evaluate(test_dataset, "
                          "metric_key_prefix='test') with compute_metrics, which gets the greedy "
                          "predictions and labels")

    def save_model(self, output_dir: str | Path | None = None, _internal_call: bool = False) -> None:
        """Write the model as the finetuning type exports it (HF model, or the PEFT adapter
        under LoRA) into ``output_dir`` (default: the run's output_dir), and the tokenizer
        beside it. Every rank calls it."""
        self.trainer.gather_params()  # the distributed optimizer's last shards, everywhere
        out = Path(output_dir or self.config.training.output_dir)
        self.model.save_pretrained(out)
        if self.is_world_process_zero() and self.tokenizer is not None:
            self.tokenizer.save_pretrained(out)

    # ---- helpers ------------------------------------------------------------------------------

    @property
    def _max_length(self) -> int:
        """The longest row a script's collator may give: the run config's sequence length, or
        without data settings (a ROLL script's arguments) the model's position range, and
        never past a sliding window (which the layers here do not apply)."""
        from hpc_mca.models.hf_config import read_hf_config

        if not self._own_data:
            return self.config.derived.seq_length
        spec = read_hf_config(self.config.model.model_name_or_path)
        return min(spec.max_position_embeddings, spec.sliding_window or spec.max_position_embeddings)

    def _training_data(self, objective: Objective, tokenizer: PreTrainedTokenizerBase | None,
                       train: ExampleDataset | None, evaluation: ExampleDataset | None,
                       from_config: bool) -> TrainingData:
        """The rows: the config's files (None), tokenized by rank 0 first, or the script's
        datasets, read by every rank alike; bad data stops every rank with one line. Eval rows
        too few for one evaluation step are bad data too, found here rather than at the first
        evaluation."""
        run = self.config.data_run()
        self._own_data = not from_config and getattr(self.args, "base_config", None) is None
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
            data = TrainingData(self._rows(train, "train_dataset", self._max_length), None, tokenizer)
            if evaluation is not None:
                data.eval = self._rows(evaluation, "eval_dataset", self._max_length)
            check_eval_rows(data.eval, run)
        except UserError as err:
            err.on_every_rank = True  # every rank read the same objects
            raise
        return data

    def _rows(self, dataset: ExampleDataset, what: str, max_length: int) -> Any:
        if self.data_collator is None:
            return example_rows(dataset, self.config, pad_id(self.tokenizer), self.vocab_size, what)
        pairs = get_stage(self.config.finetuning.stage).reads == PREFERENCE_PAIR
        rows = CollatedRows(dataset, self.data_collator, vocab_size=self.vocab_size, max_length=max_length,
                            pairs=pairs, what=what)
        training = self.config.training
        batch = training.per_device_eval_batch_size if what == "eval_dataset" else training.per_device_train_batch_size
        rows.probe(batch)  # every rank alike, before training
        return rows

    def _resume_from(self, value: str | bool) -> None:
        """transformers' ``resume_from_checkpoint`` argument as the run's setting, checked."""
        from hpc_mca.checkpoint.compat import resume_check

        self.trainer.resume_from("latest" if value is True else "never" if value is False else str(value))
        self.config = self.trainer.config
        try:
            resume_check(self.config, self.session.ctx.env.world_size, model_shape(self.config.model))
        except UserError as err:
            err.on_every_rank = True  # found alike by every rank
            raise


class DPOTrainer(McaTrainer):
    """mcore_adapter's ``DPOTrainer``: :class:`McaTrainer` on stage dpo with ``train_config``'s
    loss (beta, pref_loss, label_smoothing ...) and ``ref_model`` as the frozen reference
    (None: the starting model, or with LoRA the base with the adapters off; orpo and simpo
    need none)."""

    def __init__(self, model: McaModel, ref_model: McaModel | None = None,
                 args: MegatronArguments | None = None, train_config: DPOConfig | None = None, *,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 data_collator: Callable[[list[Any]], Any] | None = None, train_dataset: ExampleDataset | None = None,
                 eval_dataset: ExampleDataset | None = None, callbacks: Iterable[TrainerCallback] | None = None,
                 compute_metrics: Callable[[Any], dict[str, float]] | None = None,
                 processing_class: PreTrainedTokenizerBase | None = None, config: TrainConfig | None = None,
                 **kwargs: object) -> None:
        super().__init__(model=model, args=args, tokenizer=tokenizer, data_collator=data_collator,
                         train_dataset=train_dataset, eval_dataset=eval_dataset, callbacks=callbacks,
                         compute_metrics=compute_metrics, ref_model=ref_model,
                         processing_class=processing_class, config=config,
                         train_config=train_config or DPOConfig(), **kwargs)


def _refuse_unsupported(kwargs: Mapping[str, object]) -> None:
    for name, value in kwargs.items():
        if value is None:
            continue
        why = UNSUPPORTED.get(name, "not an argument of McaTrainer")
        raise ConfigError(f"McaTrainer({name}=...): {why}; valid: model, args, tokenizer / "
                          "processing_class, data_collator, train_dataset, eval_dataset, callbacks, "
                          "compute_metrics, ref_model")


def _trainer_config(args: MegatronArguments | None, model: McaModel, train_config: DPOConfig | None
                    ) -> TrainConfig:
    """The run config of this trainer, resolved for the job: the arguments' view with the
    model's directory, peft's LoRA on the model and ``train_config``'s dpo loss; the model's
    own config when that is the same run."""
    if args is None:
        raise ConfigError("McaTrainer without args; valid: args=Seq2SeqTrainingArguments(...) "
                          "(hpc_mca.training_args)")
    config = run_config_for(args, model.run_config.model.model_name_or_path)
    finetuning = finetuning_from_peft(list(model.models), config.finetuning)
    if finetuning is not None:
        config.finetuning = finetuning
    if train_config is not None:
        config.finetuning = dataclasses.replace(config.finetuning, **train_config.finetuning_fields())
    config = config.resolve(model.session.ctx.env.world_size)
    if config.to_dict() == model.run_config.to_dict():
        return model.run_config
    if layout_of(config.parallel) != layout_of(model.run_config.parallel):
        raise ConfigError(f"McaTrainer args have the layout {layout_of(config.parallel)} but the model "
                          f"was built for {layout_of(model.run_config.parallel)}; valid: the args the "
                          f"model was built with")
    return config


def _check_inputs(config: TrainConfig, model: McaModel, collator: object, train: ExampleDataset | None,
                  evaluation: ExampleDataset | None, ref_model: object) -> None:
    """What only the trainer can check: the datasets it is given against the config."""
    data, training = config.data, config.training
    problems = []
    if not training.use_mca:
        problems.append("training.use_mca=False: McaTrainer trains Megatron-Core models; valid: "
                        "use_mca true (the standard backend runs through hpc-mca train)")
    if train is None and not data.dataset and data.data_path is None:
        problems.append("McaTrainer has no train_dataset and data.dataset is empty; valid: a "
                        "train_dataset, or dataset files in the run config")
    if collator is not None and data.sequence_packing:
        problems.append("data.sequence_packing=True with a data_collator: the collator makes the "
                        "rows; valid: data_collator=None (rows packed as hpc-mca train packs them) "
                        "or sequence_packing false")
    has_eval = evaluation is not None or (train is None and bool(data.eval_dataset or data.val_size))
    if training.eval_steps and not has_eval:
        problems.append(f"training.eval_steps={training.eval_steps} without eval data; valid: an "
                        "eval_dataset, or eval_steps unset (eval_strategy no)")
    if train is not None and (data.dataset or data.data_path is not None):
        problems.append(f"train_dataset given with data.dataset={data.dataset or data.data_path!r} in "
                        "the run config: the files would not be read; valid: no dataset files in the "
                        "config (dataset=[]) beside a train_dataset")
    if train is not None and (data.eval_dataset or data.val_size):
        problems.append("train_dataset given with data.eval_dataset / data.val_size in the run "
                        "config; valid: eval_dataset= beside train_dataset")
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


def _evaluated_examples(rows: Sized, run: DataRun) -> int:
    """Examples in the eval rows one evaluation covers (whole steps on every rank)."""
    step = run.eval_batch_size * run.data_parallel_size
    count = len(rows) // step * step
    members = getattr(rows, "rows", None)
    if members is None or len(members) != len(rows):  # a script's collator; unpacked pairs
        return count
    return sum(len(members[i]) for i in range(count)) // get_stage(run.stage).rows_per_example
