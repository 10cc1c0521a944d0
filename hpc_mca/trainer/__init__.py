"""The training entry point's building blocks: configuration, LR schedulers and the loop.

Light on purpose: importing this package (and :mod:`hpc_mca.trainer.config`) pulls in neither
torch nor megatron, so ``hpc-mca train --help`` and config validation stay instant. Submodules
that need them (:mod:`hpc_mca.trainer.lr_scheduler` builds its scheduler lazily) import them
when used.
"""

from .config import (
    ConfigError,
    DataArguments,
    FinetuningArguments,
    ModelArguments,
    ParallelArguments,
    TrainConfig,
    TrainingArguments,
    load_config,
)

__all__ = [
    "ConfigError", "DataArguments", "FinetuningArguments", "ModelArguments", "ParallelArguments",
    "TrainConfig", "TrainingArguments", "load_config",
]
