"""Bootstrap smoke: a tiny Megatron-Core GPT, a fixed batch, a few optimizer steps.

This is what ``hpc-mca smoke`` runs on every rank. It exercises the whole runtime (process
groups, model parallel state, seeds, CPU compatibility on CPU, DDP, the Megatron optimizer and
the pipeline schedule) and reports numbers that must not depend on the layout: for a fixed
global batch, the loss and the gradient norm of TP=2 x DP=2 equal those of one process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from hpc_mca.runtime.distributed import RankContext
from hpc_mca.topology import ModelShape


@dataclasses.dataclass(frozen=True)
class SmokeConfig:
    model: ModelShape
    seq_length: int = 32
    global_batch_size: int = 8
    micro_batch_size: int = 1
    steps: int = 1
    lr: float = 1e-3
    distributed_optimizer: bool = False
    """Shard optimizer state over DP ranks (Megatron's DistributedOptimizer)."""
    data_seed: int = 20251121
    """Seed of the token batch; identical on every rank so every layout sees the same data."""


def hf_config(shape: ModelShape, seq_length: int) -> dict[str, Any]:
    """An HF ``config.json`` dict for the shape: Llama, or Mixtral when it has experts."""
    config: dict[str, Any] = {
        "model_type": "mixtral" if shape.is_moe else "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.expert_ffn_hidden_size if shape.is_moe else shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": seq_length,
        "tie_word_embeddings": shape.tie_word_embeddings,
    }
    if shape.is_moe:
        config.update(num_local_experts=shape.num_experts, num_experts_per_tok=shape.moe_router_topk,
                      sliding_window=None)
    return config


def build_tiny_gpt(shape: ModelShape, seq_length: int, ctx: RankContext) -> list[torch.nn.Module]:
    """This rank's model chunks, randomly initialised through the model layer (identical
    initial weights for every TP size: see ``hpc_mca.models.build``)."""
    from hpc_mca.models.build import build_model

    overrides = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    if shape.is_moe:
        overrides["moe_aux_loss_coeff"] = 1e-2
    # No vocabulary padding: padding to a multiple of 128·TP would change the embedding's shape,
    # and so the random stream every later weight is drawn from, with the TP size.
    return build_model(hf_config(shape, seq_length), ctx, seq_length=seq_length, load_weights=False,
                       make_vocab_size_divisible_by=1, config_overrides=overrides)


def fixed_batch(cfg: SmokeConfig) -> torch.Tensor:
    """The global batch of token ids [global_batch, seq+1]: inputs and shifted labels."""
    gen = torch.Generator().manual_seed(cfg.data_seed)
    return torch.randint(0, cfg.model.vocab_size, (cfg.global_batch_size, cfg.seq_length + 1), generator=gen)


def _microbatches(tokens: torch.Tensor, cfg: SmokeConfig, ctx: RankContext) -> list[dict[str, torch.Tensor]]:
    from megatron.core import parallel_state

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_dp = cfg.global_batch_size // dp
    local = tokens[dp_rank * per_dp : (dp_rank + 1) * per_dp].to(ctx.device)
    positions = torch.arange(cfg.seq_length, device=ctx.device).expand(cfg.micro_batch_size, -1)
    return [
        {"input_ids": mb[:, :-1], "labels": mb[:, 1:], "position_ids": positions}
        for mb in local.split(cfg.micro_batch_size)
    ]


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
                  ) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
    batch = next(data_iterator)
    per_token = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output.float().mean()
        # The schedule divides the returned loss in place by num_microbatches: log a copy.
        return loss, {"loss": loss.detach().clone()}

    return per_token, loss_func


def run_smoke(cfg: SmokeConfig, ctx: RankContext) -> list[dict[str, Any]]:
    """Train ``cfg.steps`` steps on the fixed batch; return per-step loss and grad norm (every
    rank returns the same values: losses are averaged over micro-batches and DP ranks)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hpc_mca.config.sections import ParallelArguments
    from hpc_mca.trainer.trainer import build_optimizer, wrap_ddp

    num_micro = cfg.global_batch_size // (cfg.micro_batch_size * ctx.layout.dp)
    chunks = build_tiny_gpt(cfg.model, cfg.seq_length, ctx)
    # The trainer's builders: Megatron DDP (gradients cross DP only through its
    # finalize_model_grads hook) and Megatron's optimizer.
    model = wrap_ddp(chunks, ParallelArguments(use_distributed_optimizer=cfg.distributed_optimizer))
    optimizer = build_optimizer(model, OptimizerConfig(
        optimizer="adam", lr=cfg.lr, clip_grad=0.0,
        use_distributed_optimizer=cfg.distributed_optimizer))
    forward_backward = get_forward_backward_func()
    tokens = fixed_batch(cfg)
    results = []
    for step in range(cfg.steps):
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        batches = _microbatches(tokens, cfg, ctx)
        iterators: Any = [iter(batches) for _ in model] if len(model) > 1 else iter(batches)
        losses = forward_backward(
            forward_step_func=_forward_step, data_iterator=iterators, model=model,
            num_microbatches=num_micro, seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size, forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        loss = _reduce_loss(losses, ctx)
        results.append({"step": step + 1, "loss": loss, "grad_norm": float(grad_norm)})
    return results


def _reduce_loss(losses: list[dict[str, torch.Tensor]], ctx: RankContext) -> float:
    """Mean over micro-batches on the last pipeline stage and over DP ranks, then broadcast
    from the last stage so every rank reports the same number."""
    from megatron.core import parallel_state

    value = torch.zeros(1, dtype=torch.float64, device=ctx.device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        value += torch.stack([x["loss"] for x in losses]).double().mean()
        dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
        value /= parallel_state.get_data_parallel_world_size()
    # Ranks not on the last stage contributed 0; a sum over the pipeline group delivers it.
    dist.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
    return float(value.item())
