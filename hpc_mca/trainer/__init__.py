"""The Megatron backend (``training.use_mca: true``): objectives per stage, the training step
over Megatron's pipeline schedules and the loop that drives it (:mod:`.trainer`).

Its config is :mod:`hpc_mca.config`; the step-end pieces it shares with the standard backend
(boundary decisions, metrics, trackers, callbacks) are :mod:`hpc_mca.loop`.

``McaTrainer`` and ``DPOTrainer`` are importable from here, where mcore_adapter's scripts import
them (``from hpc_mca.trainer import DPOTrainer, McaTrainer``); they are the Python API's
(:mod:`hpc_mca.api.trainer`), loaded on first use, so that importing this package stays cheap
and the layers below the API never import it.
"""

from typing import Any

_API_NAMES = ("DPOTrainer", "McaTrainer")


def __getattr__(name: str) -> Any:
    if name in _API_NAMES:
        import hpc_mca.api.trainer as api  # a facade: mcore_adapter's import path (see above)

        return getattr(api, name)
    raise AttributeError(f"module 'hpc_mca.trainer' has no attribute {name!r}")
