"""Rank program of tests/test_lora.py: ``hpc-mca train`` with a callback that records, on
global rank 0, what the test compares with peft on the transformers model.

Usage (every rank, under torchrun or as a single process):
    python tests/lora_worker.py OUT_DIR CONFIG [key=value ...]

At the start of training the callback copies every frozen parameter; at the end it writes
``OUT_DIR/result.json`` ({"frozen_unchanged": bool, "trainable": int, "frozen": int} summed
over the model's distinct shards) and ``OUT_DIR/logits.pt`` (the trained model's logits
``[2, 12, vocab]`` on fixed token ids, from the last pipeline stage, tensor-parallel shards
gathered).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback


class Record(TrainerCallback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.before: dict[str, torch.Tensor] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.before = {f"{i}.{name}": p.detach().clone() for i, chunk in enumerate(model)
                       for name, p in chunk.named_parameters() if not p.requires_grad}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        from megatron.core import parallel_state as mpu

        from hpc_mca.models.inference import forward_logits
        from hpc_mca.models.weights import unwrap

        frozen = {f"{i}.{name}": p for i, chunk in enumerate(model)
                  for name, p in chunk.named_parameters() if not p.requires_grad}
        same = frozen.keys() == self.before.keys() and all(
            torch.equal(frozen[k], self.before[k]) for k in frozen)
        counts = torch.tensor([_count(model, True), _count(model, False), int(not same)])
        dist.all_reduce(counts)
        chunks = [unwrap(chunk) for chunk in model]
        for chunk in chunks:
            chunk.eval()
        ids = torch.arange(24).reshape(2, 12) % 40 + 3
        logits = forward_logits(chunks, ids, chunks[-1].vocab_size)
        replica = mpu.get_data_parallel_rank(with_context_parallel=True) == 0
        if logits is not None and replica and mpu.get_tensor_model_parallel_rank() == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            torch.save(logits.float().cpu(), self.out / "logits.pt")
            (self.out / "result.json").write_text(json.dumps(
                {"trainable": int(counts[0]), "frozen": int(counts[1]),
                 "frozen_unchanged": int(counts[2]) == 0}))


def _count(model, trainable: bool) -> int:
    """Elements of this rank's (non-duplicate) parameters: TP-replicated ones counted on TP
    rank 0, every parameter on the first data-parallel replica only."""
    from megatron.core import parallel_state as mpu

    total = 0
    for chunk in model:
        for param in chunk.parameters():
            if param.requires_grad != trainable:
                continue
            expert = not getattr(param, "allreduce", True)
            dp = (mpu.get_expert_data_parallel_rank() if expert
                  else mpu.get_data_parallel_rank(with_context_parallel=True))
            tp = (mpu.get_expert_tensor_parallel_rank() if expert
                  else mpu.get_tensor_model_parallel_rank())
            if dp == 0 and (getattr(param, "tensor_model_parallel", False) or tp == 0):
                total += param.numel()
    return total


def main() -> None:
    from hpc_mca.launch.run import run_training

    out, config, *overrides = sys.argv[1:]
    run_training(config, overrides, callbacks=[Record(Path(out))])


if __name__ == "__main__":
    main()
