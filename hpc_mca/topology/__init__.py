"""Topology planner: parallel layout, micro-batching and per-GPU memory for Megatron-Core jobs.

Pure Python on purpose: login-node commands (``hpc-mca plan``) import this package, so it must
never import torch, megatron or transformers.
"""

from .errors import LayoutError
from .layout import Layout
from .model import ModelShape
from .rules import check_layout

__all__ = ["Layout", "LayoutError", "ModelShape", "check_layout"]
