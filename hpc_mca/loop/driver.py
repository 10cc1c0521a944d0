"""The run loop both backends share: what happens at the end of every optimizer step, and
around the run.

The backends differ in how a step is taken: the Megatron backend
(:class:`hpc_mca.trainer.trainer.Trainer`) runs its own loop through :meth:`RunLoop.run`;
the standard backend lets transformers' ``Trainer`` run the loop and calls
:meth:`RunLoop.end_step` from its ``on_step_end`` callback. Either way, once the step's
:class:`~hpc_mca.loop.records.StepResult` is known (losses already reduced over the job) and
the backend has advanced the run's :class:`~hpc_mca.loop.counters.RunCounters` (step, samples,
and a skipped step: non-finite gradients on any rank, :func:`any_non_finite`), the step end
is this module's, in this order:

1. the step's wall time (the device synchronised first) and its steps.jsonl line;
2. the save/stop decision of :class:`~hpc_mca.loop.boundary.StepBoundary`;
3. logging and evaluation where ``TrainerControl`` asks for them
   (:class:`~hpc_mca.loop.callbacks.StepFlowCallback` sets the intervals), the save the
   decision asks for (the backend writes its own checkpoint format), then a new throughput
   window, so tokens/s covers training steps only;
4. the stop, recorded in the counters as a requeue when a signal asked for it.

At the end (:meth:`RunLoop.finalize`), a run that trained to its end is exported as the config
asks and marked finished, the same way on both backends.

What a backend supplies is :class:`LoopBackend`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState

from hpc_mca.checkpoint.store import export_targets, mark_finished
from hpc_mca.config.sections import TrainingArguments
from hpc_mca.rundir import EVALS_FILE, STEPS_FILE
from hpc_mca.runtime.distributed import collective_timeout_s
from hpc_mca.runtime.heartbeat import Heartbeat

from .boundary import Decision, StepBoundary
from .counters import RunCounters
from .metrics import MetricsWriter
from .outputs import JobSpan, RunSummary, write_run_outputs
from .records import StepResult

if TYPE_CHECKING:
    from transformers import TrainingArguments as HFArguments

__all__ = ["LoopBackend", "RunLoop", "any_non_finite"]


class LoopBackend(Protocol):
    """What the run loop needs from a backend. ``state`` and ``control`` are transformers'
    records, which the callbacks get (its ``global_step`` is the run counters' when
    :meth:`RunLoop.end_step` runs: the backend advanced both after its optimizer step)."""

    state: TrainerState
    control: TrainerControl

    def learning_rate(self) -> float:
        """The LR the step just taken used (after any skipped step put the schedule back)."""
        ...

    def eval_metrics(self) -> dict[str, float]:
        """One pass over the eval rows: ``eval/...`` values, the same on every rank."""
        ...

    def save(self, decision: Decision) -> None:
        """Checkpoint the current step in the backend's format (a collective)."""
        ...


@dataclasses.dataclass
class Window:
    """A logging window: what the logged throughput divides."""

    start: float
    input_tokens: int = 0
    steps: int = 0


class RunLoop:
    """The step end, begin and finish of one run on this rank (see the module docstring).
    ``counters``: the run's (:class:`~.counters.RunCounters`, restored from the checkpoint
    before :meth:`begin`), which the backend advances and this loop reads;
    ``events``/``args``: the backend's callback handler and the arguments its callbacks get;
    ``boundary``: the save/stop decision, whose stop signal takes over SIGTERM/USR1 from when
    it listens until :meth:`close`; ``unit``: what the loss is a mean over (steps.jsonl's
    count field); ``hang_timeout``: the config's ``training.hang_timeout``, for the heartbeat
    the batch script's watchdog reads."""

    def __init__(self, backend: LoopBackend, *, counters: RunCounters, boundary: StepBoundary,
                 events: CallbackHandler, args: HFArguments, metrics: MetricsWriter,
                 device: torch.device, unit: str = "tokens", hang_timeout: int | None = None) -> None:
        self.backend, self.counters, self.boundary = backend, counters, boundary
        self.events, self.args = events, args
        self.metrics, self.device, self.unit = metrics, device, unit
        self.history: list[StepResult] = []
        self.window = Window(time.perf_counter())
        self.step_end = self.window.start  # where the next step's time starts
        self.hang_timeout = hang_timeout
        self.heartbeat: Heartbeat | None = None
        self.job: tuple[int, float] | None = None
        """(the step this job started training from, when): :meth:`begin`'s."""

    @property
    def requeue(self) -> bool:
        """This process stopped early on a signal (the counters' record of it)."""
        return self.counters.requeue

    # ---- around the run ---------------------------------------------------------------------

    def listen(self) -> None:
        """From now until :meth:`close`, SIGTERM/USR1 are stop requests the boundary acts on
        (for a boundary whose signal was made without listening)."""
        self.boundary.signal.listen()

    def begin(self, *, job_id: str | None, restart_count: int) -> None:
        """Before the first step this process trains, from the counters' step (restored from
        the checkpoint: the standard backend's Trainer loads its own files only once its loop
        runs): a fresh run starts its steps.jsonl afresh (a resumed one was truncated to its
        checkpoint by the resume), progress.json says where the run stands, and the
        throughput window opens."""
        step = self.counters.global_step
        if step == 0 and self.metrics.enabled:
            (self.metrics.run_dir / STEPS_FILE).unlink(missing_ok=True)
            (self.metrics.run_dir / EVALS_FILE).unlink(missing_ok=True)
        self.metrics.write_progress(step=step, max_steps=self.counters.max_steps, finished=False,
                                    job_id=job_id, restart_count=restart_count)
        self.window = Window(time.perf_counter())
        self.step_end = self.window.start
        self.job = (step, self.window.start)
        if self.heartbeat is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.heartbeat = Heartbeat.from_env(rank, hang_timeout=self.hang_timeout,
                                                ddp_timeout=collective_timeout_s())
        if self.heartbeat is not None:
            self.heartbeat.start(step)

    def run(self, take_step: Callable[[], StepResult]) -> None:
        """Own the loop (a backend without one of its own): steps until ``max_steps`` or the
        boundary's stop, with transformers' train begin/end events around them."""
        backend = self.backend
        backend.control = self.events.on_train_begin(self.args, backend.state, backend.control)
        while not self.counters.at_end:
            if self.end_step(take_step()).stop:
                break
        backend.control = self.events.on_train_end(self.args, backend.state, backend.control)

    def finish(self) -> None:
        """After the last step: progress.json records where the run ended."""
        counters = self.counters
        self.metrics.write_progress(step=counters.global_step, finished=counters.at_end)

    def finalize(self, *, finished: bool, run_dir: Path, training: TrainingArguments,
                 export: Callable[[Path, bool], None], steps_per_epoch: int, is_main: bool,
                 job_id: str | None, restart_count: int) -> None:
        """The end of a run that trained to its end (``finished``: not stopped for a requeue):
        each export the config asks for (``export(out, merged)`` on every rank: the backend
        decides who writes), then rank 0 writes the run's results beside them
        (:mod:`.outputs`: trainer_state.json, train_results.json ...), marks the run finished
        (its job never requeues again) and progress.json says so, with the job's id and
        restart count. Every rank, whichever backend."""
        if not finished:
            return
        for out, merged in export_targets(run_dir, training.export_hf_dir, training.export_merged_dir):
            export(out, merged)
        _barrier()  # every export written before the run counts as finished
        if is_main:
            step = self.counters.global_step
            write_run_outputs(run_dir, self._summary(training, steps_per_epoch))
            mark_finished(run_dir, step, steps_per_epoch=steps_per_epoch)
            self.metrics.write_progress(step=step, finished=True, job_id=job_id, restart_count=restart_count)
        _barrier()

    def _summary(self, training: TrainingArguments, steps_per_epoch: int) -> RunSummary:
        counters = self.counters
        first, started = self.job if self.job is not None else (counters.global_step, self.step_end)
        return RunSummary(
            global_step=counters.global_step, max_steps=counters.max_steps,
            steps_per_epoch=steps_per_epoch, num_train_epochs=training.num_train_epochs,
            logging_steps=training.logging_steps, eval_steps=training.eval_steps,
            save_steps=training.save_steps, train_batch_size=training.per_device_train_batch_size,
            consumed_samples=counters.consumed_samples, flops_per_token=self.metrics.flops_per_token,
            job=JobSpan(first_step=first, seconds=max(0.0, self.step_end - started)))

    def close(self) -> None:
        """Always, however the run ended: the signal handlers go back, the trackers close."""
        self.boundary.signal.restore()
        if self.heartbeat is not None:
            self.heartbeat.close()
        self.metrics.close()

    def _peak_memory(self) -> dict[str, float]:
        """``max_memory_gib``: the most device memory torch's allocator held at once since the
        process started (its ``max_memory_allocated``), on CUDA; nothing elsewhere."""
        if self.device.type != "cuda":
            return {}
        return {"max_memory_gib": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)}

    # ---- the step end -----------------------------------------------------------------------

    def end_step(self, result: StepResult) -> Decision:
        """Everything after a step (see the module docstring); every rank, every step."""
        backend, counters = self.backend, self.counters
        step = counters.global_step
        if backend.state.global_step != step:
            raise RuntimeError(f"the backend's TrainerState is at step {backend.state.global_step}, "
                               f"the run's counters at {step}: one was advanced without the other")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a step ends when its kernels do
        now = time.perf_counter()
        result.seconds, self.step_end = now - self.step_end, now
        if self.heartbeat is not None:
            self.heartbeat.step_done(step, result.seconds)
        self.history.append(result)
        self.window.input_tokens += result.input_tokens
        self.window.steps += 1
        lr = self.backend.learning_rate()
        self.metrics.record_step(step=step, loss=result.loss, **{self.unit: result.tokens},
                                 input_tokens=result.input_tokens, grad_norm=result.grad_norm,
                                 lr=lr, skipped=result.skipped, seconds=round(result.seconds, 6),
                                 **{f"mtp_loss_{k}": v for k, v in enumerate(result.mtp_losses, 1)},
                                 **result.metrics, **self._peak_memory())
        decision = self.boundary.decide(counters, backend.control)
        backend.control.should_save = decision.save
        backend.control.should_training_stop = decision.stop
        # Read once: on_log/on_evaluate clear the flags they answer.
        log, evaluate = backend.control.should_log, backend.control.should_evaluate
        if log:
            self._log(result, lr, now)
        if evaluate:
            with self._phase("eval"):
                self.evaluate()
        if decision.save:
            with self._phase("save"):
                backend.save(decision)
            backend.control = self.events.on_save(self.args, backend.state, backend.control)
        if log or evaluate or decision.save:
            self.window = Window(time.perf_counter())
            self.step_end = self.window.start
        if decision.stop:
            counters.requeue = decision.requeue
        return decision

    def evaluate(self) -> dict[str, float]:
        """The backend's eval metrics, reported: trackers, progress.json, the run log and the
        callbacks' ``on_evaluate``."""
        backend = self.backend
        metrics = backend.eval_metrics()
        self.metrics.scalars(self.counters.global_step, metrics)
        self.metrics.record_eval(self.counters.global_step, metrics)
        self.metrics.write_progress(**{k.replace("/", "_"): v for k, v in metrics.items()})
        if self.metrics.enabled:
            print(" | ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
        backend.control = self.events.on_evaluate(self.args, backend.state, backend.control,
                                                  metrics=metrics)
        return metrics

    def _phase(self, name: str) -> contextlib.AbstractContextManager:
        return self.heartbeat.phase(name) if self.heartbeat is not None else contextlib.nullcontext()

    def _log(self, result: StepResult, lr: float, now: float) -> None:
        backend, window = self.backend, self.window
        step = self.counters.global_step
        elapsed = max(now - window.start, 1e-9)
        values = {"train/loss": result.loss, "train/lr": lr, "train/grad_norm": result.grad_norm,
                  "train/skipped_iters": float(self.counters.skipped_iters),
                  **self.metrics.throughput(window.input_tokens / elapsed)}
        if result.moe_aux_loss is not None:
            values["train/moe_aux_loss"] = result.moe_aux_loss
        values.update({f"train/mtp_loss_{k}": v for k, v in enumerate(result.mtp_losses, 1)})
        values.update({f"train/{k}": v for k, v in result.metrics.items()})
        self.metrics.scalars(step, values)
        self.metrics.progress_line(step, values, elapsed / max(window.steps, 1))
        logs = {key.split("/")[-1]: value for key, value in values.items()}
        backend.state.log_history.append({**logs, "step": step})
        backend.control = self.events.on_log(self.args, backend.state, backend.control, logs=logs)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def any_non_finite(sums: list[torch.Tensor], device: torch.device) -> bool:
    """Whether any rank's gradients hold a non-finite value, from each gradient's sum (a sum
    is non-finite iff some element is, or it overflows: not finite either). A collective when
    the process group is up: every rank takes the same decision (Megatron's rule: the step
    then makes no update)."""
    flag = (~torch.isfinite(torch.stack(sums))).any().to(device, torch.int32).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
