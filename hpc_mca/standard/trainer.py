"""The standard backend's loop: transformers' Trainer with hpc-mca's data, loss and run files.

transformers' Trainer runs the loop: DDP through accelerate, gradient accumulation, clipping,
the optimizer and LR scheduler steps, callbacks, and checkpoint files it can resume from. What
:class:`StandardTrainer` puts in its place, so that both backends train the same thing and
leave the same run directory:

* **data**: the shared pipeline's rows and resumable sampler (:mod:`.data`), positioned at the
  checkpoint's sample count (the Trainer's own batch skipping is off);
* **loss**: Megatron's per-token contract: each micro-batch's summed token loss divided by
  the real tokens of the whole global batch (counted over every rank before the step), times
  the world size that DDP's gradient average divides back out;
* **step end** (every optimizer step, every rank): the run loop both backends share
  (:class:`hpc_mca.loop.driver.RunLoop`), called from an ``on_step_end`` callback: the
  steps.jsonl line, logging, evaluation, the save/stop decision, saved by :mod:`.checkpoint`;
* **non-finite gradients** on any rank: no update and the LR schedule stays (Megatron's rule).

transformers is reached through its public API (callbacks, ``compute_loss``,
``get_batch_samples``, ``get_train_dataloader``, ``evaluate``), except for what
:mod:`.hf_adapter` holds.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import TrainerCallback, TrainerControl, TrainerState

from hpc_mca.checkpoint.store import HF_FORMAT, CheckpointInfo
from hpc_mca.loop.boundary import Decision, StepBoundary
from hpc_mca.loop.callbacks import StepFlowCallback
from hpc_mca.loop.driver import RunLoop, any_non_finite
from hpc_mca.loop.exact_match import response_exact_match
from hpc_mca.loop.metrics import MetricsWriter
from hpc_mca.loop.records import StepResult
from hpc_mca.runtime.sequence_parallel import IGNORE_INDEX, gather_and_unpad

from .checkpoint import save_checkpoint
from .data import eval_streams, model_inputs
from .hf_adapter import AdaptedTrainer

if TYPE_CHECKING:
    from torch.utils.data import Dataset
    from transformers import TrainingArguments

    from hpc_mca.data.batch import PackedBatch
    from hpc_mca.loop.counters import RunCounters
    from hpc_mca.runtime.env import RankEnv

    from .model import LRSchedule
    from .run import StandardRun

__all__ = ["StandardTrainer", "batch_count"]

NO_MICRO_BATCH = "hpc_mca_no_micro_batch"
"""The key that marks a placeholder micro-batch (an epoch's last, partial step)."""


@dataclasses.dataclass
class StepTally:
    """What this rank's micro-batches of the current step add up to, until its step end."""

    loss_sum: float = 0.0
    """Summed loss of this rank's micro-batches."""
    count: float = 0.0
    """What the loss is a mean over (real tokens; dpo: pairs), already over every rank."""
    skipped: bool = False
    """The optimizer step found non-finite gradients (on some rank) and made no update."""
    seen_inputs: int = 0
    """The train stream's input-token count at the previous step end."""


class StandardTrainer(AdaptedTrainer):
    """transformers' Trainer on hpc-mca's data, loss and run files (see the module docstring).
    ``run``: the run's settings and helpers (:class:`hpc_mca.standard.run.StandardRun`).
    Stage dpo subclasses it (:class:`hpc_mca.standard.dpo.StandardDpoTrainer`): the hooks it
    replaces are the step's count (``count_items``), ``compute_loss``, ``step_metrics`` and
    the eval sums."""

    loss_is_scaled_for_ga = True  # compute_loss divides by the global token count itself
    unit = "tokens"
    """What the loss is a mean over (steps.jsonl's count field)."""

    def __init__(self, *, run: StandardRun, model: torch.nn.Module, args: TrainingArguments,
                 optimizers: tuple[torch.optim.Optimizer, LRSchedule], boundary: StepBoundary,
                 metrics: MetricsWriter, callbacks: list[TrainerCallback]) -> None:
        tr = run.config.training
        flow = StepFlowCallback(run.data.eval is not None, tr.logging_steps, tr.eval_steps)
        optimizer, self.schedule = optimizers  # transformers keeps the scheduler it is given
        # transformers declares its LambdaLR; of the scheduler it is given it calls what the
        # Megatron one has too (step, get_last_lr, the state dicts).
        super().__init__(model=model, args=args, optimizers=optimizers,  # type: ignore[arg-type]
                         callbacks=[flow, *callbacks])
        self.run, self.metrics = run, metrics
        self.tally = StepTally()
        self.loop = RunLoop(self, counters=run.counters, boundary=boundary, events=self.callback_handler,
                            args=self.args, metrics=metrics, device=run.device, unit=self.unit,
                            hang_timeout=tr.hang_timeout)
        # Last, so that every other callback's should_save/should_training_stop is in.
        self.add_callback(StepEndCallback(self))
        optimizer.register_step_pre_hook(self.skip_non_finite)

    @property
    def trained_model(self) -> torch.nn.Module:
        """The model being trained: transformers' ``model``, which it types optional for a
        ``model_init`` (this trainer is given the model instead)."""
        assert self.model is not None  # __init__'s model
        return self.model

    # ---- data and loss ------------------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        return self.run.train_stream

    def get_batch_samples(self, epoch_iterator: Iterator[dict[str, torch.Tensor]], num_batches: int,
                          device: torch.device) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
        """The step's micro-batches and the global batch's count (real tokens; dpo: pairs) over
        every rank's micro-batches, which ``compute_loss`` divides by. An epoch's last step has
        fewer micro-batches than ``num_batches`` (the run's EpochPlan): transformers' loop, which
        knows no epochs of an endless stream, syncs gradients and steps the optimizer after
        ``num_batches`` of them, so placeholders that train nothing come first."""
        real = self.run.epochs.micro_steps_in_step(self.run.counters.consumed_samples)
        batch_samples = list(itertools.islice(epoch_iterator, real))
        count = torch.tensor(self.count_items(batch_samples), dtype=torch.float64,
                             device=self.run.device)
        if dist.is_initialized():
            dist.all_reduce(count)
        self.tally.count += float(count)
        placeholder = {"input_ids": torch.zeros(1, 0, dtype=torch.long), NO_MICRO_BATCH: torch.ones(())}
        return [placeholder] * (num_batches - real) + batch_samples, count

    def training_step(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """transformers' micro-batch step; a placeholder of :meth:`get_batch_samples` trains
        nothing (no forward, no backward: it comes before the step's synchronising backward)."""
        if NO_MICRO_BATCH in inputs:
            return torch.zeros((), device=self.args.device)
        return super().training_step(model, inputs, num_items_in_batch)

    def count_items(self, batch_samples: list[dict[str, torch.Tensor]]) -> float:
        return float(sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batch_samples))

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                     return_outputs: bool = False, num_items_in_batch: torch.Tensor | int | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        logits = model(**model_inputs(inputs)).logits
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), inputs["labels"].flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        self.tally.loss_sum += float(loss_sum.detach())
        loss = loss_sum * (self.run.world_size / batch_count(num_items_in_batch))
        return (loss, logits) if return_outputs else loss

    def step_metrics(self, count: int) -> dict[str, float]:
        """The objective's extra values of a step of ``count`` (dpo: rewards and
        log-probabilities)."""
        return {}

    def skip_non_finite(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...],
                        kwargs: dict[str, object]) -> None:
        """Megatron's rule for a step whose gradients are not all finite (on any rank): no
        update. Dropping the gradients makes the optimizer step a no-op; the LR schedule is
        taken back at the step end (transformers' loop advances it regardless). A torch
        optimizer step pre-hook."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        self.tally.skipped = any_non_finite([g.float().sum() for g in grads], self.run.device)
        if self.tally.skipped:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None

    # ---- the step end (hpc_mca.loop.driver.LoopBackend) -----------------------------------------

    def end_step(self) -> None:
        """The end of the optimizer step just taken, on every rank (:class:`StepEndCallback`)."""
        loss, tokens, inputs = self.step_sums()
        skipped, self.tally.skipped = self.tally.skipped, False
        if skipped:
            self.schedule.step(increment=-1)  # no update, so the schedule stays put
        norm = self.step_grad_norm
        grad_norm = float(norm) if norm is not None and not skipped else float("nan")
        # transformers' loop advanced its own step; the run's counters follow it here.
        counters = self.run.counters
        counters.step_taken(self.run.epochs.step_samples(counters.consumed_samples), skipped=skipped)
        self.loop.end_step(StepResult(loss=loss, tokens=tokens, input_tokens=inputs,
                                      grad_norm=grad_norm, skipped=skipped,
                                      metrics=self.step_metrics(tokens)))

    def step_sums(self) -> tuple[float, int, int]:
        """(mean loss, its count, input tokens) of the step just taken, over all ranks."""
        tally, loader = self.tally, self.run.train_stream
        inputs = loader.input_tokens - tally.seen_inputs
        tally.seen_inputs = loader.input_tokens
        loss_and_inputs = torch.tensor([tally.loss_sum, float(inputs)], dtype=torch.float64,
                                       device=self.run.device)
        tokens = tally.count  # already the global count
        tally.loss_sum, tally.count = 0.0, 0.0
        if dist.is_initialized():
            dist.all_reduce(loss_and_inputs)
        return float(loss_and_inputs[0]) / max(tokens, 1.0), int(tokens), int(loss_and_inputs[1])

    def learning_rate(self) -> float:
        return self.schedule.get_last_lr()[0]

    def save(self, decision: Decision) -> None:
        """Checkpoint this step (:mod:`.checkpoint`), recording why."""
        info = self.run.checkpoint_info(decision.reason)
        save_checkpoint(self, self.run.run_dir, info, self.run.config.training.save_total_limit)

    # ---- evaluation ---------------------------------------------------------------------------

    def evaluate(self, eval_dataset: Dataset | dict[str, Dataset] | None = None,
                 ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate now on the run's eval rows, reported as at a step end (the run loop's
        :meth:`RunLoop.evaluate`); transformers' arguments are taken and not used."""
        return self.loop.evaluate()

    def eval_metrics(self) -> dict[str, float]:
        """One pass over the eval rows, the same metrics on every rank."""
        model, run, rows = self.trained_model, self.run, self.run.data.eval
        assert rows is not None  # the run loop evaluates a run with eval rows only (StepFlowCallback)
        was_training = model.training
        model.eval()
        sums = None
        with torch.no_grad():
            view = run.config.data_run()
            for batch, stream in eval_streams(rows, view, **run.stream_coords):
                stream = {k: v.to(run.device) for k, v in stream.items()}
                part = self.eval_sums(model, batch, stream)
                sums = part if sums is None else sums + part
        model.train(was_training)
        assert sums is not None  # check_eval_rows made sure of one evaluation step's rows
        if dist.is_initialized():
            dist.all_reduce(sums)
        return self.metrics_from_sums(sums)

    def eval_sums(self, model: torch.nn.Module, batch: PackedBatch, stream: dict[str, torch.Tensor]
                  ) -> torch.Tensor:
        """This rank's float64 sums of one eval micro-batch: token loss, tokens, and for sft
        the exactly matched answers and the answers."""
        run = self.run
        logits = model(**model_inputs(stream)).logits
        labels = stream["labels"]
        sums = torch.zeros(4, dtype=torch.float64, device=run.device)
        sums[0] = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                  ignore_index=IGNORE_INDEX, reduction="sum").double()
        sums[1] = float((labels != IGNORE_INDEX).sum())
        if run.exact_match:
            matched = self.exact_match_counts(logits, batch)  # every SP rank: the gather is collective
            if run.sp_rank == 0:
                sums[2:] = matched.to(sums)
        return sums

    def metrics_from_sums(self, sums: torch.Tensor) -> dict[str, float]:
        loss, tokens, correct, answers = sums.tolist()
        metrics = {"eval/loss": loss / tokens if tokens else float("nan")}
        if self.run.exact_match:
            metrics["eval/accuracy"] = correct / answers if answers else 0.0
        return metrics

    def exact_match_counts(self, logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """``[correct, answers]`` of a micro-batch, from this SP group's predictions."""
        run = self.run
        predictions = logits.argmax(dim=-1)
        pad = -batch.labels.numel() % run.sp_size
        predictions = gather_and_unpad(predictions, run.sp_group, dim=1, pad=pad)
        return response_exact_match(predictions.reshape(batch.labels.shape).cpu(), batch.labels,
                                    batch.documents)


class StepEndCallback(TrainerCallback):
    """Ends every optimizer step of transformers' loop through the shared run loop: its
    ``on_step_end`` comes right after the optimizer and LR steps, on every rank."""

    def __init__(self, trainer: StandardTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: object) -> TrainerControl:
        self.trainer.end_step()
        return self.trainer.control


def checkpoint_info(records: dict[str, Any], env: RankEnv, counters: RunCounters, reason: str) -> CheckpointInfo:
    """checkpoint.json of a standard-backend checkpoint: the run's counters as they stand."""
    return CheckpointInfo.of_save(counters.state_dict(), records, reason=reason, job_id=env.job_id,
                                  restart_count=env.restart_count, format=HF_FORMAT)


def batch_count(num_items_in_batch: torch.Tensor | int | None) -> float:
    """The divisor of a micro-batch's loss: the global batch's count (at least 1)."""
    return max(float(num_items_in_batch), 1.0) if num_items_in_batch is not None else 1.0
