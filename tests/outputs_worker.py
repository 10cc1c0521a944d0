"""Rank program of tests/test_lf_examples.py: ``hpc-mca train CONFIG`` with a callback that
writes, on the rank that has them, the trained model's logits on fixed token ids, computed
from the model in memory at the end of training (before the run exports it), so the test can
compare them with what transformers/peft load from output_dir.

Usage (every rank, under torchrun/forkrun or as a single process):
    python tests/outputs_worker.py OUT_FILE CONFIG [key=value ...]

Rank 0 then draws ``training.plot_loss``'s curves, as ``hpc-mca train`` does after a run.

Both compute in float32 on the trained weights (exact for bf16 ones), as the test's
transformers model does on the exported weights. Megatron backend: the last pipeline stage's
logits, tensor-parallel shards gathered, written by its first tensor/data-parallel rank.
Standard backend: the transformers (or peft) model's logits, written by rank 0. Both as
float32 ``[2, 12, vocab]`` (padded vocab rows cut off).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.utils.stateless import _reparametrize_module  # functional_call's context
from transformers import TrainerCallback

IDS = (torch.arange(24).reshape(2, 12) * 7) % 90 + 3
"""Token ids every model here has (the test model's vocabulary is larger than 93)."""


class Logits(TrainerCallback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, args, state, control, model=None, **kwargs):
        logits = _megatron(model) if isinstance(model, list) else _hf(model)
        if logits is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            torch.save(logits.float().cpu(), self.out)


def _megatron(chunks) -> torch.Tensor | None:
    from megatron.core import parallel_state as mpu

    from hpc_mca.models.inference import forward_logits
    from hpc_mca.models.weights import unwrap

    # The trained (maybe bf16) weights upcast to fp32 for this forward only: exact, and what
    # the test's fp32 transformers model computes with after upcasting the exported weights
    # alike. Swapped in rather than copied: the chunks hold process groups (no deepcopy), and
    # their parameters are views into DDP's buffers, which the final save still reads.
    chunks = [unwrap(chunk) for chunk in chunks]
    with contextlib.ExitStack() as stack:
        for chunk in chunks:
            chunk.eval()
            upcast = {name: t.float() for name, t in [*chunk.named_parameters(), *chunk.named_buffers()]}
            stack.enter_context(_reparametrize_module(chunk, upcast))
            stack.enter_context(_softmax_out_in_fp32(chunk))
        logits = forward_logits(chunks, IDS, chunks[-1].vocab_size)
    first = (mpu.get_data_parallel_rank(with_context_parallel=True) == 0
             and mpu.get_tensor_model_parallel_rank() == 0)
    return logits if logits is not None and first else None


@contextlib.contextmanager
def _softmax_out_in_fp32(chunk):
    """Megatron's softmax rounds the attention probabilities to bf16 in a bf16 model (its
    config says so): not in this fp32 forward."""
    softmaxes = [m for m in chunk.modules() if getattr(m, "input_in_float16", False)]
    for module in softmaxes:
        module.input_in_float16 = False
    try:
        yield
    finally:
        for module in softmaxes:
            module.input_in_float16 = True


def _hf(model) -> torch.Tensor | None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    from accelerate.utils import extract_model_from_parallel

    # DDP off, and accelerate's autocast wrapper of forward (a bf16 run's) too; fp32 as above.
    model = copy.deepcopy(extract_model_from_parallel(model, keep_fp32_wrapper=False)).float().eval()
    with torch.no_grad():
        # Position ids per row: the standard backend's attention reads rows' documents from them.
        return model(input_ids=IDS, position_ids=torch.arange(IDS.size(1)).expand_as(IDS)).logits


def main() -> None:
    from hpc_mca.cli.train import plot_loss
    from hpc_mca.launch.run import run_training

    out, config, *overrides = sys.argv[1:]
    run_training(config, overrides, callbacks=[Logits(Path(out))])
    if not dist.is_initialized() or dist.get_rank() == 0:
        plot_loss(Path(config), overrides)  # what `hpc-mca train` does after the run


if __name__ == "__main__":
    main()
