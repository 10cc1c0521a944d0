"""Rank program of tests/test_recompute_modules.py: the bytes one forward of a tiny Llama
(Megatron's local layers, fused SwiGLU, float32) keeps for backward, for each
``recompute_modules`` choice.

``python tests/recompute_bytes_worker.py HIDDEN FFN LAYERS TOKENS`` prints
``{"none": bytes, "layernorm": bytes, "layernorm,mlp": bytes}``: the live storages that autograd
saved during the forward (weights left out; an output-discarding checkpoint's storage is empty
by the forward's end), each after a backward that checks the gradient is the same (within float32 rounding).
"""

from __future__ import annotations

import json
import sys

import torch


def saved_bytes(model: torch.nn.Module, tokens: int) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct non-empty storages saved for backward by one forward, and the
    embedding's gradient after the backward."""
    torch.manual_seed(1)
    ids, positions = torch.randint(0, 128, (1, tokens)), torch.arange(tokens)[None]
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(input_ids=ids, position_ids=positions, attention_mask=None)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in weights:
            live[storage.data_ptr()] = storage.nbytes()
    logits.float().square().mean().backward()
    return sum(live.values()), model.embedding.word_embeddings.weight.grad.clone()


def main(hidden: int, ffn: int, layers: int, tokens: int) -> None:
    from hpc_mca.models.build import build_model
    from hpc_mca.runtime.distributed import init_distributed
    from hpc_mca.topology import Layout

    config = dict(model_type="llama", hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=128, max_position_embeddings=256)
    ctx = init_distributed(Layout())
    out, grads = {}, {}
    for parts in ("none", "layernorm", "layernorm,mlp"):
        overrides = {"bias_activation_fusion": True}
        if parts != "none":
            overrides.update(recompute_granularity="selective", recompute_modules=parts.split(","))
        torch.manual_seed(0)
        model = build_model(config, ctx, config_overrides=overrides)[0]
        out[parts], grads[parts] = saved_bytes(model, tokens)
    assert all(torch.allclose(grads["none"], grad, rtol=1e-5, atol=1e-7) for grad in grads.values())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
