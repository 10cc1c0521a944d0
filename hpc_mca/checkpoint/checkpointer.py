"""Saving and resuming a training run: the Checkpointer a Trainer is given.

    checkpointer = Checkpointer(config, ctx, run_dir, model_shape)
    checkpointer.attach(trainer)      # trainer.on_save = checkpointer.save; resume if possible
    trainer.train()
    checkpointer.finish(trainer, stopped=...)

Saves go through ``megatron.core.dist_checkpointing`` with the torch_dist backend and the
fully-parallel save wrapper over the data-parallel group (every DP replica writes a share of
the replicated tensors); loads use the fully-parallel load wrapper on GPUs (see ``_load``).
The commit protocol (see :mod:`.store`) makes a save durable only when every rank finished:
ranks write into ``iter_N.tmp``; an all-reduce proves every rank got past its (fsync'ed)
writes; rank 0 then writes checkpoint.json, renames the directory to ``iter_N``, replaces the
``latest`` tracker atomically and prunes to the newest ``save_total_limit``. With
``async_save`` the shards are written by a background process and that same commit runs as the
save's last finalize step (at a later step boundary, or at once when the run stops), so the
tracker is gated exactly as for a synchronous save.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_mca.rundir import fsync_dir, write_atomic

from . import compat
from .helper import start_writer_helper, warm_writer_helper
from .space import (
    MARGIN,
    CheckpointSpaceError,
    is_out_of_space,
    last_good,
    make_room,
    space_message,
    tree_bytes,
)
from .state import build_state, load_optimizer, model_state, restore_rng, sharded_metadata, unwrap
from .store import (
    INFO_FILE,
    CheckpointError,
    CheckpointInfo,
    checkpoints_dir,
    clear_finished,
    finished_step,
    iter_name,
    mark_finished,
    prune,
    read_tracker,
    write_tracker,
)


class Checkpointer:
    """Save/resume for one rank of one run; every method is called on every rank."""

    def __init__(self, config: Any, ctx: Any, run_dir: Path, model_shape: Any) -> None:
        tr = config.training
        self.config, self.ctx, self.run_dir = config, ctx, Path(run_dir)
        self.model_shape = model_shape
        self.root = checkpoints_dir(run_dir)
        self.keep, self.async_save = tr.save_total_limit, tr.async_save
        self.records = compat.records(config, ctx.env.world_size, model_shape)
        self.optimizer_format = self.records["training"]["optimizer_format"]
        self.last_saved_step: int | None = None
        self.last_durable: dict[str, Any] | None = None
        self.stop_time: float | None = None
        """When the stop was requested (the batch shell's record of the signal, else when the
        ranks agreed; set by the StopRequest callback), for the signal-to-durable line."""
        self.stop_reason: str | None = None
        self._warm: threading.Thread | None = None
        self._save_strategy: Any = None
        self._async_queue: Any = None
        self._metrics: Any = None

    # ---- wiring -------------------------------------------------------------------------------

    def attach(self, trainer: Any) -> CheckpointInfo | None:
        """Become ``trainer``'s save hook and resume it from the run's checkpoint, if any."""
        trainer.on_save = self.save
        self._metrics = trainer.metrics
        start_writer_helper()
        self._warm = threading.Thread(target=warm_writer_helper, daemon=True)
        self._warm.start()
        return self.resume(trainer)

    # ---- resume -------------------------------------------------------------------------------

    def resume(self, trainer: Any) -> CheckpointInfo | None:
        """Load the checkpoint ``training.resume_from_checkpoint`` selects into ``trainer``
        (model, optimizer, LR scheduler, step, samples, RNG); None for a fresh start."""
        found = compat.resume_check(self.config, self.ctx.env.world_size, self.model_shape)
        if found is None:
            return None
        path, info = found
        with_rng = compat.same_layout(info, self.records["layout"])
        # Read the optimizer state in the format it was written in (a run may change
        # save_optimizer_format, or an older checkpoint predate a new default).
        saved_format = info.training.get("optimizer_format", self.optimizer_format)
        started = time.perf_counter()
        loaded = self._load(trainer, path, with_rng, saved_format)
        for i, chunk in enumerate(trainer.model):
            key = "model" if len(trainer.model) == 1 else f"model{i}"
            unwrap(chunk).load_state_dict(loaded[key], strict=True)
        load_optimizer(trainer.optimizer, loaded["optimizer"],
                       model_state(trainer.model, sharded_metadata(saved_format)))
        trainer.lr_scheduler.load_state_dict(loaded["lr_scheduler"])
        saved = loaded["trainer"]
        trainer.state.global_step = saved["global_step"]
        trainer.consumed_samples = saved["consumed_samples"]
        trainer.skipped_iters = saved["skipped_iters"]
        if with_rng:
            restore_rng(loaded["rng_state"])
        self.last_saved_step = info.step
        self._after_resume(info, path, with_rng, time.perf_counter() - started,
                           getattr(trainer.lr_scheduler, "rederived", {}))
        return info

    def _load(self, trainer: Any, path: Path, with_rng: bool, optimizer_format: str) -> dict[str, Any]:
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_load_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
        )

        template = build_state(trainer, loading=True, with_rng=with_rng, config=None,
                               optimizer_format=optimizer_format)
        strategy = get_default_load_sharded_strategy(str(path))
        if self.ctx.device.type == "cuda":
            # Each DP rank reads a share of the DP-replicated tensors (the model weights) and
            # they swap the rest over NCCL: cheaper than all of them reading everything from a
            # shared file system. Over gloo the swap is the slower part (0.34 s to broadcast
            # 100 MB of weights between 2 CPU ranks, 3x the time to read it), so there every
            # rank reads what it needs itself.
            strategy = FullyParallelLoadStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
        return dist_checkpointing.load(template, str(path), strategy)

    def _after_resume(self, info: CheckpointInfo, path: Path, with_rng: bool, seconds: float,
                      rederived: dict[str, tuple[Any, Any]]) -> None:
        if self.ctx.is_main:
            _truncate_steps(self.run_dir / "steps.jsonl", info.step)
            changes = compat.describe_changes(info, self.records["layout"])
            batch = compat.describe_batch_changes(info, self.records["training"])
            schedule = ", ".join(f"{k} {old}->{new}" for k, (old, new) in rederived.items())
            print(f"resumed from {path} at step {info.step} ({info.consumed_samples} samples) "
                  f"in {seconds:.2f} s" + (f"; layout changed: {changes}" if changes else "")
                  + (f"; {batch}" if batch else "")
                  + ("" if with_rng else "; per-rank RNG states not restored (layout changed)")
                  + (f"; LR schedule re-derived for this config: {schedule}" if schedule else ""),
                  flush=True)
            self.last_durable = {"step": info.step, "path": str(path), "time": info.saved_at}
            self._progress(last_checkpoint=self.last_durable)
        dist.barrier()

    # ---- save ---------------------------------------------------------------------------------

    def save(self, trainer: Any, reason: str | None = None) -> None:
        """Checkpoint ``trainer`` at its current step (once per step; the Trainer's on_save)."""
        step = trainer.state.global_step
        reason = reason or self.stop_reason or ("end" if step >= trainer.max_steps else "interval")
        if step == self.last_saved_step:
            return
        self.wait()  # one save in flight at a time: the previous one commits first
        from megatron.core import dist_checkpointing

        name = iter_name(step)
        tmp = self.root / f"{name}.tmp"
        started = time.perf_counter()
        if self._warm is not None:
            self._warm.join()
        self._prepare(name, tmp)
        state = build_state(trainer, loading=False, with_rng=True, config=self.config.to_dict(),
                            optimizer_format=self.optimizer_format)
        info = self._info(trainer, reason)
        built = time.perf_counter()
        # async: Megatron's own background writer ("nvrx" needs nvidia-resiliency-ext).
        extra = {"async_sharded_save": True, "async_strategy": "mcore"} if self.async_save else {}
        with _without_crc32():  # the async writer is forked inside: it inherits the setting
            try:
                request = dist_checkpointing.save(state, str(tmp), self._strategy(), **extra)
            except BaseException as err:  # torch's CheckpointException is a BaseException
                if not isinstance(err, (KeyboardInterrupt, SystemExit)):
                    self._after_failed_save(name, tmp, err)
                raise
            phases = {"state dict": built - started,
                      "write" if request is None else "hand-off": time.perf_counter() - built}
            commit = functools.partial(self._commit, name, info, started, phases)
            if request is None:
                commit()
            else:
                request.finalize_fns.append(commit)
                self._queue().schedule_async_request(request)
        self.last_saved_step = step

    def _prepare(self, name: str, tmp: Path) -> None:
        """Rank 0 makes ``tmp`` (after what a killed save of this step left) and room for the
        checkpoint (see :mod:`.space`); every rank learns the verdict."""
        reason = None
        if self.ctx.is_main:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                reason, pruned = make_room(self.root, self.keep, name)
            except OSError as err:
                if not is_out_of_space(err):
                    raise
                reason, pruned = self._no_room(name, None), []
            if pruned:
                print(f"made room for {name}: removed {', '.join(p.name for p in pruned)} "
                      f"(save_total_limit={self.keep} drops them once {name} is saved)", flush=True)
            if reason:
                shutil.rmtree(tmp, ignore_errors=True)
        self._stop_unless_room(reason)

    def _after_failed_save(self, name: str, tmp: Path, err: BaseException) -> None:
        """A save failed on every rank (torch's checkpoint writer gathers the failures). When
        the disk filled up, drop the partial directory and raise CheckpointSpaceError on every
        rank (rank 0 decides); otherwise return (the caller re-raises).

        Full means: an ENOSPC/quota error in the chain, or, because Megatron's writer reports
        a failed worker by its exception class alone, less free space than the failed save
        had already written (at least 16 MiB)."""
        reason = None
        if self.ctx.is_main:
            free = shutil.disk_usage(self.root).free
            if is_out_of_space(err) or free < max(16 << 20, tree_bytes(tmp)):
                shutil.rmtree(tmp, ignore_errors=True)
                good = last_good(self.root)
                reason = self._no_room(name, int(tree_bytes(good) * MARGIN) if good else None)
        self._stop_unless_room(reason)

    def _no_room(self, name: str, needed: int | None) -> str:
        return space_message(name, self.root, needed, shutil.disk_usage(self.root).free,
                             last_good(self.root))

    def _stop_unless_room(self, reason: str | None) -> None:
        """Every rank raises CheckpointSpaceError with rank 0's ``reason``, if it has one (a
        collective: the ranks stop together, each with the one line)."""
        verdict = [reason]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            raise CheckpointSpaceError(verdict[0]) from None

    def poll(self) -> None:
        """Commit a finished async save, if any (call at step boundaries, on every rank)."""
        if self._async_queue is not None:
            self._async_queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Block until an async save in flight is written and committed."""
        if self._async_queue is not None:
            self._async_queue.maybe_finalize_async_calls(blocking=True)

    def _commit(self, name: str, info: CheckpointInfo, started: float,
                phases: dict[str, float]) -> None:
        """Every rank arrives here after its shards are written and fsync'ed; the all-reduce
        proves all did before rank 0 publishes the checkpoint."""
        arrived = torch.ones(1, dtype=torch.int32, device=self.ctx.device)
        dist.all_reduce(arrived)
        if int(arrived.item()) != dist.get_world_size():
            raise CheckpointError(f"checkpoint {name}: only {int(arrived.item())} of "
                                  f"{dist.get_world_size()} ranks finished; not committed")
        if self.ctx.is_main:
            self._publish(name, info, time.perf_counter() - started, phases)
        dist.barrier()  # nobody moves on (or exits for a requeue) before the tracker is durable

    def _publish(self, name: str, info: CheckpointInfo, seconds: float,
                 phases: dict[str, float]) -> None:
        tmp, final = self.root / f"{name}.tmp", self.root / name
        if not (tmp / ".metadata").is_file():
            raise CheckpointError(f"checkpoint {name}: {tmp}/.metadata is missing; not committed")
        write_atomic(tmp / INFO_FILE, info.to_json(), durable=True)
        if final.exists():
            # A complete copy of this step from an earlier, interrupted run. The tracker cannot
            # name it (a resumed run never saves its starting step again), so replace it.
            if read_tracker(self.root) == name:
                shutil.rmtree(tmp)
                return
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.root)
        write_tracker(self.root, name)
        prune(self.root, self.keep)
        self.last_durable = {"step": info.step, "path": str(final), "time": time.time()}
        self._progress(last_checkpoint=self.last_durable)
        since = "" if self.stop_time is None else \
            f", durable {time.time() - self.stop_time:.2f} s after the stop request"
        where = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
        if self.async_save:
            where = f"{where}, then written in the background"
        print(f"checkpoint {final} saved ({info.reason}) in {seconds:.2f} s ({where}){since}",
              flush=True)

    def _info(self, trainer: Any, reason: str) -> CheckpointInfo:
        import megatron.core

        env = self.ctx.env
        return CheckpointInfo(
            step=trainer.state.global_step, consumed_samples=trainer.consumed_samples,
            skipped_iters=trainer.skipped_iters, saved_at=time.time(), job_id=env.job_id,
            restart_count=env.restart_count, reason=reason,
            megatron_core=getattr(megatron.core, "__version__", ""), **self.records)

    def _strategy(self) -> Any:
        if self._save_strategy is None:
            from megatron.core import parallel_state
            from megatron.core.dist_checkpointing.serialization import (
                get_default_save_sharded_strategy,
            )
            from megatron.core.dist_checkpointing.strategies.fully_parallel import (
                FullyParallelSaveStrategyWrapper,
            )

            # The state dict has the same structure at every save: cache the distribution of
            # replicated shards over the DP ranks instead of recomputing it.
            self._save_strategy = FullyParallelSaveStrategyWrapper(
                get_default_save_sharded_strategy("torch_dist"),
                parallel_state.get_data_parallel_group(with_context_parallel=True),
                do_cache_distribution=True)
        return self._save_strategy

    def _queue(self) -> Any:
        if self._async_queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import (
                AsyncCallsQueue,
            )

            self._async_queue = AsyncCallsQueue()
        return self._async_queue

    # ---- the end ------------------------------------------------------------------------------

    def finish(self, trainer: Any, *, stopped: bool) -> None:
        """After ``train()``: save the last step, wait for async saves, and — unless the run
        stopped early on request — mark it finished (the job then never requeues) and export
        the model to HF when configured."""
        self.save(trainer, None if stopped else "end")
        self.wait()
        if self._warm is not None:
            self._warm.join()  # never leave it running into interpreter shutdown
        if self._async_queue is not None:
            self._async_queue.close()
            self._async_queue = None
        if stopped:
            return
        export = self.config.training.export_hf_dir
        if export:
            self._export(trainer, Path(export) if os.path.isabs(export) else self.run_dir / export)
        if self.ctx.is_main:
            gbs = self.config.training.global_batch_size
            mark_finished(self.run_dir, trainer.state.global_step,
                          steps_per_epoch=len(trainer.data.train) // gbs)
            self._progress(finished=True)
        dist.barrier()

    def _export(self, trainer: Any, out: Path) -> None:
        from hpc_mca.models.export import save_hf_checkpoint

        started = time.perf_counter()
        save_hf_checkpoint([unwrap(chunk) for chunk in trainer.model], out,
                           self.config.model.model_name_or_path)
        if self.ctx.is_main:
            print(f"exported HF model to {out} in {time.perf_counter() - started:.1f} s", flush=True)

    def begin(self, trainer: Any) -> None:
        """Before training: a run directory whose run had finished goes on (an extension to
        a larger max_steps, or a fresh start), so its ``finished`` marker goes, and the batch
        script requeues the run again when it is stopped early."""
        done = finished_step(self.run_dir)
        if done is None or not self.ctx.is_main:
            return
        clear_finished(self.run_dir)
        step = trainer.state.global_step
        what = (f"extending the run that finished at step {done} to {trainer.max_steps} steps"
                if step else f"starting afresh in a run directory whose run finished at step "
                             f"{done}")
        print(what, flush=True)

    def _progress(self, **fields: Any) -> None:
        env = self.ctx.env
        if self._metrics is not None:
            self._metrics.write_progress(job_id=env.job_id, restart_count=env.restart_count,
                                         **fields)


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    """torch.save (which torch_dist uses for every shard) computes a CRC32 of each record by
    default: ~0.12 s per 200 MB written on this machine, a third of the write. torch.load does
    not need it (torch.serialization.set_crc32_options), and a checkpoint is trusted because
    the commit protocol published it only after every rank's fsync, not by checksums."""
    from torch.serialization import get_crc32_options, set_crc32_options

    previous = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(previous)


def _truncate_steps(path: Path, step: int) -> None:
    """Drop steps.jsonl lines after ``step``: they are about to be trained again (the run
    died after them but before their checkpoint), and the log must read as one run."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    write_atomic(path, "".join(line + "\n" for line in kept), durable=True)

