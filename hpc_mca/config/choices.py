"""The choices of the run config's enumerated fields (pure data: the sections, the rules and
the loader all read them, so they import nothing)."""

from __future__ import annotations

__all__ = ["ATTENTION_BACKENDS", "ATTENTION_CHOICES", "DATASET_FORMATS", "FINETUNING_TYPES",
           "KERNEL_FUSIONS", "OPTIMIZERS", "OPTIMIZER_FORMATS", "PACKED_ATTENTION", "PACKED_KERNELS",
           "PREF_LOSSES", "REPORT_TO", "RESERVED_FINETUNING_TYPES", "RESHARDABLE_FORMATS",
           "TRACKER_PACKAGES"]

PREF_LOSSES = ("sigmoid", "ipo", "hinge", "orpo", "simpo")
"""dpo's preference losses (``finetuning.pref_loss``), as LLaMA-Factory and TRL name them."""
FINETUNING_TYPES = ("full", "lora", "freeze")
"""Which parameters train: every one (full), LoRA adapters on the frozen model (lora), or some
decoder layers and modules of the model, the rest frozen (freeze)."""
RESERVED_FINETUNING_TYPES: tuple[str, ...] = ()
DATASET_FORMATS = ("auto", "text", "alpaca", "sharegpt", "indexed")
ATTENTION_BACKENDS = ("te", "flash", "torch")
"""Core-attention backends, in the order ``auto`` prefers them (models.attention_backend)."""
ATTENTION_CHOICES = ("auto", *ATTENTION_BACKENDS)
"""model.attention_backend choices: a backend, or auto."""
PACKED_KERNELS = ("varlen", "flex", "sdpa")
"""Packed-sequence kernels of the torch backend, in the order ``auto`` prefers them
(hpc_mca.models.packed_kernels)."""
PACKED_ATTENTION = ("auto", *PACKED_KERNELS)
"""model.packed_attention choices: a kernel, or auto."""
KERNEL_FUSIONS = ("swiglu", "cross_entropy", "rope", "layer")
"""model.fusions choices: kernel fusions that run without Transformer Engine or Apex."""
OPTIMIZERS = ("adam", "sgd")
RESHARDABLE_FORMATS = ("fully_reshardable", "dp_reshardable")
"""Megatron's own distributed-optimizer sharding types that we save when
training.save_optimizer_format names them: fully_reshardable reshards over TP, PP and DP;
dp_reshardable only over DP. (Our default, model_space, reshards over all.)"""
OPTIMIZER_FORMATS = ("model_space", *RESHARDABLE_FORMATS)
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""training.report_to name -> the package it needs."""
REPORT_TO = (*TRACKER_PACKAGES, "none")
"""training.report_to choices: a tracker, or none."""
