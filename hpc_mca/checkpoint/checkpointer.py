"""Saving and resuming a training run: the Checkpointer a Trainer owns and calls.

    checkpointer = Checkpointer(config, ctx, run_dir, model_shape, loop=trainer, progress=...)
    checkpointer.resume()             # from the run's checkpoint, if any
    checkpointer.save(reason)         # at a step boundary the trainer chose
    checkpointer.finalize()           # the last save, async saves waited for
    checkpointer.export(out, merged)  # every rank: the HF export a finished run asks for

The loop is seen through :class:`~.state.Resumable` only (model chunks, optimizer and the
loop's ``state_dict``/``load_state_dict``): the checkpointer decides nothing about when to save
or stop, and writes no attribute of the loop.

Saves go through ``megatron.core.dist_checkpointing`` with the torch_dist backend and the
fully-parallel save wrapper over the data-parallel group (every DP replica writes a share of
the replicated tensors); loads use the fully-parallel load wrapper on GPUs (see ``_load``)
and read each tensor straight into its destination (:mod:`.reader`).
The commit protocol (see :mod:`.commit`) makes a save durable only when every rank finished:
ranks write into ``iter_N.tmp``; an all-reduce proves every rank got past its (fsync'ed)
writes; rank 0 then writes checkpoint.json, renames the directory to ``iter_N``, replaces the
``latest`` tracker atomically and prunes to the newest ``save_total_limit``. With
``async_save`` the shards are written by a background process and that same commit runs as the
save's last finalize step (at a later step boundary, or at once when the run stops), so the
tracker is gated exactly as for a synchronous save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from hpc_mca.config.sections import TrainConfig
from hpc_mca.rundir import STEPS_FILE, write_atomic
from hpc_mca.runtime.host_memory import pinned_host_seconds

from . import compat
from .commit import publish, tmp_dir
from .helper import keep_write_results_in_process, start_writer_helper, warm_writer_helper
from .reader import direct_reads
from .space import (
    MARGIN,
    CheckpointSpaceError,
    is_out_of_space,
    last_good,
    make_room,
    space_message,
    tree_bytes,
)
from .state import (
    Resumable,
    build_state,
    load_model,
    load_optimizer,
    loop_state,
    model_state,
    sharded_metadata,
    unwrap,
)
from .store import (
    CheckpointError,
    CheckpointInfo,
    checkpoints_dir,
    iter_name,
    reopen_finished,
)

if TYPE_CHECKING:
    from hpc_mca.runtime.distributed import RankContext
    from hpc_mca.topology import ModelShape


class Checkpointer:
    """Save/resume for one rank of one run; every method is called on every rank.

    ``loop``: what is saved and resumed; ``progress``: the run's progress.json writer (fields
    merged in), where the last durable checkpoint and the finished state are shown.
    """

    def __init__(self, config: TrainConfig, ctx: RankContext, run_dir: Path, model_shape: ModelShape, *,
                 loop: Resumable, progress: Callable[..., None]) -> None:
        tr = config.training
        self.config, self.ctx, self.run_dir = config, ctx, Path(run_dir)
        self.model_shape, self.loop, self._write_progress = model_shape, loop, progress
        self.root = checkpoints_dir(run_dir)
        self.keep, self.async_save = tr.save_total_limit, tr.async_save
        self.records = compat.records(config, ctx.env.world_size, model_shape)
        self.optimizer_format = self.records["training"]["optimizer_format"]
        self.last_saved_step: int | None = None
        self.last_durable: dict[str, Any] | None = None
        self.stop_time: float | None = None
        """When a stop was requested (given to :meth:`save`), for the signal-to-durable line
        of the save that commits after it."""
        self._warm: threading.Thread | None = None
        self._save_strategy: Any = None
        self._async_queue: Any = None

    # ---- resume -------------------------------------------------------------------------------

    def resume(self) -> CheckpointInfo | None:
        """Set up where the writer's results go (see :mod:`.helper`: in this process, or the
        async writer's helper, started and warmed now), then load the checkpoint
        ``training.resume_from_checkpoint`` selects into the loop (model, optimizer, the run's
        counters as one unit, and its state dict: LR scheduler, RNG); None for a fresh start."""
        if self.async_save:
            start_writer_helper()
            self._warm = threading.Thread(target=warm_writer_helper, daemon=True)
            self._warm.start()
        else:
            keep_write_results_in_process()
        found = compat.resume_check(self.config, self.ctx.env.world_size, self.model_shape)
        if found is None:
            return None
        path, info = found
        with_rng = compat.same_layout(info, self.records["layout"])
        # Read the optimizer state in the format it was written in (a run may change
        # save_optimizer_format, or an older checkpoint predate a new default).
        saved_format = info.training.get("optimizer_format", self.optimizer_format)
        started = time.perf_counter()
        loaded = self._load(path, with_rng, saved_format)
        model = self.loop.model
        for i, chunk in enumerate(model):
            key = "model" if len(model) == 1 else f"model{i}"
            # A chunk with nothing to train (freeze: a virtual pipeline chunk of frozen layers
            # on a rank that trains others) saved an empty state, which comes back absent.
            load_model(unwrap(chunk), loaded.get(key, {}))
        load_optimizer(self.loop.optimizer, loaded["optimizer"],
                       model_state(model, sharded_metadata(saved_format)))
        self.loop.counters.load_state_dict(loaded["trainer"])
        self.loop.load_state_dict(loop_state(loaded, with_rng))
        self.last_saved_step = info.step
        self._after_resume(info, path, with_rng, time.perf_counter() - started)
        return info

    def _load(self, path: Path, with_rng: bool, optimizer_format: str) -> dict[str, Any]:
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_load_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
        )

        template = build_state(self.loop, loading=True, with_rng=with_rng, config=None,
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
        with direct_reads():
            return dist_checkpointing.load(template, str(path), strategy)

    def _after_resume(self, info: CheckpointInfo, path: Path, with_rng: bool, seconds: float) -> None:
        if self.ctx.is_main:
            truncate_steps(self.run_dir / STEPS_FILE, info.step)
            changes = compat.describe_changes(info, self.records["layout"])
            batch = compat.describe_batch_changes(info, self.records["training"])
            print(f"resumed from {path} at step {info.step} ({info.consumed_samples} samples) "
                  f"in {seconds:.2f} s" + (f"; layout changed: {changes}" if changes else "")
                  + (f"; {batch}" if batch else "")
                  + ("" if with_rng else "; per-rank RNG states not restored (layout changed)"),
                  flush=True)
            self.last_durable = {"step": info.step, "path": str(path), "time": info.saved_at}
            self._progress(last_checkpoint=self.last_durable)
        dist.barrier()

    # ---- save ---------------------------------------------------------------------------------

    def save(self, reason: str, *, stop_time: float | None = None) -> None:
        """Checkpoint the loop at its current step, once per step (a second call at the same
        step does nothing). ``reason``: why (interval, end, signal, callback), recorded in
        checkpoint.json; ``stop_time``: when the stop this save serves was requested."""
        counters = self.loop.counters.state_dict()
        step = counters["global_step"]
        if step == self.last_saved_step:
            return
        self.stop_time = stop_time if stop_time is not None else self.stop_time
        self.wait()  # one save in flight at a time: the previous one commits first
        from megatron.core import dist_checkpointing

        name = iter_name(step)
        tmp = tmp_dir(self.root, name)
        started = time.perf_counter()
        if self._warm is not None:
            self._warm.join()
        self._prepare(name, tmp)
        state = build_state(self.loop, loading=False, with_rng=True, config=self.config.to_dict(),
                            optimizer_format=self.optimizer_format,
                            model_only=self.records["training"]["save_only_model"])
        info = self._info(counters, reason)
        built = time.perf_counter()
        # async: Megatron's own background writer ("nvrx" needs nvidia-resiliency-ext).
        extra = {"async_sharded_save": True, "async_strategy": "mcore"} if self.async_save else {}
        if not self.async_save:
            state = _unclonable(state)
        pinned = pinned_host_seconds()
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
                _note_pinned_host(phases, pinned)
                commit()
            else:
                request.finalize_fns.append(commit)
                self._queue().schedule_async_request(request)  # stages to the host here
                _note_pinned_host(phases, pinned)
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
        collective: the ranks stop together; rank 0 reports the line)."""
        verdict = [reason]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            err = CheckpointSpaceError(verdict[0])
            err.on_every_rank = True
            raise err from None

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
        tmp, final = tmp_dir(self.root, name), self.root / name
        if not (tmp / ".metadata").is_file():
            raise CheckpointError(f"checkpoint {name}: {tmp}/.metadata is missing; not committed")
        if not publish(self.root, name, info, self.keep):
            return
        self.last_durable = {"step": info.step, "path": str(final), "time": time.time()}
        self._progress(last_checkpoint=self.last_durable)
        since = "" if self.stop_time is None else \
            f", durable {time.time() - self.stop_time:.2f} s after the stop request"
        where = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
        if self.async_save:
            where = f"{where}, then written in the background"
        print(f"checkpoint {final} saved ({info.reason}) in {seconds:.2f} s ({where}){since}",
              flush=True)

    def _info(self, counters: Mapping[str, int], reason: str) -> CheckpointInfo:
        import megatron.core

        env = self.ctx.env
        return CheckpointInfo.of_save(counters, self.records, reason=reason, job_id=env.job_id,
                                      restart_count=env.restart_count,
                                      megatron_core=getattr(megatron.core, "__version__", ""))

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

    def finalize(self) -> None:
        """At the end of the loop: save the last step (if not saved yet) and wait for async
        saves. Exporting and marking a finished run are the run loop's
        (:meth:`hpc_mca.loop.driver.RunLoop.finalize`, which calls :meth:`export`)."""
        self.save("end")  # a no-op when the loop already saved this step (it always does on a stop)
        self.wait()
        if self._warm is not None:
            self._warm.join()  # never leave it running into interpreter shutdown
        if self._async_queue is not None:
            self._async_queue.close()
            self._async_queue = None

    def export(self, out: Path, merged: bool) -> None:
        """What the finetuning type exports (:mod:`hpc_mca.models.converters`): the HF model
        (full runs), the PEFT adapter (LoRA), or with ``merged`` the base model with the
        adapters merged in. A collective: every rank sends its shards."""
        from hpc_mca.models.converters import converter_for

        started = time.perf_counter()
        chunks = [unwrap(chunk) for chunk in self.loop.model]
        what = converter_for(self.config.finetuning).export_chunks(
            chunks, out, model_path=self.config.model.model_name_or_path, merged=merged)
        if self.ctx.is_main:
            print(f"exported {what} to {out} in {time.perf_counter() - started:.1f} s", flush=True)
            if self.config.model.mtp_num_layers:
                from hpc_mca.models.export import mtp_export_note
                from hpc_mca.models.hf_config import read_hf_config

                print(mtp_export_note(read_hf_config(self.config.model.model_name_or_path),
                                      self.config.model.mtp_num_layers), flush=True)

    def begin(self, step: int, max_steps: int) -> None:
        """Before training from ``step`` to ``max_steps``: a run directory whose run had
        finished goes on (an extension to a larger max_steps, or a fresh start), so its
        ``finished`` marker goes, and the batch script requeues the run again when it is
        stopped early."""
        if self.ctx.is_main:
            reopened = reopen_finished(self.run_dir, step, max_steps)
            if reopened:
                print(reopened, flush=True)

    def _progress(self, **fields: object) -> None:
        env = self.ctx.env
        self._write_progress(job_id=env.job_id, restart_count=env.restart_count, **fields)


def _note_pinned_host(phases: dict[str, float], before: float | None) -> None:
    """Add the save's pinned-block creation to its phases, where there was any."""
    after = pinned_host_seconds()
    if before is not None and after is not None and after - before >= 0.01:
        phases["of which new pinned host memory"] = after - before


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


def _unclonable(state: dict) -> dict:
    """Synchronous saves: give every CPU shard that is a contiguous view into a larger buffer
    (the distributed optimizer's main weights and moments, parameters in DDP's buffers) a
    storage of exactly its own bytes, sharing the memory.

    torch.save writes a tensor's whole storage, so Megatron's writer clones every CPU view
    whose storage is larger than the view (``prepare_write_data``): a second copy of most of a
    rank's share of the checkpoint (152 of 202 MB in ``benchmarks/checkpoint_io.py``'s model).
    A synchronous save does not change the tensors before they are written, so the bytes can
    be written from where they are. On the 2-core VM the
    write phase of a 405 MB model_space save (2 ranks) went from a median 0.50 s to 0.43 s
    (8 saves per run, 3 runs each, alternating). Async saves keep the clone (training goes on
    while they write); GPU tensors never took this path (the writer copies them to the host)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    def alias(item: object) -> object:
        if isinstance(item, ShardedTensor) and _cloned_by_the_writer(item.data):
            return dataclasses.replace(item, data=_exact_storage(item.data))
        return item

    # Factories (e.g. SwiGLU's fc1 split into gate and up) build their ShardedTensors as views
    # inside save(); built here, their views get the alias too (save() finds none left).
    apply_factories(state)
    return dict_list_map_inplace(alias, state)


def _cloned_by_the_writer(data: torch.Tensor | None) -> bool:
    """A plain contiguous CPU tensor that views part of a larger storage."""
    return (data is not None and type(data) in (torch.Tensor, torch.nn.Parameter)
            and data.device.type == "cpu" and data.is_contiguous() and data.numel() > 0
            and data.untyped_storage().nbytes() != data.numel() * data.element_size())


def _exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory as a tensor whose storage is exactly its bytes. The bytes go
    through numpy (as uint8: numpy has no bfloat16), whose array keeps ``tensor`` alive: some
    shards are temporaries (fully_reshardable gathers the optimizer state over DP) that only
    the state dict references."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return torch.from_numpy(flat.numpy()).view(tensor.dtype).view(tensor.shape)


def truncate_steps(path: Path, step: int) -> None:
    """Drop steps.jsonl lines after ``step``: they are about to be trained again (the run
    died after them but before their checkpoint), and the log must read as one run."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    write_atomic(path, "".join(line + "\n" for line in kept), durable=True)

