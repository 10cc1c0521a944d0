"""``hpc-mca plan --dry-run``: what one rank of a planned job really holds, without its GPUs.

One process plays rank R of the planned world: torch's fake process group (every collective
returns at once, no peers, no network) under the trainer's own :func:`init_distributed` (so a
layout the trainer refuses is refused here with its error), Megatron's parallel state of the
planned TP/PP/VP/CP/EP/ETP, then the trainer's builders: :func:`build_model` and the
finetuning type's converter (LoRA, freeze), a dpo/kto run's frozen reference
(:func:`reference_chunks`), :func:`wrap_ddp` and :func:`build_optimizer`.
Every tensor is created on the meta device (shapes and dtypes, no storage), so a 405B
layout's rank is built in seconds in a few hundred MiB. The bytes are then read from what
Megatron built: the DDP's parameter and gradient buffers (their padded sizes), the
parameters outside them (frozen ones, or all without the distributed optimizer), the
optimizer's fp32 master copies and, for Adam's two moments, the parameters its torch
optimizer steps (torch creates the moments lazily, one of each per stepped element).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from hpc_mca.config.sections import FinetuningArguments, ParallelArguments, TrainingArguments
from hpc_mca.loop.optimizer import optimizer_config
from hpc_mca.runtime.distributed import init_distributed, shutdown
from hpc_mca.runtime.env import RankEnv
from hpc_mca.topology import Layout, ModelShape
from hpc_mca.trainer.reference import reference_chunks
from hpc_mca.trainer.trainer import build_optimizer, wrap_ddp

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

__all__ = ["RankBytes", "default_ranks", "dry_run"]

_META = torch.device("meta")


@dataclasses.dataclass(frozen=True)
class RankBytes:
    """Bytes one rank holds, by term and dtype (``"bfloat16"``, ``"float32"``, ...)."""

    rank: int
    pipeline_rank: int
    params: dict[str, int]
    """Weights: the DDP's parameter buffers (padded), the parameters outside them and a dpo/kto
    run's frozen reference copy (outside DDP and the optimizer, as the trainer keeps it)."""
    grads: dict[str, int]
    """The DDP's gradient buffers (main_grad), padded as Megatron pads its buckets."""
    master: dict[str, int]
    """The optimizer's fp32 master copies of half-precision weights (this rank's shard)."""
    moments: dict[str, int]
    """Adam's exp_avg and exp_avg_sq: two per element the optimizer steps."""
    seconds: float
    """How long the dry run of this rank took (process-group setup to the last count)."""

    @property
    def optimizer(self) -> int:
        return sum(self.master.values()) + sum(self.moments.values())

    @property
    def static(self) -> int:
        """Parameters, gradients and optimizer state: everything but activations."""
        return sum(self.params.values()) + sum(self.grads.values()) + self.optimizer


def default_ranks(layout: Layout, world_size: int) -> list[int]:
    """The ranks that can peak: the first pipeline stage's first rank (embedding, most
    micro-batches in flight; an expert rank in an MoE model, as every rank is) and the last
    stage's last rank (output layer, MTP). Megatron orders ranks tp-cp-ep-dp-pp: the pipeline
    stage is the outermost index."""
    return sorted({0, world_size - 1})


def dry_run(source: str | Path | Mapping[str, Any], layout: Layout, world_size: int, rank: int, *,
            training: TrainingArguments, parallel: ParallelArguments,
            finetuning: FinetuningArguments | None = None, seq_length: int | None = None,
            model_overrides: Mapping[str, Any] | None = None,
            global_batch_size: int | None = None) -> RankBytes:
    """Build rank ``rank`` of a ``world_size``-rank job in ``layout`` on the meta device and
    count its bytes. ``source``: an HF model directory, config.json or config dict (no
    weights are read). Raises the trainer's LayoutError / ModelLoadError (one line) for a
    layout or model it would refuse."""
    from hpc_mca.models.build import build_model
    from hpc_mca.models.converters import converter_for

    start = time.monotonic()
    env = RankEnv(rank=rank, world_size=world_size, local_rank=0, local_world_size=1,
                  master_addr="localhost", master_port=0, launcher="single")
    shape = ModelShape.from_hf_config(source)
    with _fake_world(rank, world_size):
        ctx = init_distributed(layout, model=shape, env=env, global_batch_size=global_batch_size,
                               micro_batch_size=training.per_device_train_batch_size
                               if global_batch_size else None)
        ctx = dataclasses.replace(ctx, device=_META)
        half = training.bf16 or training.fp16
        dtype = torch.bfloat16 if training.bf16 else torch.float16 if training.fp16 else torch.float32
        overrides = {"bf16": training.bf16, "fp16": training.fp16,
                     "sequence_parallel": parallel.sequence_parallel and layout.tp > 1,
                     **(model_overrides or {})}
        model_source = source

        def build(source: Path | None = None, load_weights: bool | None = None
                  ) -> list[torch.nn.Module]:  # the trainer's ChunkBuilder: no weights read
            return build_model(model_source if source is None else source, ctx,
                               seq_length=seq_length, load_weights=False, dtype=dtype,
                               config_overrides=overrides)

        with _MetaFactories():
            chunks = build()
            reference: list[torch.nn.Module] = []
            if finetuning is not None:
                path = str(source) if not isinstance(source, Mapping) else ""
                converter = converter_for(finetuning)
                chunks = converter.convert_chunks(chunks, model_path=path, seed=training.seed)
                # dpo/kto: the frozen reference as the trainer attaches it (before DDP).
                reference = reference_chunks(chunks, build, finetuning, converter)
            model = wrap_ddp(chunks, parallel, half_precision=half)
        with _CudaTypeNames():
            optimizer = build_optimizer(model, optimizer_config(training, parallel, min_lr=0.0))
        from megatron.core import parallel_state

        pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
        params, grads = _model_bytes(model)
        if reference is not chunks:  # with LoRA the policy's own frozen base is the reference
            for param in (p for chunk in reference for p in chunk.parameters()):
                _add(params, param)
        master, moments = _optimizer_bytes(optimizer)
    return RankBytes(rank, pipeline_rank, params, grads, master, moments,
                     time.monotonic() - start)


def _add(into: dict[str, int], tensor: torch.Tensor) -> None:
    name = str(tensor.dtype).removeprefix("torch.")
    into[name] = into.get(name, 0) + tensor.numel() * tensor.element_size()


def _model_bytes(model: list[DistributedDataParallel]) -> tuple[dict[str, int], dict[str, int]]:
    """(parameters, gradients) by dtype: each DDP buffer's padded storage, and every
    parameter that lives outside a parameter buffer (its own tensor)."""
    params: dict[str, int] = {}
    grads: dict[str, int] = {}
    for chunk in model:
        in_buffers: set[int] = set()
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            _add(grads, buffer.grad_data)
            if buffer.param_data is not None:
                _add(params, buffer.param_data)
                in_buffers.update(id(p) for p in buffer.params)
        for param in chunk.module.parameters():
            if id(param) not in in_buffers:
                _add(params, param)
    return params, grads


def _optimizer_bytes(optimizer: MegatronOptimizer) -> tuple[dict[str, int], dict[str, int]]:
    """(master weights, Adam moments) by dtype, over a chained optimizer's parts."""
    master: dict[str, int] = {}
    moments: dict[str, int] = {}
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        # The distributed optimizer's shards, or the mixed-precision optimizer's whole copies.
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(part, attr, None) or []:
                for tensor in group:
                    _add(master, tensor)
        inner = getattr(part, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            for param in group["params"]:
                _add(moments, param)  # exp_avg ...
                _add(moments, param)  # ... and exp_avg_sq, each like the stepped parameter
    return master, moments


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int) -> Iterator[None]:
    """torch's fake process group as rank ``rank`` of ``world_size``; Megatron's gloo groups
    (the distributed optimizer's checkpoint groups) are fake too: gloo would wait for peers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shutdown()  # a dry run of another rank before this one
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    new_group = dist.new_group

    def fake_gloo(*args: Any, **kwargs: Any) -> Any:  # Any: torch's new_group's own arguments
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = None  # the default group's backend: fake
        return new_group(*args, **kwargs)

    dist.new_group = fake_gloo
    try:
        yield
    finally:
        dist.new_group = new_group
        shutdown()


class _MetaFactories(TorchFunctionMode):
    """Every tensor factory and device move lands on the meta device: Megatron allocates its
    weights and DDP buffers on ``torch.cuda.current_device()`` (or CPU), and these are what
    the dry run must size but never hold."""

    def __torch_function__(self, func: Callable[..., Any], types: Collection[type],
                           args: tuple[Any, ...] = (),  # whatever the intercepted function takes
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if kwargs.get("device") is not None:
            kwargs["device"] = _META
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_device(args[1]):
            args = (args[0], _META, *args[2:])
        if func is torch.Tensor.cuda:
            return args[0]
        with torch.device(_META):  # factories without a device (use_cpu_initialization)
            return func(*args, **kwargs)


class _CudaTypeNames(TorchFunctionMode):
    """Megatron's optimizers check ``tensor.type()`` against the CUDA type names; a meta
    tensor reports ``torch.meta.*``, which they refuse."""

    def __torch_function__(self, func: Callable[..., Any], types: Collection[type],
                           args: tuple[Any, ...] = (),  # whatever the intercepted function takes
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            return result.replace("torch.meta.", "torch.cuda.")
        return result


def _is_device(value: object) -> bool:
    return isinstance(value, (torch.device, str)) or (isinstance(value, int)
                                                       and not isinstance(value, bool))
