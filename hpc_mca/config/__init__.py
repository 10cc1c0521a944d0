"""The run config: one dataclass section per concern, the rules that hold between them, the
LR schedule names and the run length.

Low on purpose: every rank-side and login-side package imports it downward; it imports only
the run directory's contracts and the sections owned by the pure layer below it (the data
arguments live in :mod:`hpc_mca.data.arguments`, the layout arithmetic in
:mod:`hpc_mca.topology`). Importing it pulls in neither torch nor megatron, so
``hpc-mca train --help`` and config validation stay instant (:mod:`.schedule` builds its
Megatron scheduler lazily).

- ``sections``: the dataclasses and the resolved config a run directory keeps.
- ``loading``: YAML and ``key=value`` overrides into the dataclasses, with every problem in one message.
- ``input``: type coercion, what to say of an unknown key, the one-line :class:`ConfigError`.
- ``lf_keys``: LLaMA-Factory's keys that set fields of this config (``packing``, ``save_strategy`` ...).
- ``choices``: the enumerated fields' choices (pure data).
- ``rules``: the cross-section checks, each naming the dotted field and what is valid.
- ``finetuning_rules``: the checks of what trains (LoRA, freeze, adapters) and of each stage's losses.
- ``scope``: settings that only mean something in a context (a stage, a backend).
- ``layout``: the parallel layout and model shape a config asks for.
- ``schedule``: LR schedule names, their arguments and shapes.
- ``run_length``: steps from epochs, samples and batch sizes.
"""

from .loading import load_config
from .sections import (
    ConfigError,
    DataArguments,
    FinetuningArguments,
    ModelArguments,
    ParallelArguments,
    TrainConfig,
    TrainingArguments,
)

__all__ = [
    "ConfigError", "DataArguments", "FinetuningArguments", "ModelArguments", "ParallelArguments",
    "TrainConfig", "TrainingArguments", "load_config",
]
