"""Rank program of tests/test_sequence_parallel.py: Ulysses SP on a tiny transformers Llama.

Usage (every rank, under torchrun): python tests/sequence_parallel_worker.py SP OUT_DIR

Every rank builds the same model and packed row (:func:`sp_case`), takes its SP slice, runs
forward with ``attn_implementation="hpc_mca_packed"`` and backward of the row's mean token
loss (sums all-reduced over the SP group, gradients summed over it), and saves the gathered
logits, the loss and the parameter gradients to ``OUT_DIR/rank<r>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

LENGTHS = [5, 9, 3, 14]  # 31 tokens: odd, so SP2 pads one slot and SP4 one too


def sp_case(seed: int = 0) -> dict:
    """The model (fp32, 4 heads, 4 key/value heads so SP4 divides both) and one packed row."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_mca.models.hf_attention import register

    register()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         attn_implementation="hpc_mca_packed")
    model = LlamaForCausalLM(config).eval()  # eval: no dropout; gradients still flow
    gen = torch.Generator().manual_seed(seed + 1)
    docs = [torch.randint(1, 97, (n,), generator=gen) for n in LENGTHS]
    labels = [torch.cat([d[1:], torch.tensor([-100])]) for d in docs]  # next token in the doc
    return {"model": model, "input_ids": torch.cat(docs)[None], "labels": torch.cat(labels)[None],
            "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None]}


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = labels.flatten()
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), flat, ignore_index=-100,
                                              reduction="sum")
    return total, (flat != -100).sum()


def main(sp: int, out: Path) -> None:
    from hpc_mca.runtime.sequence_parallel import (
        gather_and_unpad,
        new_sequence_parallel_groups,
        slice_and_pad,
    )

    dist.init_process_group("gloo")
    group = new_sequence_parallel_groups(sp)
    case = sp_case()
    model = case["model"]
    part = slice_and_pad(case["input_ids"], case["position_ids"], case["labels"])
    logits = model(input_ids=part.input_ids, position_ids=part.position_ids).logits
    total, count = loss_sum(logits, part.labels)
    sums = torch.stack([total.detach(), count.to(total)])
    dist.all_reduce(sums, group=group)
    (total / sums[1]).backward()  # each rank: its tokens' share of the row's mean loss
    for param in model.parameters():
        dist.all_reduce(param.grad, group=group)
    full = gather_and_unpad(logits.detach(), group, dim=1, pad=part.pad)
    torch.save({"logits": full, "loss": sums[0] / sums[1], "pad": part.pad,
                "grads": {n: p.grad for n, p in model.named_parameters()}},
               out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
