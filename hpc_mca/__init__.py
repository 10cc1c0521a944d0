"""hpc-mca: Megatron-Core training on Slurm clusters.

Importing this package must stay cheap (no torch, no megatron): login-node commands such as
``hpc-mca --help`` and ``hpc-mca plan`` import it. The Python API's names
(``from hpc_mca import AutoModel, McaTrainer, TrainingArguments``) are imported from
:mod:`hpc_mca.api` on first use.
"""

from typing import Any

__version__ = "0.1.0"

_API = {"AutoConfig", "AutoModel", "DPOConfig", "DPOTrainer", "McaModel", "McaTrainer",
        "Seq2SeqTrainingArguments", "TrainingArguments"}
__all__ = ["__version__", *sorted(_API)]


def __getattr__(name: str) -> Any:
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'hpc_mca' has no attribute {name!r}")
