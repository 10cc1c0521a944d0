"""This process's random-number state: Python, NumPy, torch (CPU and CUDA) and Megatron's
model-parallel RNG tracker, read and put back as one dict.

Seeded by :mod:`.distributed` when the rank starts; saved per rank in every checkpoint and
restored on resume when the layout is unchanged (dropout masks then continue exactly).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def collect_rng() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            # On CPU the compat layer maps the CUDA generator to the CPU one (same state).
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": get_cuda_rng_tracker().get_states()}


def restore_rng(states: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    get_cuda_rng_tracker().set_states(states["tracker"])
