"""Rank program of tests/test_settings_effects.py: ``hpc-mca train`` with a callback that
counts forward calls and records the local expert shapes.

``python tests/probe_worker.py OUT CONFIG [key=value ...]``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COUNTED = ("core_attention", "input_layernorm", "pre_mlp_layernorm", "mlp", "router",
           "linear_kv_up_proj")
"""The layer parts whose forward calls are counted besides each decoder layer's (a MoE
layer's recompute reruns its router inside the layer's own forward, so the router shows it)."""


def probe_main(out: Path, config: str, overrides: list[str]) -> None:
    """``hpc-mca train`` with a callback that counts forward calls of every decoder layer and
    the parts in COUNTED (pre-hooks: a recomputation in backward calls them again) and, at the end,
    writes ``OUT/rank{R}.json``: {"calls": {name: count}, "expert_shapes": {name: shape}}."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    from hpc_mca.launch.run import run_training
    from hpc_mca.models.weights import unwrap

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.calls: dict[str, int] = {}

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            for i, chunk in enumerate(model):
                for name, module in unwrap(chunk).named_modules():
                    last = name.rsplit(".", 1)[-1]
                    layer = last.isdigit() and name.endswith(f"layers.{last}")
                    if layer or last in COUNTED:
                        self.calls[f"{i}.{name}"] = 0
                        module.register_forward_pre_hook(self._counter(f"{i}.{name}"))

        def _counter(self, key: str):
            def count(*_):
                self.calls[key] += 1
            return count

        def on_train_end(self, args, state, control, model=None, **kwargs):
            shapes = {f"{i}.{name}": list(p.shape) for i, chunk in enumerate(model)
                      for name, p in unwrap(chunk).named_parameters() if ".experts." in name}
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{dist.get_rank()}.json").write_text(
                json.dumps({"calls": self.calls, "expert_shapes": shapes}))

    run_training(config, overrides, callbacks=[Probe()])


if __name__ == "__main__":
    probe_main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
