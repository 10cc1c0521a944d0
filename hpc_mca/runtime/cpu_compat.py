"""Megatron-Core on CPU: the patches to torch and Megatron that let it run without CUDA (the
other places that patch a library, each for its own reason, are listed in docs/internals.md under
"Library patches").

Megatron-Core is written for CUDA. Its algorithms (tensor/pipeline/expert parallelism, DDP,
the distributed optimizer, dist_checkpointing) are device-agnostic torch code, but it reaches
for CUDA in a few recurring ways: ``torch.cuda.current_device()`` as a factory ``device``,
literal ``device="cuda"`` and ``.cuda()``, the CUDA RNG for its seed tracker, CUDA streams and
events around gradient communication, and ``tensor.type()`` strings such as
``'torch.cuda.FloatTensor'`` in optimizer checks. On a CUDA-less machine (development laptops,
CI, the 2-core boxes this project is tested on) each of those raises.

``activate()`` installs the patches listed in :data:`PATCHES` whose condition holds: every
CPU patch when CUDA is absent (GPU runs execute unmodified Megatron-Core: NCCL, Transformer
Engine), and the one Megatron-Core bug that has nothing to do with CUDA, in an output-
discarding checkpoint that needs Transformer Engine to be installed (``checkpoint_te``),
whenever Transformer Engine is absent, on a GPU too. Every patch names the Megatron code it
answers; ``tests/test_cpu_compat.py`` shows, patch by patch, that the Megatron call fails
without it and works with it.

What the patches do NOT change: numerics. Devices are remapped to CPU and the "CUDA" RNG is
the CPU default generator, which is what CPU kernels draw from anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple  # private: see _backward
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode
from torch.types import Device

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

__all__ = ["PATCHES", "Patch", "activate", "active_patches", "needed"]


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    """Short identifier, used by ``activate(skip=...)`` and the tests."""
    answers: str
    """The Megatron-Core (or torch) code that fails on CPU without this patch."""
    apply: Callable[[], None]
    """Installs the patch; called at most once per process."""
    when: Callable[[], bool] = lambda: needed()
    """Whether this process needs it (most patches: no CUDA)."""


_ACTIVE: list[str] = []


def needed() -> bool:
    """The patches are needed exactly when this torch cannot use CUDA."""
    return not torch.cuda.is_available()


def active_patches() -> list[str]:
    return list(_ACTIVE)


def activate(skip: Iterable[str] = ()) -> list[str]:
    """Install every patch (except ``skip``) this process needs; return the names installed.

    Idempotent. ``skip`` exists for the tests that prove each patch is necessary.
    """
    skipped = set(skip)
    unknown = skipped - {p.name for p in PATCHES}
    if unknown:
        raise ValueError(f"unknown cpu_compat patch(es) {sorted(unknown)}; valid: {[p.name for p in PATCHES]}")
    for patch in PATCHES:
        if patch.name in skipped or patch.name in _ACTIVE or not patch.when():
            continue
        patch.apply()
        _ACTIVE.append(patch.name)
    return active_patches()


# --------------------------------------------------------------------------------------------
# 1. Devices: a torch function mode that rewrites CUDA devices to CPU.
# --------------------------------------------------------------------------------------------

def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int device means "CUDA device <int>" to torch factories (and is what
    # torch.cuda.current_device() returns). Excludes bool, which is an int subclass.
    return isinstance(device, int) and not isinstance(device, bool)


_CPU = torch.device("cpu")
_Gradients: TypeAlias = "torch.Tensor | Sequence[torch.Tensor | None] | None"
"""What backward takes as the gradients of its outputs."""
_CUDA_TYPE_NAMES = {  # tensor.type() on CPU -> the name Megatron's optimizer checks expect
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaToCpuMode(TorchFunctionMode):
    """Maps every CUDA device argument to CPU, makes ``.cuda()`` a no-op move to CPU, and
    reports CUDA type names from ``tensor.type()``.

    Answers: torch.cuda.current_device()/"cuda" used as ``device=`` throughout megatron/core
    (e.g. utils.GlobalMemoryBuffer.get_tensor, transformer/utils.get_default_causal_mask,
    optimizer/clip_grads.py, distributed/param_and_grad_buffer.py) and the ``.type()`` checks
    in optimizer/optimizer.py, optimizer/distrib_optimizer.py and optimizer/clip_grads.py.
    Also drops ``pin_memory=True`` from factories: pinning needs an accelerator, and
    models/common/embeddings/rope_utils.get_pos_emb_on_this_cp_rank (RoPE under context
    parallelism) builds its chunk index that way.
    """

    def __torch_function__(self, func: Callable[..., Any], types: Collection[type],
                           args: tuple[Any, ...] = (),  # whatever the intercepted torch function takes
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]  # already in CPU memory; pinning needs an accelerator
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            return self._backward(*args, **kwargs)
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            # Tensor.to(device, ...): a positional int/str/device is a device (dtypes are not).
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)

    def _backward(self, tensors: torch.Tensor | Sequence[torch.Tensor], gradient: _Gradients = None,
                  retain_graph: bool | None = None, create_graph: bool = False,
                  inputs: torch.Tensor | Sequence[torch.Tensor] | None = None, *,
                  grad_tensors: _Gradients = None) -> None:
        """Run backward with this mode active.

        A mode is switched off while its handler runs, and backward executes Python code of
        autograd Functions (Megatron's all-to-all, activation recompute, ...) that allocates on
        "cuda". Re-entering the mode and calling ``torch.autograd.backward`` would dispatch
        back here forever, so this calls the engine the way ``torch.autograd.backward`` does.
        """
        # Tensor.backward's gradient, or torch.autograd.backward's grad_tensors by keyword.
        gradient = gradient if grad_tensors is None else grad_tensors
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(gradient, len(tensors)), is_grads_batched=False)
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs or ())
        with self:
            _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph,
                                 create_graph, inputs, allow_unreachable=True, accumulate_grad=True)


def _install_device_mode() -> None:
    # Entered for the life of the process: the mode stack is per thread, and Megatron runs its
    # training step on the main thread (autograd on CPU runs backward on the calling thread).
    _CudaToCpuMode().__enter__()
    torch.cuda.current_device = _device_zero
    torch.cuda.device_count = _one_device
    torch.cuda.set_device = _set_device


# One function for each torch function replaced: torch.compile's tracing rules are kept per
# function object, and one object standing in for two torch functions breaks them.

def _device_zero() -> int:
    return 0


def _one_device() -> int:
    return 1


def _set_device(device: Device) -> None:
    pass


def _synchronize(device: Device = None) -> None:
    pass


def _empty_cache() -> None:
    pass


def _record_stream(tensor: torch.Tensor, s: _Stream) -> None:
    pass


def _current_stream(device: Device = None) -> _CpuStream:
    return _DEFAULT_STREAM


def _default_stream(device: Device = None) -> _CpuStream:
    return _DEFAULT_STREAM


def _no_stream(stream: _Stream | None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# 2. RNG: Megatron's CudaRNGStatesTracker on the CPU default generator.
# --------------------------------------------------------------------------------------------

def _install_rng() -> None:
    """Answers tensor_parallel/random.py: model_parallel_cuda_manual_seed and
    CudaRNGStatesTracker.add/fork call torch.cuda.manual_seed/get_rng_state and the module's
    _get_cuda_rng_state/_set_cuda_rng_state, all of which need a CUDA generator.

    On CPU every kernel draws from ``torch.default_generator``, so that is the generator the
    tracker must save, seed and swap for dropout in tensor-parallel regions to differ per rank.
    The generator is called directly: ``torch.manual_seed`` itself calls
    ``torch.cuda.manual_seed_all`` and would recurse into these patches.
    """
    from megatron.core.tensor_parallel import random as mrandom

    # fork() warns whenever the CPU generator changed inside a forked region; here the forked
    # generator IS the CPU generator, so the warning would fire on every dropout call.
    logging.getLogger(mrandom.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
    )
    mrandom._get_cuda_rng_state = _megatron_get_rng_state
    mrandom._set_cuda_rng_state = _megatron_set_rng_state
    # torch.cuda re-exports torch.cuda.random's functions: both names are the same function.
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = _get_rng_state
    torch.cuda.set_rng_state = torch.cuda.random.set_rng_state = _set_rng_state
    torch.cuda.manual_seed = torch.cuda.random.manual_seed = _manual_seed
    torch.cuda.manual_seed_all = torch.cuda.random.manual_seed_all = _manual_seed_all


def _megatron_get_rng_state(device: int | str | torch.device = "cuda", clone: bool = False,
                            graph_safe: bool = False) -> torch.Tensor:
    return torch.default_generator.get_state()


def _megatron_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.default_generator.set_state(new_state)


def _get_rng_state(device: int | str | torch.device = "cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def _set_rng_state(new_state: torch.Tensor, device: int | str | torch.device = "cuda") -> None:
    torch.default_generator.set_state(new_state)


def _manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _manual_seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


# --------------------------------------------------------------------------------------------
# 3. Streams, events, synchronize: torch.cpu's equivalents.
# --------------------------------------------------------------------------------------------

class _CpuStream(torch.cpu.Stream):
    """torch.cpu.Stream plus the methods Megatron calls on CUDA streams (all no-ops: CPU ops
    run synchronously in program order)."""

    def __init__(self, device: Device = None, priority: int = 0, *, stream_id: int = 0, device_index: int = 0,
                 device_type: int = 0) -> None:
        super().__init__()

    def synchronize(self) -> None:
        pass

    # torch.cpu.Stream's takes no event and returns None; torch.cuda.Stream's, replaced, returns one.
    def record_event(self, event: _Event | None = None) -> _Event:  # type: ignore[override]
        return event if event is not None else _CpuEvent()

    def wait_event(self, event: _Event) -> None:
        pass

    def wait_stream(self, stream: _Stream) -> None:
        pass


class _CpuEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False) -> None:
        pass

    def record(self, stream: _Stream | None = None) -> None:
        pass

    def wait(self, stream: _Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _CpuStream()
_Stream: TypeAlias = "torch.Stream | _CpuStream"
"""A stream the stand-ins may be handed: torch's, or (torch.cuda.Stream replaced) ours."""
_Event: TypeAlias = "torch.Event | _CpuEvent"


def _install_streams() -> None:
    """Answers distributed/distributed_data_parallel.py (communication_stream =
    torch.cuda.Stream(...)), distributed/param_and_grad_buffer.py
    (torch.cuda.current_stream().wait_stream), transformer/moe/* (Event/Stream) and the
    torch.cuda.synchronize()/empty_cache() calls around timers and checkpointing."""
    # The stand-ins take torch's arguments but hand out CPU streams and contexts, not CUDA ones.
    torch.cuda.Stream = _CpuStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _CpuEvent  # type: ignore[assignment,misc]
    torch.cuda.current_stream = _current_stream  # type: ignore[assignment]
    torch.cuda.default_stream = _default_stream  # type: ignore[assignment]
    torch.cuda.stream = _no_stream  # type: ignore[assignment]
    torch.cuda.synchronize = _synchronize
    torch.cuda.empty_cache = _empty_cache
    torch.Tensor.record_stream = _record_stream  # type: ignore[assignment]


# --------------------------------------------------------------------------------------------
# 4. MoE all-to-all: split sizes as lists for gloo.
# --------------------------------------------------------------------------------------------

def _install_alltoall_splits() -> None:
    """Answers transformer/moe/token_dispatcher.py (MoEAlltoAllTokenDispatcher) and
    tensor_parallel/mappings.py all_to_all: the dispatcher hands ``input_split_sizes`` /
    ``output_split_sizes`` to torch.distributed.all_to_all_single as tensors, which gloo's
    binding rejects ("all_to_all_single(): incompatible function arguments"). NCCL accepts
    the same call because the sizes arrive there already converted on the CUDA path."""
    original = torch.distributed.all_to_all_single

    @functools.wraps(original)
    def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: _SplitSizes = None,
                          input_split_sizes: _SplitSizes = None, group: ProcessGroup | None = None,
                          async_op: bool = False) -> Work | None:
        return original(output, input, _as_list(output_split_sizes), _as_list(input_split_sizes), group, async_op)

    torch.distributed.all_to_all_single = all_to_all_single
    from megatron.core.tensor_parallel import mappings

    if getattr(mappings, "all_to_all_single", None) is original:
        mappings.all_to_all_single = all_to_all_single


_SplitSizes: TypeAlias = "torch.Tensor | Sequence[int] | None"
"""Split sizes as torch takes them (a list), or as Megatron's dispatcher hands them over."""


def _as_list(sizes: _SplitSizes) -> list[int] | None:
    if isinstance(sizes, torch.Tensor):
        return sizes.tolist()
    if sizes is not None and not isinstance(sizes, list):
        return [int(s) for s in sizes]
    return sizes


# --------------------------------------------------------------------------------------------
# 5. Without Transformer Engine (any device): the output-discarding checkpoint.
# --------------------------------------------------------------------------------------------

def te_missing() -> bool:
    """Megatron-Core found no Transformer Engine (its tensor_parallel.random imports TE's FP8
    state when it can)."""
    from megatron.core.tensor_parallel import random

    return not random.HAVE_TE


def _install_checkpoint_without_te() -> None:
    """Answers tensor_parallel/random.py CheckpointWithoutOutput, the checkpoint behind
    ``recompute_modules`` layernorm (transformer/transformer_layer.py) and moe_act: its
    ``__init__(fp8=False)`` sets ``self.fp8 = fp8 is not None``, True for the default, so that
    its forward asks TE's ``FP8GlobalStateManager`` whether fp8 is on (upstream keeps it so on
    purpose, for TE's amax bookkeeping). Without TE that name was never imported and the first
    forward raises NameError. Without TE no fp8 can be on, so the object takes the path it
    would take with TE and fp8 off: the same numbers."""
    from megatron.core.tensor_parallel import random

    original = random.CheckpointWithoutOutput.__init__

    @functools.wraps(original)
    def __init__(self: random.CheckpointWithoutOutput, fp8: object = False) -> None:
        original(self, fp8)  # fp8: the quantization setting, only compared with None
        self.fp8 = False

    random.CheckpointWithoutOutput.__init__ = __init__


# --------------------------------------------------------------------------------------------
# 6. Multi-latent attention's yarn rope: its frequencies inside a CUDA device context.
# --------------------------------------------------------------------------------------------

def _install_yarn_cpu_init() -> None:
    """Answers models/common/embeddings/yarn_rotary_pos_embedding.py YarnRotaryEmbedding, which
    transformer/multi_latent_attention.py builds without ``use_cpu_initialization``: it then
    computes its frequencies inside ``with torch.device(torch.cuda.current_device())``, a
    device context rather than a function call, which the device mode cannot rewrite. Without
    CUDA it computes the same frequencies on the CPU, the path use_cpu_initialization takes."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    original = YarnRotaryEmbedding.__init__

    @functools.wraps(original)
    def __init__(self: YarnRotaryEmbedding, *args: Any, **kwargs: Any) -> None:  # Any: Megatron's own
        original(self, *args, **{**kwargs, "use_cpu_initialization": True})

    YarnRotaryEmbedding.__init__ = __init__


PATCHES: tuple[Patch, ...] = (
    Patch("devices", "torch.cuda.current_device()/device='cuda'/.cuda()/.type()/pin_memory across megatron/core",
          _install_device_mode),
    Patch("rng", "megatron/core/tensor_parallel/random.py CUDA RNG tracker", _install_rng),
    Patch("streams", "torch.cuda.Stream/Event/current_stream/synchronize in DDP, MoE, timers", _install_streams),
    Patch("alltoall", "MoE alltoall dispatcher split sizes on gloo", _install_alltoall_splits),
    Patch("checkpoint_te", "tensor_parallel/random.py CheckpointWithoutOutput without Transformer "
          "Engine (recompute_modules layernorm)", _install_checkpoint_without_te, te_missing),
    Patch("yarn_init", "models/common/embeddings/yarn_rotary_pos_embedding.py built by "
          "transformer/multi_latent_attention.py (a CUDA device context)", _install_yarn_cpu_init),
)
