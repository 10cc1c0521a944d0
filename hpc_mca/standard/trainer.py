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
* **step end** (every optimizer step, every rank): one steps.jsonl line; every
  ``logging_steps`` the progress line and TensorBoard scalars (the Megatron backend's names);
  evaluation every ``eval_steps``; the save/stop decision of :mod:`hpc_mca.loop.boundary`
  (intervals, the last step, an agreed stop signal), saved by :mod:`.checkpoint`;
* **non-finite gradients** on any rank: no update and the LR schedule stays (Megatron's rule).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Trainer

from hpc_mca.checkpoint.store import HF_FORMAT, CheckpointInfo
from hpc_mca.data.addition import response_exact_match
from hpc_mca.loop.boundary import StepBoundary
from hpc_mca.loop.metrics import MetricsWriter
from hpc_mca.loop.records import StepResult
from hpc_mca.runtime.sequence_parallel import IGNORE_INDEX, gather_and_unpad

from .checkpoint import save_checkpoint
from .data import eval_streams

__all__ = ["StandardTrainer"]


class StandardTrainer(Trainer):
    """transformers' Trainer on hpc-mca's data, loss and run files (see the module docstring).
    ``run``: the run's settings and helpers (:class:`hpc_mca.standard.run.StandardRun`).
    Stage dpo subclasses it (:class:`hpc_mca.standard.dpo.StandardDpoTrainer`): the hooks it
    replaces are the step's count (``_local_count``), ``compute_loss``, ``_step_metrics`` and
    the eval sums."""

    loss_is_scaled_for_ga = True  # compute_loss divides by the global token count itself
    unit = "tokens"
    """What the loss is a mean over (steps.jsonl's count field)."""

    def __init__(self, *, run: Any, boundary: StepBoundary, metrics: MetricsWriter,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run, self.boundary, self.metrics = run, boundary, metrics
        self.requeue = False
        self._sums = torch.zeros(3, dtype=torch.float64)  # loss sum, count, input tokens
        self._window = [time.perf_counter(), 0, 0]  # start, input tokens, steps
        self._step_end = time.perf_counter()
        self._seen_inputs = 0
        self._last_step = -1
        self.skipped_iters, self._skipped = run.skipped_iters, False
        self.history: list[StepResult] = []  # what run_training returns, as the Megatron loop's
        self.optimizer.register_step_pre_hook(self._skip_non_finite)

    # ---- data and loss ------------------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        return self.run.train_stream

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor:
        """The global batch's count (real tokens; dpo: pairs) over every rank's micro-batches
        of this step, which ``compute_loss`` divides by."""
        count = torch.tensor(self._local_count(batch_samples), dtype=torch.float64,
                             device=self.run.device)
        if dist.is_initialized():
            dist.all_reduce(count)
        self._sums[1] += float(count)
        return count

    def _local_count(self, batch_samples: list) -> float:
        return float(sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batch_samples))

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                     return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), inputs["labels"].flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        self._sums[0] += float(loss_sum.detach())
        loss = loss_sum * (self.run.world_size / _count(num_items_in_batch))
        return (loss, logits) if return_outputs else loss

    def _step_metrics(self, count: int) -> dict[str, float]:
        """The objective's extra values of a step of ``count`` (dpo: rewards and
        log-probabilities)."""
        return {}

    def _skip_non_finite(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Megatron's rule for a step whose gradients are not all finite (on any rank): no
        update. Dropping the gradients makes the optimizer step a no-op; the LR schedule is
        taken back at the step end (transformers' loop advances it regardless)."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        # A sum is non-finite iff some element is (or it overflows: not finite either).
        bad = torch.stack([g.float().sum() for g in grads]).isfinite().all().logical_not()
        flag = bad.to(self.run.device, torch.int32).reshape(1)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._skipped = bool(flag.item())
        if self._skipped:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None

    # ---- the step end -------------------------------------------------------------------------

    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, *args: Any,
                                 **kwargs: Any) -> None:
        """Called by the Trainer after every optimizer step (every rank), and once more at the
        end of its epoch loop (the same step: nothing to do then)."""
        step = self.state.global_step
        if step == self._last_step:
            return
        self._last_step = step
        loss, tokens, inputs = self._step_sums()
        skipped, self._skipped = self._skipped, False
        if skipped:
            self.skipped_iters += 1
            self.lr_scheduler.step(increment=-1)  # no update, so the schedule stays put
        self.run.sync()
        now = time.perf_counter()
        seconds, self._step_end = now - self._step_end, now
        norm = float(grad_norm) if grad_norm is not None and not skipped else float("nan")
        lr = self.lr_scheduler.get_last_lr()[0]
        extra = self._step_metrics(tokens)
        self.history.append(StepResult(loss=loss, tokens=tokens, input_tokens=inputs,
                                       grad_norm=norm, skipped=skipped, metrics=extra,
                                       seconds=seconds))
        self.metrics.record_step(step=step, loss=loss, **{self.unit: tokens}, input_tokens=inputs,
                                 grad_norm=norm, lr=lr, skipped=skipped, seconds=round(seconds, 6),
                                 **extra)
        self._window[1] += inputs
        self._window[2] += 1
        decision = self.boundary.decide(step, self.control)
        last = step >= self.run.max_steps
        logged = step % self.args.logging_steps == 0 or last
        if logged:
            self._log(step, {"train/loss": loss, "train/lr": lr, "train/grad_norm": norm,
                             **{f"train/{k}": v for k, v in extra.items()}}, now)
        evaluated = self.run.data.eval is not None and (
            last or (self.run.eval_steps and step % self.run.eval_steps == 0))
        if evaluated:
            self.evaluate()
        if decision.save:
            info = self.run.checkpoint_info(step, self.run.consumed_samples(step),
                                            decision.reason, self.skipped_iters)
            save_checkpoint(self, self.run.run_dir, info, self.run.config.training.save_total_limit)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        if logged or evaluated or decision.save:
            self._window = [time.perf_counter(), 0, 0]
            self._step_end = self._window[0]
        if decision.stop:
            self.requeue = decision.requeue
            self.control.should_training_stop = True

    def _step_sums(self) -> tuple[float, int, int]:
        """(mean loss, its count, input tokens) of the step just taken, over all ranks."""
        loader = self.run.train_stream
        self._sums[2] = float(loader.input_tokens - self._seen_inputs)
        self._seen_inputs = loader.input_tokens
        sums = self._sums.clone().to(self.run.device)
        self._sums.zero_()
        loss_and_inputs = sums[[0, 2]]
        if dist.is_initialized():
            dist.all_reduce(loss_and_inputs)
        tokens = float(sums[1])  # already the global count
        return float(loss_and_inputs[0]) / max(tokens, 1.0), int(tokens), int(loss_and_inputs[1])

    def _log(self, step: int, values: dict[str, float], now: float) -> None:
        start, inputs, steps = self._window
        elapsed = max(now - start, 1e-9)
        values = {**values, "train/skipped_iters": float(self.skipped_iters),
                  **self.metrics.throughput(inputs / elapsed)}
        self.metrics.scalars(step, values)
        self.metrics.progress_line(step, values, elapsed / max(steps, 1))
        logs = {key.split("/")[-1]: value for key, value in values.items()}
        self.state.log_history.append({**logs, "step": step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    # ---- evaluation ---------------------------------------------------------------------------

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """One pass over the eval rows, the same metrics on every rank, logged like the
        Megatron backend's."""
        model, run = self.model, self.run
        was_training = model.training
        model.eval()
        sums = None
        with torch.no_grad():
            for batch, stream in eval_streams(run.data.eval, run.config, **run.stream_coords):
                stream = {k: v.to(run.device) for k, v in stream.items()}
                part = self._eval_sums(model, batch, stream)
                sums = part if sums is None else sums + part
        model.train(was_training)
        if dist.is_initialized():
            dist.all_reduce(sums)
        metrics = self._eval_metrics(sums)
        step = self.state.global_step
        self.metrics.scalars(step, metrics)
        self.metrics.write_progress(**{k.replace("/", "_"): v for k, v in metrics.items()})
        if run.is_main:
            print(" | ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control,
                                                         metrics=metrics)
        return metrics

    def _eval_sums(self, model: torch.nn.Module, batch: Any, stream: dict[str, torch.Tensor]
                   ) -> torch.Tensor:
        """This rank's float64 sums of one eval micro-batch: token loss, tokens, and for sft
        the exactly matched answers and the answers."""
        run = self.run
        logits = model(input_ids=stream["input_ids"], position_ids=stream["position_ids"]).logits
        labels = stream["labels"]
        sums = torch.zeros(4, dtype=torch.float64, device=run.device)
        sums[0] = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                  ignore_index=IGNORE_INDEX, reduction="sum").double()
        sums[1] = float((labels != IGNORE_INDEX).sum())
        if run.exact_match:
            matched = self._exact_match(logits, batch)  # every SP rank: the gather is collective
            if run.sp_rank == 0:
                sums[2:] = matched.to(sums)
        return sums

    def _eval_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        metrics = {"eval/loss": float(sums[0] / sums[1])}
        if self.run.exact_match:
            metrics["eval/accuracy"] = float(sums[2] / sums[3]) if sums[3] else 0.0
        return metrics

    def _exact_match(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        """``[correct, answers]`` of a micro-batch, from this SP group's predictions."""
        run = self.run
        predictions = logits.argmax(dim=-1)
        pad = -batch.labels.numel() % run.sp_size
        predictions = gather_and_unpad(predictions, run.sp_group, dim=1, pad=pad)
        return response_exact_match(predictions.reshape(batch.labels.shape).cpu(), batch.labels,
                                    batch.documents)


def checkpoint_info(records: dict[str, Any], env: Any, step: int, samples: int, reason: str,
                    skipped_iters: int = 0) -> CheckpointInfo:
    """checkpoint.json of a standard-backend checkpoint."""
    return CheckpointInfo(step=step, consumed_samples=samples, saved_at=time.time(),
                          skipped_iters=skipped_iters,
                          job_id=env.job_id, restart_count=env.restart_count, reason=reason,
                          format=HF_FORMAT,
                          **records)


def _count(num_items_in_batch: Any) -> float:
    """The divisor of a micro-batch's loss: the global batch's count (at least 1)."""
    return max(float(num_items_in_batch), 1.0) if num_items_in_batch is not None else 1.0
