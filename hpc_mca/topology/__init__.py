"""Topology planner: parallel layout, micro-batching and per-GPU memory for Megatron-Core jobs
(and for the standard backend's whole-model-per-GPU jobs: data × Ulysses sequence parallelism).

Pure Python on purpose: login-node commands (``hpc-mca plan``) import this package, so it must
never import torch, megatron or transformers.
"""

from .errors import LayoutError
from .hardware import GPU_PRESETS, GpuSpec, get_gpu
from .layout import Layout, balanced_pipeline_layout, megatron_pipeline_layout
from .memory import MemoryEstimate, Workload, estimate_memory
from .model import ModelShape
from .planner import Plan, PlanRequest, plan
from .report import format_plan_table
from .rules import check_layout

__all__ = [
    "GPU_PRESETS", "GpuSpec", "Layout", "LayoutError", "MemoryEstimate", "ModelShape", "Plan",
    "PlanRequest", "Workload", "check_layout", "estimate_memory", "format_plan_table",
    "balanced_pipeline_layout", "get_gpu", "megatron_pipeline_layout", "plan",
]
