"""The training loop: Megatron DDP, Megatron optimizer, pipeline schedules, HF callbacks.

Shaped like Megatron-Core's simple train loop and ROLL's McaTrainer, kept small:

    Trainer(config, ctx, model_chunks, data, objective=objective_for(config, ...), ...).train()

``train()`` resumes from the run's checkpoint (if any), repeats ``train_step`` (forward-backward
over the global batch's micro-batches, finalize grads, optimizer step, LR step) until
``max_steps``, logging, evaluating and calling the callbacks (transformers' ``TrainerCallback``
protocol) on the way, and ends the run. Where the run stands (step, samples, skipped steps,
``max_steps``) is its :class:`~hpc_mca.loop.counters.RunCounters`, which ``_step`` advances.
The trainer owns its :class:`~hpc_mca.checkpoint.checkpointer.Checkpointer` and calls it at
step boundaries; what to save is the trainer's counters and ``state_dict`` (the
:class:`~hpc_mca.checkpoint.state.Resumable` protocol), when to save or stop is the step
boundary's decision (:mod:`hpc_mca.loop.boundary`). Everything layout
specific (pipeline stages, virtual chunks, data-parallel sharding) is Megatron's or the data
sampler's business; the loop itself does not branch on it. What a batch means (forward step,
loss and its reduction, eval metric) is the stage's :class:`~hpc_mca.trainer.objective.Objective`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
from transformers.trainer_callback import CallbackHandler, TrainerCallback, TrainerControl, TrainerState

from hpc_mca.checkpoint.checkpointer import Checkpointer
from hpc_mca.checkpoint.compat import nothing_to_train
from hpc_mca.checkpoint.requeue import StopSignal
from hpc_mca.checkpoint.state import LoopState
from hpc_mca.config.run_length import total_training_steps
from hpc_mca.config.schedule import build_lr_scheduler, resolve_warmup_steps, scheduler_spec
from hpc_mca.config.sections import ParallelArguments, TrainConfig
from hpc_mca.data.batch import PackedBatch
from hpc_mca.data.dataset import TrainingData, epoch_plan, eval_dataloader, train_dataloader
from hpc_mca.data.errors import DataError
from hpc_mca.loop.boundary import Decision, StepBoundary
from hpc_mca.loop.callbacks import StepFlowCallback, callback_args
from hpc_mca.loop.counters import RunCounters
from hpc_mca.loop.driver import RunLoop, any_non_finite
from hpc_mca.loop.metrics import MetricsWriter, flops_per_token
from hpc_mca.loop.optimizer import optimizer_config, use_fused_adam
from hpc_mca.loop.records import StepResult
from hpc_mca.loop.trackers import job_fields, open_trackers
from hpc_mca.runtime.distributed import RankContext
from hpc_mca.runtime.rng import collect_rng, restore_rng
from hpc_mca.topology import ModelShape
from hpc_mca.trainer.objective import ForwardStep, Objective
from hpc_mca.trainer.partial_step import whole_pipeline_rounds

if TYPE_CHECKING:  # megatron is imported lazily, inside the functions that use it
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
    from megatron.core.transformer.module import MegatronModule
    from transformers import TrainingArguments as HFArguments
    from transformers.trainer_utils import EvalPrediction

    from hpc_mca.data.rows import RowDataset

_T = TypeVar("_T")


class Trainer:
    """Runs one training job on this rank."""

    def __init__(self, config: TrainConfig, ctx: RankContext, chunks: list[MegatronModule],
                 data: TrainingData, *, objective: Objective, run_dir: Path, model_shape: ModelShape,
                 callbacks: Iterable[TrainerCallback] = (),
                 compute_metrics: Callable[[EvalPrediction], Mapping[str, float]] | None = None,
                 script_args: HFArguments | None = None) -> None:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.config, self.ctx, self.data, self.run_dir = config, ctx, data, run_dir
        self.mpu = parallel_state
        self.model = wrap_ddp(chunks, config.parallel,
                              half_precision=config.training.bf16 or config.training.fp16)
        tr = config.training
        self.counters = RunCounters(max_steps=total_training_steps(tr, len(data.train)))
        max_steps = self.counters.max_steps
        self.epochs = epoch_plan(data.train, config.data_run())  # each epoch's last step partial
        schedule = scheduler_spec(tr.lr_scheduler_type, tr.lr_scheduler_kwargs, tr.learning_rate,
                                  resolve_warmup_steps(tr.warmup_steps, tr.warmup_ratio, max_steps),
                                  max_steps)
        self.optimizer = build_optimizer(self.model, optimizer_config(config.training, config.parallel,
                                                                      min_lr=schedule.min_lr))
        # The schedule multiplies each loss by the optimizer's loss scale before backward (as
        # Megatron-LM's loop sets up); without it the fp16 optimizer unscales gradients that
        # were never scaled, and trains on 2^-32 of them. (Scale 1 in bf16 and fp32.)
        chunks[0].config.grad_scale_func = self.optimizer.scale_loss
        if tr.fused_optimizer:
            use_fused_adam(self.optimizer)
        self.lr_scheduler = build_lr_scheduler(schedule, self.optimizer, weight_decay=tr.weight_decay)
        self.forward_backward = get_forward_backward_func()
        self.objective = objective
        self.forward_step = objective.forward_step()
        self.eval_metric = objective.eval_metric()
        self.compute_metrics = compute_metrics
        """transformers' ``compute_metrics``: ``EvalPrediction`` of the eval rows -> metrics."""
        # transformers' record of the run, which callbacks read: its step follows the counters'.
        self.state = TrainerState(max_steps=max_steps, logging_steps=config.training.logging_steps,
                                  eval_steps=config.training.eval_steps or 0, is_world_process_zero=ctx.is_main)
        self.control = TrainerControl()
        self.args = script_args if script_args is not None else callback_args(tr)
        """What the callbacks get as transformers' ``args``: a script's own arguments object (as
        transformers' Trainer gives its callbacks), else the run config's training section."""
        flow = StepFlowCallback(data.eval is not None, tr.logging_steps, tr.eval_steps)
        self.callbacks = CallbackHandler([flow, *callbacks], self.model, data.tokenizer, self.optimizer,
                                         self.lr_scheduler)
        seq = config.derived.seq_length
        trackers = (open_trackers(config.training.report_to, config.to_yaml(), run_dir,
                                  job_fields(ctx.env)) if ctx.is_main else [])
        self.metrics = MetricsWriter(run_dir, ctx.is_main, trackers, max_steps,
                                     flops_per_token(model_shape, seq), ctx.env.world_size)
        # The signals are the loop's from train() on: a trainer made and not trained (a
        # script that only evaluates) leaves them alone.
        signal = StopSignal(run_dir, ctx.device, ctx.is_main, listen=False)
        self.loop = RunLoop(self, counters=self.counters, boundary=StepBoundary(tr.save_steps, signal, ctx.is_main),
                            events=self.callbacks, args=self.args, metrics=self.metrics,
                            device=ctx.device, unit=objective.unit, hang_timeout=tr.hang_timeout)
        self.checkpointer = Checkpointer(config, ctx, run_dir, model_shape, loop=self,
                                         progress=self.metrics.write_progress)

    # ---- resumable state (hpc_mca.checkpoint.state.Resumable) -------------------------------

    def state_dict(self) -> LoopState:
        """What a checkpoint keeps of the loop beside the model, optimizer and counters."""
        return {"lr_scheduler": self.lr_scheduler.state_dict(), "rng_state": collect_rng()}

    def load_state_dict(self, state: LoopState) -> None:
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if "rng_state" in state:
            restore_rng(state["rng_state"])

    # ---- the run ----------------------------------------------------------------------------

    def resume_from(self, spec: str) -> None:
        """Resume from ``spec`` (a ``training.resume_from_checkpoint`` value) instead of the
        config's choice: a new resolved config, for this trainer and its checkpointer."""
        self.config = self.config.amended("training", resume_from_checkpoint=spec)
        self.checkpointer.config = self.config

    def train(self) -> list[StepResult]:
        """Resume from the run's checkpoint (if any), train to ``max_steps`` with interval, end
        and on-signal saves, and end the run: marked finished (and exported to HF when
        configured), or, stopped early by a signal, left for the batch script to requeue.
        Returns the step results of this process's part of the run (the same on every rank)."""
        counters = self.counters
        self.loop.listen()
        try:
            self.checkpointer.resume()  # the counters too, as one unit
            self.state.global_step = counters.global_step
            self._say_rederived_schedule()
            if counters.at_end:
                # Resumed at its end: a finished run started again (say so), or one that died
                # between its last checkpoint and the finished marker (finalize writes it).
                idle = nothing_to_train(self.config.training, counters.max_steps)
                if idle and self.ctx.is_main:
                    print(idle, flush=True)
            else:
                self.checkpointer.begin(counters.global_step, counters.max_steps)
                self.loop.begin(job_id=self.ctx.env.job_id, restart_count=self.ctx.env.restart_count)
                batches = self._global_batches()
                self.loop.run(lambda: self._step(batches))
                self.loop.finish()
            self.gather_params()
            self.checkpointer.finalize()
            tr, env = self.config.training, self.ctx.env
            self.loop.finalize(finished=not counters.requeue, run_dir=self.run_dir, training=tr,
                               export=self.checkpointer.export, is_main=self.ctx.is_main,
                               steps_per_epoch=self.epochs.steps_per_epoch,
                               job_id=env.job_id, restart_count=env.restart_count)
        finally:
            self.loop.close()
        return self.loop.history

    def _step(self, batches: Iterator[list[PackedBatch]]) -> StepResult:
        """One step of the loop (:class:`~hpc_mca.loop.driver.RunLoop` ends it) with the
        callbacks' step events around it; the counters advance before ``on_step_end``."""
        self.control = self.callbacks.on_step_begin(self.args, self.state, self.control)
        result = self.train_step(next(batches))
        counters = self.counters
        counters.step_taken(self.epochs.step_samples(counters.consumed_samples), skipped=result.skipped)
        self.state.global_step = counters.global_step
        self.state.epoch = counters.consumed_samples / self.epochs.samples_per_epoch
        self.control = self.callbacks.on_step_end(self.args, self.state, self.control)
        self.checkpointer.poll()  # commit an async save whose shards are all written
        return result

    # ---- what the run loop asks of a backend (hpc_mca.loop.driver.LoopBackend) --------------

    def learning_rate(self) -> float:
        return self.lr_scheduler.get_last_lr()[0]

    def save(self, decision: Decision) -> None:
        self.gather_params()
        self.checkpointer.save(decision.reason, stop_time=decision.stop_time)

    def _say_rederived_schedule(self) -> None:
        """After a resume with another length: the LR schedule keys this config re-derived."""
        rederived = getattr(self.lr_scheduler, "rederived", {})
        if rederived and self.ctx.is_main:
            print("LR schedule re-derived for this config: "
                  + ", ".join(f"{k} {old}->{new}" for k, (old, new) in rederived.items()), flush=True)

    def gather_params(self) -> None:
        """Under ``overlap_param_gather`` the distributed optimizer's updated shards reach the
        other ranks only in the next forward's pre-hooks; a checkpoint or export before that
        would write the previous step's values of every shard this rank does not own (seen:
        half the weights of a DP2 export stale, a resume not exact). Gather them now, as
        Megatron-LM does before it saves."""
        if self.config.parallel.overlap_param_gather:
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=True)
                chunk.enable_forward_pre_hook()

    def train_step(self, micro_batches: list[PackedBatch]) -> StepResult:
        """One optimizer step over a global batch (this rank's micro-batches)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.objective.before_forward(micro_batches, self._forward_only)
        outputs = self._schedule(self.model, self.forward_step, micro_batches, forward_only=False)
        inputs = sum(batch.input_tokens for batch in micro_batches)
        loss, tokens, inputs = self._reduce(outputs, inputs)
        mtp_losses = _per_token(self.objective.mtp_loss_sums())
        metrics = self.objective.step_metrics(outputs)
        self.control = self.callbacks.on_pre_optimizer_step(self.args, self.state, self.control)
        grad_norm: float | None = float("nan")
        if self.config.training.fp16:
            # Megatron's fp16 optimizer finds an overflow itself and backs its loss scale off,
            # so every step must reach it; it reports whether it updated
            updated, grad_norm, _ = self.optimizer.step()
            skipped = not updated
        else:
            skipped = not self._grads_finite()
            if not skipped:
                _, grad_norm, _ = self.optimizer.step()
        if skipped:  # the run loop counts it
            grad_norm = float("nan")
        else:
            self.lr_scheduler.step()
        self.control = self.callbacks.on_optimizer_step(self.args, self.state, self.control)
        return StepResult(loss=loss, tokens=tokens, input_tokens=inputs, grad_norm=float(grad_norm or 0.0),
                          skipped=skipped, moe_aux_loss=self._moe_aux_loss(len(micro_batches)), mtp_losses=mtp_losses,
                          metrics=metrics)

    def evaluate(self) -> dict[str, float]:
        """Evaluate now, reported as at a step end (trackers, progress.json, the run log,
        ``on_evaluate``)."""
        return self.loop.evaluate()

    def eval_metrics(self) -> dict[str, float]:
        """Forward-only pass over the eval rows: mean token loss (+ the task metric if given)."""
        rows = self.data.eval
        # Asked only of a run with eval rows: the step flow evaluates none without, the API's
        # evaluate() refuses to.
        assert rows is not None, "eval_metrics() without eval rows"
        loader = eval_dataloader(rows, self.config.data_run(),
                                 data_parallel_rank=self.mpu.get_data_parallel_rank())
        for chunk in self.model:
            chunk.eval()
        loss_sum = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        mtp_sums = torch.zeros(self.config.model.mtp_num_layers, 2, dtype=torch.float64,
                               device=self.ctx.device)
        every: list[dict[str, torch.Tensor]] = []
        batches = agreed_batches(lambda: [self._cp_share(b) for b in loader], self.ctx.device)
        with torch.no_grad():
            for micro in map(self._one_shape, _chunks(batches, self._eval_microbatches())):
                self.objective.before_forward(micro, self._forward_only)
                outputs = self._forward_only(self.model, self.forward_step, micro)
                every += outputs
                loss, tokens, _ = self._reduce(outputs)
                loss_sum += torch.tensor([loss * tokens, tokens], dtype=torch.float64, device=self.ctx.device)
                mtp_sums += self.objective.mtp_loss_sums()
        for chunk in self.model:
            chunk.train()
        metrics = {"eval/loss": float(loss_sum[0] / loss_sum[1])}
        metrics.update({f"eval/mtp_loss_{k}": v for k, v in enumerate(_per_token(mtp_sums), 1)})
        metrics.update({f"eval/{k}": v for k, v in self.objective.step_metrics(every).items()})
        if self.eval_metric is not None:
            metrics.update(self.eval_metric(self.model, rows))
        if self.compute_metrics is not None:
            metrics.update(self._computed_metrics(self.compute_metrics, rows))
        return metrics

    def _computed_metrics(self, compute: Callable[[EvalPrediction], Mapping[str, float]],
                          rows: RowDataset) -> dict[str, float]:
        """The script's ``compute_metrics`` over the greedy predictions and labels of the
        whole eval set (every rank calls it with the same arrays)."""
        from transformers.trainer_utils import EvalPrediction

        from hpc_mca.trainer.evaluation import eval_predictions

        predictions, labels = eval_predictions(self.model, rows, self.config.data_run(),
                                               self.objective.vocab_size, self.ctx.device)
        computed = compute(EvalPrediction(predictions=predictions, label_ids=labels))
        return {f"eval/{key.removeprefix('eval_')}": float(value) for key, value in computed.items()}

    # ---- helpers ----------------------------------------------------------------------------

    def _global_batches(self) -> Iterator[list[PackedBatch]]:
        """This rank's micro-batches (its context-parallel share), grouped per optimizer step;
        a bad batch on any rank stops every rank before the step (:func:`agreed_batches`)."""
        loader = train_dataloader(self.data.train, self.config.data_run(),
                                  consumed_samples=self.counters.consumed_samples,
                                  data_parallel_rank=self.mpu.get_data_parallel_rank())
        consumed, micro = self.counters.consumed_samples, iter(loader)
        parallel = self.config.parallel
        interleaved = parallel.virtual_pipeline_model_parallel_size is not None
        while True:  # an epoch's last step has fewer micro-batches (EpochPlan)
            per_step = self.epochs.micro_steps_in_step(consumed)
            consumed += self.epochs.step_samples(consumed)
            batches = self._one_shape(agreed_batches(partial(self._next_micro_batches, micro, per_step),
                                                     self.ctx.device))
            # The interleaved schedule wants whole rounds of the pipeline (partial_step).
            yield (whole_pipeline_rounds(batches, parallel.pipeline_model_parallel_size)
                   if interleaved else batches)

    def _next_micro_batches(self, micro: Iterator[PackedBatch], count: int) -> list[PackedBatch]:
        return [self._cp_share(next(micro)) for _ in range(count)]

    def _one_shape(self, micro_batches: list[PackedBatch]) -> list[PackedBatch]:
        """Under pipeline parallelism, the unpacked micro-batches of one schedule call padded
        to the longest: the stages exchange activations of one shape (a script's collator
        may pad each batch to its own length; ROLL pads them alike)."""
        if self.mpu.get_pipeline_model_parallel_world_size() == 1 or any(b.packed for b in micro_batches):
            return micro_batches
        longest = max(b.seq_length for b in micro_batches)
        return [b.padded_to(longest) for b in micro_batches]

    def _cp_share(self, batch: PackedBatch) -> PackedBatch:
        """The chunks of ``batch`` this rank's context-parallel position keeps (every CP rank
        of a DP replica loads the same batch)."""
        return batch.cp_shard(self.mpu.get_context_parallel_world_size(),
                              self.mpu.get_context_parallel_rank())

    def _eval_microbatches(self) -> int:
        # The interleaved schedule needs at least PP micro-batches per call.
        return max(1, self.mpu.get_pipeline_model_parallel_world_size())

    def _schedule(self, model: list[torch.nn.Module], forward_step: ForwardStep,
                  micro_batches: list[PackedBatch], *, forward_only: bool) -> list[dict[str, torch.Tensor]]:
        """Megatron's forward(-backward) schedule over ``micro_batches`` with ``model``'s
        chunks; the loss functions' reports on the last pipeline stage ([] elsewhere)."""
        seq_length, micro_batch_size = micro_batches[0].schedule_shape
        iterators = (iter(micro_batches) if len(model) == 1
                     else [iter(micro_batches) for _ in model])
        return self.forward_backward(
            forward_step_func=forward_step, data_iterator=iterators, model=model,
            num_microbatches=len(micro_batches), seq_length=seq_length,
            micro_batch_size=micro_batch_size, forward_only=forward_only)

    def _forward_only(self, model: list[torch.nn.Module], forward_step: ForwardStep,
                      micro_batches: list[PackedBatch]) -> list[dict[str, torch.Tensor]]:
        return self._schedule(model, forward_step, micro_batches, forward_only=True)

    def _reduce(self, outputs: list[dict[str, torch.Tensor]], input_tokens: int = 0) -> tuple[float, int, int]:
        return self.objective.reduce_loss(outputs, input_tokens)

    def _grads_finite(self) -> bool:
        """All reduced gradients finite on every rank (one all-reduce of a flag)."""
        # One reduction per buffer, no temporaries.
        sums = [buffer.grad_data.sum(dtype=torch.float32)
                for chunk in self.model for buffer in chunk.buffers + chunk.expert_parallel_buffers]
        return not any_non_finite(sums, self.ctx.device)

    def _moe_aux_loss(self, num_microbatches: int) -> float | None:
        """Sum of the MoE auxiliary losses of this step (load balancing, z-loss), averaged over
        micro-batches and synchronised over ranks by Megatron's metrics tracker. A collective:
        every rank calls it every step of an MoE model."""
        config = self.model[0].config
        if not config.num_moe_experts:
            return None
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        names = [_MOE_AUX_LOSS_NAMES[t] for t in _as_list(config.moe_router_load_balancing_type)
                 if t in _MOE_AUX_LOSS_NAMES]
        if config.moe_z_loss_coeff:
            names.append("z_loss")
        totals: dict[str, torch.Tensor] = {}
        get_moe_metrics_tracker().report(
            loss_scale=1.0 / num_microbatches, iteration=self.counters.global_step, track_names=names,
            num_layers=config.num_layers, moe_layer_freq=config.moe_layer_freq,
            mtp_num_layers=config.mtp_num_layers, force_initialize=True, total_loss_dict=totals)
        return float(sum(float(v) for v in totals.values())) if totals else None


def agreed_batches(load: Callable[[], list[PackedBatch]], device: torch.device) -> list[PackedBatch]:
    """``load()``'s batches, once every rank loaded its own: a bad batch (``DataError``, e.g. a
    script's collator breaking its contract) found by one rank alone would leave the others
    waiting in the step's collectives, so the ranks first agree (one flag, all-reduced) and,
    when any failed, all raise the first failing rank's line (exit 2 on every rank)."""
    problem = ""
    batches: list[PackedBatch] = []
    try:
        batches = load()
    except DataError as err:
        text = str(err)
        if "Original Traceback" in text:  # raised in a DataLoader worker: its own last line
            text = text.strip().splitlines()[-1].split(": ", 1)[-1]
        problem = " ".join(text.split())
    if not dist.is_initialized():
        if problem:
            raise DataError(problem)
        return batches
    flag = torch.tensor([1 if problem else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        said: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(said, problem)
        rank = next(r for r, line in enumerate(said) if line)
        agreed = DataError(f"rank {rank}: {said[rank]}")
        agreed.on_every_rank = True  # every rank raises this same line; rank 0 reports it
        raise agreed
    return batches


# Megatron router's load-balancing type -> the name it records its loss under.
_MOE_AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                       "global_aux_loss": "global_load_balancing_loss"}


def _per_token(sums: torch.Tensor) -> list[float]:
    """Mean loss per token of each row of ``[depths, (loss sum, tokens)]``."""
    return [total / count if count else float("nan") for total, count in sums.tolist()]


def _as_list(value: str | Sequence[str]) -> list[str]:
    return list(value) if isinstance(value, (list, tuple)) else [str(value)]


def _chunks(items: list[_T], size: int) -> Iterator[list[_T]]:
    for start in range(0, len(items) - size + 1, size):
        yield items[start:start + size]


def wrap_ddp(chunks: list[MegatronModule], par: ParallelArguments, *,
             half_precision: bool = False) -> list[DistributedDataParallel]:
    """Megatron DDP around every chunk; bucketing only for the first (ROLL/McaTrainer: later
    chunks' communication already overlaps the first chunk's compute). Also used by
    ``hpc-mca smoke``."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    ddp = ddp_config(par)
    model_config = chunks[0].config
    # Gradients cross DP (and the embedding/PP groups) only through this hook; with per-token
    # loss it also divides them by the global real-token count.
    model_config.finalize_model_grads_func = finalize_model_grads
    if half_precision:
        from megatron.core.transformer.module import Float16Module

        # Casts the chunk to half precision and its inputs/outputs at the pipeline ends;
        # the optimizer keeps fp32 master weights.
        chunks = [Float16Module(model_config, chunk) for chunk in chunks]
    model = [DistributedDataParallel(model_config, ddp, chunk, disable_bucketing=i > 0)
             for i, chunk in enumerate(chunks)]
    if par.overlap_grad_reduce:
        model_config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    if par.overlap_param_gather:
        model_config.param_sync_func = ([m.start_param_sync for m in model] if len(model) > 1
                                        else model[0].start_param_sync)
    return model


def ddp_config(par: ParallelArguments) -> DistributedDataParallelConfig:
    """Megatron's DistributedDataParallelConfig of this run (also checked before the process
    group: hpc_mca.trainer.megatron_settings)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=par.overlap_grad_reduce,
        overlap_param_gather=par.overlap_param_gather,
        use_distributed_optimizer=par.use_distributed_optimizer, average_in_collective=False,
    )


def build_optimizer(model: list[DistributedDataParallel], opt_config: OptimizerConfig) -> MegatronOptimizer:
    """Megatron's optimizer (distributed when the config says so) over the DDP chunks."""
    from megatron.core.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(opt_config, model)
