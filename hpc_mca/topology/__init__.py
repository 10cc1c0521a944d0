"""Topology planner: parallel layout, micro-batching and per-GPU memory for Megatron-Core jobs
(and for the standard backend's whole-model-per-GPU jobs: data × Ulysses sequence parallelism).

Pure Python on purpose: login-node commands (``hpc-mca plan``) import this package, so it must
never import torch, megatron or transformers. The names below are loaded on first use: the CLI's
option lists import ``topology.hardware`` and ``topology.memory`` for ``hpc-mca --help``, which
must not pay for the planner and its cost model.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of this package that defines it
_EXPORTS: dict[str, str] = {
    "LayoutError": "errors",
    "GPU_PRESETS": "hardware", "GpuSpec": "hardware", "get_gpu": "hardware",
    "Layout": "layout", "balanced_pipeline_layout": "layout", "megatron_pipeline_layout": "layout",
    "MemoryEstimate": "memory", "Workload": "memory", "estimate_memory": "memory",
    "ModelShape": "model",
    "Plan": "planner", "PlanRequest": "planner", "plan": "planner",
    "format_plan_table": "report",
    "check_layout": "rules",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

