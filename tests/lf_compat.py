"""What LLaMA-Factory 0.9.5's training-side modules need to import in this environment, for the
scripts that use them as ROLL's do (tests/roll_train.py): import this first.

- ``DISABLE_VERSION_CHECK=1``: its dependency check pins transformers <= 5.6 (ROLL's launchers
  set the same variable);
- ``torchaudio``: its ``data/mm_plugin.py`` imports it at module load, only its audio plugins
  use it (see tests/lf_peer.py, which stubs it the same way);
- ``trl.AutoModelForCausalLMWithValueHead``: its ``model`` package imports this name, which TRL
  1.16 no longer exports; only its PPO/reward-model stages use it.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types

os.environ.setdefault("DISABLE_VERSION_CHECK", "1")


def _install() -> None:
    if "torchaudio" not in sys.modules:
        from transformers.utils import import_utils

        import_utils.is_torchaudio_available()  # cache the true answer before the stub exists
        stub = types.ModuleType("torchaudio")
        stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
        sys.modules["torchaudio"] = stub
    import trl

    if not hasattr(trl, "AutoModelForCausalLMWithValueHead"):
        trl.AutoModelForCausalLMWithValueHead = type("AutoModelForCausalLMWithValueHead", (), {
            "__doc__": "Stand-in: LLaMA-Factory's PPO and reward-model stages only."})


_install()
