"""``hpc-mca train`` with ``training.use_mca: false``: the standard backend on every rank.

Reached from :func:`hpc_mca.launch.run.run_training` after the checks both backends share
(config, data files, tokenizer, the checkpoint to resume from), so bad input stops every rank
before the process group here too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, cast

import torch
import torch.distributed as dist

from hpc_mca.checkpoint import compat
from hpc_mca.checkpoint.requeue import StopSignal
from hpc_mca.checkpoint.store import CheckpointInfo, ResumePoint, reopen_finished
from hpc_mca.config.run_length import total_training_steps
from hpc_mca.config.sections import TrainConfig
from hpc_mca.data.dataset import epoch_plan
from hpc_mca.loop.boundary import StepBoundary
from hpc_mca.loop.counters import RunCounters
from hpc_mca.loop.metrics import MetricsWriter, flops_per_token
from hpc_mca.loop.trackers import job_fields, open_trackers
from hpc_mca.rundir import STEPS_FILE, clear_bad_input
from hpc_mca.runtime.distributed import (
    RankContext,
    describe_process_group,
    init_distributed,
    rank_zero_first,
    shutdown,
)
from hpc_mca.runtime.env import RankEnv
from hpc_mca.runtime.sequence_parallel import new_sequence_parallel_groups
from hpc_mca.stages import get_stage, load
from hpc_mca.topology import Layout, ModelShape

from .data import StreamLoader
from .model import build_hf_model, build_optimizer, export_model
from .trainer import StandardTrainer, checkpoint_info

if TYPE_CHECKING:
    from transformers import PreTrainedModel, TrainerCallback, TrainingArguments

    from hpc_mca.data.sampler import EpochPlan
    from hpc_mca.data.training_data import TrainingData
    from hpc_mca.loop.records import StepResult

__all__ = ["StandardRun", "run_standard"]


@dataclass
class StandardRun:
    """What the standard backend's trainer needs to know about this run and rank."""

    config: TrainConfig
    ctx: RankContext
    data: TrainingData
    counters: RunCounters
    """Where the run stands: restored from the checkpoint (its checkpoint.json), advanced at
    every step end, saved in every checkpoint.json."""
    records: dict[str, Any]
    sp_group: dist.ProcessGroup | None = None
    train_stream: StreamLoader = field(init=False)
    """Set once the run is made (the stream starts at its data-parallel coordinates)."""
    exact_match: bool = False
    pad_token_id: int = 0

    @property
    def max_steps(self) -> int:
        """The run's length, held by its counters."""
        return self.counters.max_steps

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def world_size(self) -> int:
        return self.ctx.env.world_size

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def run_dir(self) -> Path:
        return Path(self.config.training.output_dir)

    @property
    def eval_steps(self) -> int | None:
        return self.config.training.eval_steps

    @property
    def sp_size(self) -> int:
        return self.config.parallel.sequence_parallel_size

    @property
    def sp_rank(self) -> int:
        return self.ctx.env.rank % self.sp_size

    @property
    def stream_coords(self) -> dict[str, int]:
        """Where this rank's streams come from: its data-parallel group and SP slice."""
        return {"data_parallel_rank": self.ctx.env.rank // self.sp_size, "sp_rank": self.sp_rank,
                "sp_size": self.sp_size, "pad_token_id": self.pad_token_id}

    @property
    def global_batch_size(self) -> int:
        """Rows per optimizer step (fewer on an epoch's last step: :attr:`epochs`)."""
        return self.config.derived.global_batch_size

    @property
    def epochs(self) -> EpochPlan:
        """How each epoch splits into steps, the last one partial (both backends alike)."""
        return epoch_plan(self.data.train, self.config.data_run())

    def checkpoint_info(self, reason: str) -> CheckpointInfo:
        return checkpoint_info(self.records, self.ctx.env, self.counters, reason)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run_standard(config: TrainConfig, env: RankEnv, shape: ModelShape,
                 callbacks: Iterable[TrainerCallback] = ()) -> list[StepResult]:
    """Train ``config`` on this rank with the standard backend; the per-step results
    (:class:`hpc_mca.trainer.trainer.StepResult`, the same on every rank)."""
    sp = config.parallel.sequence_parallel_size
    _export_torch_env(env)
    # Ulysses groups are consecutive ranks, as Megatron lays out context-parallel groups: the
    # rank context's data-parallel size and seeds are those of the standard backend's layout.
    ctx = init_distributed(Layout(cp=sp), model=shape, seed=config.training.seed, env=env,
                           global_batch_size=config.training.global_batch_size,
                           micro_batch_size=config.training.per_device_train_batch_size,
                           timeout_s=config.training.ddp_timeout)
    try:
        return _train(config, ctx, shape, callbacks)
    finally:
        shutdown()


def _export_torch_env(env: RankEnv) -> None:
    """torchrun's variables for this rank. transformers' Trainer (through accelerate) wraps the
    model in DDP only when it finds them; a rank started by srun has Slurm's variables alone,
    and would otherwise train on its own gradients."""
    os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size),
                      LOCAL_RANK=str(env.local_rank), LOCAL_WORLD_SIZE=str(env.local_world_size),
                      MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port))


def _train(config: TrainConfig, ctx: RankContext, shape: ModelShape,
           callbacks: Iterable[TrainerCallback]) -> list[StepResult]:
    run_dir = Path(config.training.output_dir)
    if ctx.is_main:
        config.save_resolved(run_dir)
        clear_bad_input(run_dir)
    data = rank_zero_first(lambda: _datasets(config, shape), ctx.is_main)
    if ctx.is_main:
        print(data.describe(), flush=True)
        print(f"backend: standard (transformers {_version()}), data parallel "
              f"{config.parallel.data_parallel_size}, Ulysses sequence parallel "
              f"{config.parallel.sequence_parallel_size}", flush=True)
        print(describe_process_group(), flush=True)
    tokenizer = data.tokenizer  # as data.template fixed it (eos, pad), like the Megatron backend's
    counters = RunCounters(max_steps=total_training_steps(config.training, len(data.train)))
    found = compat.resume_check(config, ctx.env.world_size, shape)
    if found:
        # checkpoint.json's, as one unit (transformers' Trainer reads its own step from its files)
        counters.load_state_dict(found.info.counters)
    run = StandardRun(config, ctx, data, counters, compat.records(config, ctx.env.world_size, shape),
                      sp_group=new_sequence_parallel_groups(config.parallel.sequence_parallel_size),
                      exact_match=get_stage(config.finetuning.stage).exact_match,
                      pad_token_id=tokenizer.pad_token_id or 0)
    run.train_stream = StreamLoader(data.train, config.data_run(),
                                    consumed_samples=counters.consumed_samples, **run.stream_coords)
    trainer = _trainer(run, shape, callbacks)
    if found and ctx.is_main:
        print(f"resumed from {found.path} at step {found.info.step} "
              f"({found.info.consumed_samples} samples)", flush=True)
    _begin(run, found)
    trainer.loop.begin(job_id=ctx.env.job_id, restart_count=ctx.env.restart_count)
    try:
        trainer.train(resume_from_checkpoint=str(found.path) if found else None)
        trainer.loop.finish()
    finally:
        trainer.loop.close()
    _finish(run, trainer)
    return trainer.loop.history


def _datasets(config: TrainConfig, shape: ModelShape) -> TrainingData:
    """The train/eval rows, with as many eval rows as one evaluation step needs (checked
    before step 1, as the Megatron backend does)."""
    from hpc_mca.data.dataset import build_datasets, check_eval_rows

    data = build_datasets(config.data, config.data_run(), vocab_size=shape.vocab_size)
    check_eval_rows(data.eval, config.data_run())
    return data


def _trainer(run: StandardRun, shape: ModelShape, callbacks: Iterable[TrainerCallback]) -> StandardTrainer:
    from transformers import PrinterCallback
    from transformers.utils import logging as hf_logging

    # save_pretrained draws a progress bar per checkpoint: run logs keep one line per save.
    hf_logging.disable_progress_bar()

    config, ctx = run.config, run.ctx
    tr = config.training
    model = build_hf_model(config, ctx.device)
    if config.parallel.recompute_granularity == "full":
        # Enabled here, not only by the Trainer when train() starts, so the log says it is on
        # (transformers' model reports it) before step 1. A transformers model, or peft's
        # wrapper, which hands what it lacks on to the transformers model inside it.
        hf_model = cast("PreTrainedModel", model)
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if ctx.is_main and hf_model.is_activation_checkpointing:
            print("activation recompute: every decoder layer (gradient checkpointing)", flush=True)
    optimizer, scheduler = build_optimizer(model, config, run.max_steps)
    args = _training_args(run)
    signal = StopSignal(run.run_dir, ctx.device, ctx.is_main)
    boundary = StepBoundary(tr.save_steps, signal, ctx.is_main)
    seq = config.derived.seq_length
    trackers = (open_trackers(tr.report_to, config.to_yaml(), run.run_dir, job_fields(ctx.env))
                if ctx.is_main else [])
    metrics = MetricsWriter(run.run_dir, ctx.is_main, trackers, run.max_steps,
                            flops_per_token(shape, seq), ctx.env.world_size)
    common = dict(model=model, args=args, optimizers=(optimizer, scheduler),
                  callbacks=list(callbacks), run=run, boundary=boundary, metrics=metrics)
    stage = get_stage(config.finetuning.stage)
    if stage.reference_model:
        from hpc_mca.models.converters import converter_for

        from .reference import frozen_reference

        if config.finetuning.ref_model:  # a config-only one: initialised as the policy is
            torch.manual_seed(config.training.seed)
        common["reference"] = frozen_reference(
            model, config.finetuning, converter_for(config.finetuning).reference_is_base)
    trainer = load(stage.standard)(**common)
    # The run log has hpc-mca's progress line; transformers' printer would repeat it as a dict.
    trainer.remove_callback(PrinterCallback)
    return trainer


def _training_args(run: StandardRun) -> TrainingArguments:
    """transformers' arguments for the loop it runs; logging, saving and evaluation are
    hpc-mca's (StandardTrainer's step end), so the Trainer's own strategies are off."""
    from transformers import TrainingArguments

    tr, ctx = run.config.training, run.ctx
    # accelerate (under TrainingArguments) resets a CPU process group's threads to cores per
    # local rank when OMP_NUM_THREADS is unset, with a warning: keep the count torch runs
    # with, as the Megatron backend does (the batch script and forkrun set the variable).
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    args = TrainingArguments(
        output_dir=str(run.run_dir), max_steps=run.max_steps,
        per_device_train_batch_size=tr.per_device_train_batch_size,
        gradient_accumulation_steps=run.config.derived.gradient_accumulation_steps,
        max_grad_norm=tr.max_grad_norm or 0.0, logging_steps=tr.logging_steps,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to=[],
        seed=tr.seed, ignore_data_skip=True, disable_tqdm=True, bf16=tr.bf16, fp16=tr.fp16,
        use_cpu=ctx.device.type == "cpu", ddp_backend=ctx.backend,
        ddp_find_unused_parameters=False, save_only_model=False,
        # Every decoder layer recomputed in backward (the rules allow full recompute of each
        # layer or none); non-reentrant, so frozen LoRA bases need no input gradients.
        # (transformers 5's names: the gradient_* aliases warn of their removal in v6.)
        activation_checkpointing=run.config.parallel.recompute_granularity == "full",
        activation_checkpointing_kwargs={"use_reentrant": False},
        ddp_timeout=tr.ddp_timeout)
    if ctx.env.world_size > 1 and args.world_size != ctx.env.world_size:
        raise RuntimeError(f"transformers sees world size {args.world_size}, the job "
                           f"{ctx.env.world_size}: gradients would not be synchronised")
    return args


def _begin(run: StandardRun, found: ResumePoint | None) -> None:
    """A resumed run's steps.jsonl loses the steps after its checkpoint (a fresh one is
    started afresh by the run loop); a finished run that goes on loses its finished marker
    (the batch script requeues it again when stopped early)."""
    if not run.is_main:
        return
    if found is not None:
        from hpc_mca.checkpoint.checkpointer import truncate_steps

        truncate_steps(run.run_dir / STEPS_FILE, found.info.step)
    reopened = reopen_finished(run.run_dir, found.info.step if found else 0, run.max_steps)
    if reopened:
        print(reopened, flush=True)


def _finish(run: StandardRun, trainer: StandardTrainer) -> None:
    """A run that reached max_steps is exported (when asked; rank 0 writes the HF files) and
    marked finished; one stopped by a signal is left for the batch script to requeue."""
    config, env = run.config, run.ctx.env

    def export(out: Path, merged: bool) -> None:
        if run.is_main:
            export_model(trainer.trained_model, out, config.finetuning, Path(config.model.model_name_or_path),
                         merged=merged)

    trainer.loop.finalize(finished=not run.counters.requeue and run.counters.at_end,
                          run_dir=run.run_dir, training=config.training, export=export,
                          steps_per_epoch=run.epochs.steps_per_epoch,
                          is_main=run.is_main, job_id=env.job_id, restart_count=env.restart_count)


def _version() -> str:
    import transformers

    return transformers.__version__
