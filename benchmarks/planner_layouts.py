"""The planner against published H100 layouts: memory, estimated step time, measured throughput.

For each public Megatron-Bridge / NeMo layout below, prints the layout as a forced plan (the
recompute and micro-batch it needs in this trainer's memory model) next to the planner's own
choice for the same job, both with per-GPU memory and estimated step time, and their ratio.
Where the source publishes a measured throughput (FP8 runs on DGX-H100), the estimate for the
published layout at that precision is set against it: the one check of the cost model's
absolute figure (its ranking is checked by tests/test_topology_*.py).

Sources: Megatron-Bridge docs/performance-summary.md (25.11 container, DGX-H100; Qwen3-30B
also its 25.09 token-dropping run) and its perf recipe list (Llama3-8B 16k: TP4 PP2 CP2 on 16
GPUs). The Qwen3 runs balance or drop tokens; the estimate assumes balanced routing and no
per-expert overheads beyond the GEMM share, so it reads high for fine-grained experts.

Usage:
    .venv/bin/python benchmarks/planner_layouts.py
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_mca.topology import Layout, LayoutError, ModelShape, Workload, get_gpu, plan
from hpc_mca.topology.cost import estimate_step_time

GiB = 1024**3

LLAMA3_8B = ModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32,
                       num_query_groups=8, ffn_hidden_size=14336, vocab_size=128256,
                       name="Llama3-8B")
LLAMA3_70B = ModelShape(num_layers=80, hidden_size=8192, num_attention_heads=64,
                        num_query_groups=8, ffn_hidden_size=28672, vocab_size=128256,
                        name="Llama3-70B")
LLAMA31_405B = ModelShape(num_layers=126, hidden_size=16384, num_attention_heads=128,
                          num_query_groups=8, ffn_hidden_size=53248, vocab_size=128256,
                          name="Llama3.1-405B")
QWEN3_30B_A3B = ModelShape(num_layers=48, hidden_size=2048, num_attention_heads=32,
                           num_query_groups=4, head_dim=128, ffn_hidden_size=6144,
                           vocab_size=151936, num_experts=128, moe_ffn_hidden_size=768,
                           moe_router_topk=8, name="Qwen3-30B-A3B (128 experts)")
QWEN3_235B_A22B = ModelShape(num_layers=94, hidden_size=4096, num_attention_heads=64,
                             num_query_groups=4, head_dim=128, ffn_hidden_size=12288,
                             vocab_size=151936, num_experts=128, moe_ffn_hidden_size=1536,
                             moe_router_topk=8, name="Qwen3-235B-A22B (128 experts)")


@dataclass(frozen=True)
class Published:
    model: ModelShape
    gpus: int
    seq_length: int
    global_batch_size: int
    layout: Layout
    tokens_per_gpu_fp8: float | None = None
    """Measured tokens/s per GPU of the FP8 run, where published."""
    micro_batch_size: int = 1
    """The published run's micro-batch (it used no activation recompute)."""


CASES = [
    Published(LLAMA3_8B, 16, 16384, 512, Layout(tp=4, pp=2, cp=2)),
    Published(LLAMA3_8B, 8, 8192, 128, Layout(), 14451),
    Published(LLAMA3_70B, 64, 8192, 128, Layout(tp=4, pp=8, vp=5), 1602),
    Published(LLAMA31_405B, 1024, 8192, 512, Layout(tp=8, pp=8, cp=2, vp=8), 292),
    # Dropless with forced balance (25.11); the 25.09 token-dropping run measured 10,494.
    Published(QWEN3_30B_A3B, 16, 4096, 512, Layout(pp=2, vp=24, ep=8), 5275, 2),
    Published(QWEN3_30B_A3B, 16, 4096, 512, Layout(pp=2, vp=24, ep=8), 10494, 2),
    Published(QWEN3_235B_A22B, 256, 4096, 2048, Layout(tp=2, pp=8, vp=4, ep=32), 1575),
]


def _cell(p) -> str:
    return (f"{p.layout.describe()} mbs{p.micro_batch_size} rc={p.recompute} "
            f"{p.memory.total / GiB:5.1f} GiB {p.step_time.total:7.2f} s")


def _fp8_ratio(case: Published, forced) -> str:
    if case.tokens_per_gpu_fp8 is None:
        return ""
    lay, mbs = forced.layout, case.micro_batch_size
    # As the published run: its micro-batch, no recompute, FP8 GEMMs.
    work = Workload(seq_length=case.seq_length, micro_batch_size=mbs,
                    num_microbatches=case.global_batch_size // (mbs * lay.dp), precision="fp8",
                    cp_comm_type="p2p")
    t = estimate_step_time(case.model, lay, work, get_gpu("H100-80GB"), 8)
    estimated = case.global_batch_size * case.seq_length / t.total / case.gpus
    return (f"  fp8: estimated {estimated:,.0f} vs measured {case.tokens_per_gpu_fp8:,.0f} "
            f"tokens/s/GPU ({estimated / case.tokens_per_gpu_fp8:.2f}x)")


def main() -> None:
    print("H100-80GB, bf16, usable 70.1 GiB (planner keeps 10% of it free)")
    for case in CASES:
        # The published runs use Transformer Engine, whose CP attention is the p2p ring.
        job = dict(model=case.model, nodes=case.gpus // 8, seq_length=case.seq_length,
                   global_batch_size=case.global_batch_size, cp_comm_type="p2p")
        head = (f"{case.model.name}, {case.gpus} GPUs, seq {case.seq_length}, "
                f"global batch {case.global_batch_size}")
        try:
            forced = plan(**job, layout=case.layout)
        except LayoutError as err:
            print(f"{head}\n  published: refused: {err}")
            continue
        own = forced.searched
        print(head)
        print(f"  published {_cell(forced)}")
        if own is None:
            print("  planner   no layout fits with headroom")
            continue
        ratio = own.step_time.total / forced.step_time.total
        print(f"  planner   {_cell(own)}  ({ratio:.2f}x the published estimate)")
        line = _fp8_ratio(case, forced)
        if line:
            print(line)


if __name__ == "__main__":
    main()
