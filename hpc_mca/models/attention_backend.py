"""Which core-attention backend a run gets: Transformer Engine, flash-attn, or plain PyTorch.

``select_attention_backend("auto")`` picks ``"te"`` when ``transformer_engine`` imports and CUDA
is available, else ``"flash"`` when ``flash_attn`` imports and CUDA is available, else
``"torch"``. An explicit choice this machine cannot run, or context parallelism the chosen
backend cannot run, is bad input (:class:`ModelLoadError`, exit 2), refused before any process
group exists; so this module imports no Megatron model code. :mod:`.attention` turns the choice
into the layer spec's ``core_attention``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Optional

import torch

from hpc_mca.config.sections import ATTENTION_BACKENDS, ATTENTION_CHOICES
from hpc_mca.models.errors import ModelLoadError
from hpc_mca.topology.memory import TORCH_CP_COMM_TYPES

__all__ = [
    "ATTENTION_BACKENDS",
    "available_attention_backends",
    "check_context_parallel",
    "choose_attention_backend",
    "select_attention_backend",
]


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001 - GPU wheels fail with OSError/RuntimeError on CPU hosts too
        return False
    return True


@functools.lru_cache(maxsize=1)
def available_attention_backends() -> tuple[str, ...]:
    """Backends usable in this process, in preference order; ``"torch"`` is always last."""
    if not torch.cuda.is_available():
        return ("torch",)
    found = []
    if _importable("transformer_engine.pytorch"):
        found.append("te")
    if _importable("flash_attn"):
        found.append("flash")
    return (*found, "torch")


def choose_attention_backend(preference: str, available: Iterable[str]) -> str:
    """Resolve ``preference`` ("auto", "te", "flash" or "torch") against ``available``."""
    available = tuple(available)
    if preference == "auto":
        return next(name for name in ATTENTION_BACKENDS if name in available)
    if preference not in ATTENTION_BACKENDS:
        choices = ", ".join(repr(c) for c in ATTENTION_CHOICES)
        raise ModelLoadError(f"model.attention_backend={preference!r} is not one of {choices}")
    if preference not in available:
        # Bad input, not a crash: a requeue lands on the same kind of node.
        needs = "transformer_engine" if preference == "te" else "flash_attn"
        raise ModelLoadError(
            f"model.attention_backend={preference!r} is not available here (needs {needs} and "
            f"CUDA); available: {', '.join(available)}"
        )
    return preference


def select_attention_backend(preference: str = "auto") -> str:
    """The backend to use: "te", "flash" or "torch" (see the module docstring for ``auto``).

    An explicit choice that this machine cannot run raises ModelLoadError (bad input: exit 2)
    naming what is available.
    """
    return choose_attention_backend(preference, available_attention_backends())


def check_context_parallel(backend: str, cp: int, comm_type: Optional[str]) -> None:
    """Raise ModelLoadError unless ``backend`` runs context parallelism of size ``cp`` with
    ``comm_type``: TE runs any of its exchanges, the torch backend all_gather and a2a, flash
    none."""
    if cp == 1 or backend == "te":
        return
    if backend == "flash":
        raise ModelLoadError(f"context_parallel_size={cp} is not supported by the 'flash' "
                             "attention backend; valid: model.attention_backend 'torch' or 'te'")
    if (comm_type or "all_gather") not in TORCH_CP_COMM_TYPES:
        raise ModelLoadError(f"cp_comm_type={comm_type!r} needs the 'te' attention backend; "
                             f"valid with the {backend!r} backend: "
                             f"{', '.join(TORCH_CP_COMM_TYPES)}")
