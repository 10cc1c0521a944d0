"""``hpc-mca smoke``: bootstrap check run by every rank (srun, torchrun or a single process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from hpc_mca.topology import Layout
    from hpc_mca.trainer.smoke import SmokeConfig


@click.command()
@click.option("--tp", "tp", default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", "pp", default=1, show_default=True, help="Pipeline-parallel size.")
@click.option("--vp", "vp", default=None, type=int, help="Virtual pipeline chunks per PP rank.")
@click.option("--ep", "ep", default=1, show_default=True, help="Expert-parallel size (MoE).")
@click.option("--experts", default=0, show_default=True, help="Routed experts per MoE layer (0 = dense).")
@click.option("--topk", default=2, show_default=True, help="Experts per token (MoE).")
@click.option("--distributed-optimizer/--no-distributed-optimizer", default=False, show_default=True)
@click.option("--layers", default=2, show_default=True)
@click.option("--hidden", default=64, show_default=True)
@click.option("--heads", default=4, show_default=True)
@click.option("--kv-heads", default=None, type=int, help="KV heads (GQA); default = heads.")
@click.option("--vocab", default=128, show_default=True)
@click.option("--seq-length", default=32, show_default=True)
@click.option("--global-batch-size", default=8, show_default=True)
@click.option("--micro-batch-size", default=1, show_default=True)
@click.option("--steps", default=1, show_default=True)
@click.option("--seed", default=1234, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Rank 0 writes the results here as JSON.")
def smoke(tp: int, pp: int, vp: int | None, ep: int, experts: int, topk: int,
          distributed_optimizer: bool, layers: int, hidden: int, heads: int, kv_heads: int | None,
          vocab: int, seq_length: int, global_batch_size: int, micro_batch_size: int, steps: int,
          seed: int, out: Path | None) -> None:
    """Train a tiny Megatron-Core GPT on a fixed batch and print loss and grad norm per step.

    The numbers depend only on the model, the batch and the seed, not on TP/DP: compare a
    multi-rank run against a single process to check a cluster's setup.
    """
    from hpc_mca.runtime.quiet import quiet_library_noise

    quiet_library_noise()  # before megatron is imported
    from hpc_mca.runtime.env import from_environ
    from hpc_mca.topology import Layout, LayoutError, ModelShape, check_layout

    try:
        shape = ModelShape(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                           num_query_groups=kv_heads or heads, ffn_hidden_size=4 * hidden,
                           vocab_size=vocab, num_experts=experts, moe_router_topk=topk if experts else 0)
        layout = Layout(tp=tp, pp=pp, vp=vp, ep=ep)
        # Validate before importing torch: every rank fails within a fraction of a second and
        # alone, before any rendezvous (init_distributed checks again, for library callers).
        violations = check_layout(layout, from_environ().world_size, shape,
                                  global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
        if violations:
            raise LayoutError(violations)
    except LayoutError as err:
        click.echo(f"hpc-mca smoke: error: {'; '.join(err.violations)}", err=True)
        sys.exit(2)
    from hpc_mca.trainer.smoke import SmokeConfig

    cfg = SmokeConfig(model=shape, seq_length=seq_length, global_batch_size=global_batch_size,
                      micro_batch_size=micro_batch_size, steps=steps, distributed_optimizer=distributed_optimizer)
    _run(cfg, layout, seed, out)


def _run(cfg: SmokeConfig, layout: Layout, seed: int, out: Path | None) -> None:
    from hpc_mca.runtime.distributed import init_distributed, shutdown
    from hpc_mca.trainer.smoke import run_smoke

    ctx = init_distributed(layout, model=cfg.model, seed=seed, global_batch_size=cfg.global_batch_size,
                           micro_batch_size=cfg.micro_batch_size)
    try:
        results = run_smoke(cfg, ctx)
    finally:
        shutdown()
    if ctx.is_main:
        layout_out = {"tp": ctx.layout.tp, "pp": ctx.layout.pp, "vp": ctx.layout.vp, "ep": ctx.layout.ep,
                      "dp": ctx.layout.dp}
        summary = {"world_size": ctx.env.world_size, "launcher": ctx.env.launcher, "backend": ctx.backend,
                   "layout": layout_out, "steps": results}
        click.echo(json.dumps(summary))
        if out is not None:
            out.write_text(json.dumps(summary, indent=1))
