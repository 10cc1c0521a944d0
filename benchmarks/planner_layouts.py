"""The planner against published H100 runs: the calibration table of the step-time estimate.

For each run below (its layout and measured throughput as its team published them) the table
gives our estimate of that layout's throughput under the run's own settings, the planner's own
pick for the same job under the same settings, and the two estimates' ratio:

* estimate / published: the cost model's absolute error (acceptance: within ±25%);
* published / pick: how much faster the planner thinks its own pick is than what the team
  measured to be their best (acceptance: at most 5% apart, or the planner picks it).

Precision is the run's: FP8 runs are estimated at fp8 (Transformer Engine current scaling, FP8
GEMMs at FP8_GEMM_SPEEDUP over bf16 except the LM head's, which Megatron-Core keeps bf16,
fp8-cast GEMM inputs kept for the backward) and BF16 runs at bf16; no figure is converted from
one precision to the other. Every run used Transformer Engine (its layers: norms fused into
the linears of dense layers, grouped-GEMM experts; CP attention on its p2p ring), the
distributed optimizer with overlapped gradient reduce and parameter gather, bf16 gradient
buffers, interleaved pipelines' sends overlapped with compute, activation recompute only where
noted (the zoo's runs that recompute norms and the MoE activation), and, where noted, TE's TP
communication overlap, Megatron's MoE all-to-all overlap or a flex MoE dispatcher (DeepEP or
HybridEP). The pick may recompute what TE's layers can (selective parts, the fewest layers, or
all), whatever the run did.
This trainer has none of those and keeps fp32 gradients: the estimate assumes them for the run
(and for the pick it is compared with), never for a plan of hpc-mca's own. MoE runs are
estimated with balanced expert loads where the run forced them (or padded experts to a
capacity) and dropless where its scripts' default routing applies.

``calibrated`` runs are the ones the cost model was developed against (each constant also
cites its own source in topology/cost.py and topology/network.py); ``held back`` runs were
added in a commit before their first estimate and not used to change the model. Two rounds of
held-back runs became calibrated when they prompted a change, and so did round 5 (the
comments below say which and what they measured first); rounds 3 and 4 are still held back
(11 runs) but for one run of round 3, calibrated since it was read while finding a change.

Sources (H100 SXM, 8 GPUs a node):
  [dgxc]   NVIDIA/dgxc-benchmarking, DGX Cloud benchmark recipes v25.04 (commit 741c886) and
           v25.05 (60d6fd3), Grok-1 also v25.05.02 (dfc8039): step time and aggregate tokens/s
           (per GPU = aggregate / GPUs).
  [bridge] NVIDIA-NeMo/Megatron-Bridge docs/performance-summary(-archive).md, the 25.11 and
           26.04.01 NeMo containers' DGX-H100 tables (tokens/s/GPU), and the perf recipes
           behind them (scripts/performance/configs/*, recompute none, overlaps as noted).
  [mz]     yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md at 020b8136 (NVIDIA's
           Megatron-Core MoE team): Qwen3-235B on 256 H100s, BF16, step times; the two EP32
           runs and the A2A EP8 run recompute norms and the MoE activation ("norm, act"),
           estimated so (selective:layernorm,moe_act); the TP4 EP8 run recomputes nothing.
           Its scripts route dropless unless --moe-router-force-load-balancing is added: the
           EP32 runs' published commands add it (run_235b.sh, run_h100_235b.sh), the EP8 runs'
           commands are not published, so they are estimated dropless (the scripts' default).
           Its long-context table measures TP4 EP8 runs dropless 1.25x (seq 16K) to 1.09x
           (128K) slower than forced balance: the four pairs that fit the spread of expert
           loads of topology/routing.py (each reproduced within 2%, tests/test_moe_routing.py).
  [bridge] (A/B) Megatron-Bridge at 067f987d skills/nemo-mbridge-perf-moe-comm-overlap: a
           matched A/B of EP overlap on 16 H100s (force-balanced, CUDA graphs on the router).
  [nemo]   NVIDIA/NeMo docs/source/performance/performance_summary.md at 8e3d65dcfe, the
           NeMo 24.07 container's DGX-H100 FP8 pre-training table (tokens/s/GPU); the settings
           behind its rows from NVIDIA/NeMo-Framework-Launcher at tag 24.07 (8325688d).

Usage:
    .venv/bin/python benchmarks/planner_layouts.py
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_mca.topology import Layout, LayoutError, ModelShape, plan
from hpc_mca.topology.hardware import GiB


def _dense(name: str, layers: int, hidden: int, heads: int, groups: int, ffn: int, vocab: int,
           gated: bool = True) -> ModelShape:
    """A dense decoder's shape as its public config gives it (gated: SwiGLU; else GeLU or
    squared ReLU, two MLP matrices)."""
    return ModelShape(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      num_query_groups=groups, ffn_hidden_size=ffn, vocab_size=vocab,
                      gated_linear_unit=gated, name=name)


LLAMA3_8B = _dense("Llama3.1-8B", 32, 4096, 32, 8, 14336, 128256)
LLAMA3_70B = _dense("Llama3.1-70B", 80, 8192, 64, 8, 28672, 128256)
LLAMA31_405B = _dense("Llama3.1-405B", 126, 16384, 128, 8, 53248, 128256)
LLAMA2_7B = _dense("Llama2-7B", 32, 4096, 32, 32, 11008, 32000)
LLAMA2_13B = _dense("Llama2-13B", 40, 5120, 40, 40, 13824, 32000)
LLAMA2_70B = _dense("Llama2-70B", 80, 8192, 64, 8, 28672, 32000)
GPT3_5B = _dense("GPT3-5B", 24, 4096, 32, 32, 16384, 50304, gated=False)
GPT3_20B = _dense("GPT3-20B", 44, 6144, 48, 48, 24576, 50304, gated=False)
GPT3_175B = _dense("GPT3-175B", 96, 12288, 96, 96, 49152, 51200, gated=False)
NEMOTRON4_15B = _dense("Nemotron4-15B", 32, 6144, 48, 8, 24576, 256000, gated=False)
QWEN3_30B_A3B = ModelShape(num_layers=48, hidden_size=2048, num_attention_heads=32,
                           num_query_groups=4, head_dim=128, ffn_hidden_size=6144,
                           vocab_size=151936, num_experts=128, moe_ffn_hidden_size=768,
                           moe_router_topk=8, name="Qwen3-30B-A3B")
QWEN3_235B_A22B = ModelShape(num_layers=94, hidden_size=4096, num_attention_heads=64,
                             num_query_groups=4, head_dim=128, ffn_hidden_size=12288,
                             vocab_size=151936, num_experts=128, moe_ffn_hidden_size=1536,
                             moe_router_topk=8, name="Qwen3-235B-A22B")

# Grok-1 as NVIDIA's DGX Cloud recipes benchmark it: 8 gated experts, top-2, Llama-3's tokenizer.
GROK1_314B = ModelShape(num_layers=64, hidden_size=6144, num_attention_heads=48, num_query_groups=8,
                        head_dim=128, ffn_hidden_size=32768, vocab_size=128256, num_experts=8,
                        moe_ffn_hidden_size=32768, moe_router_topk=2, name="Grok-1-314B")


@dataclass(frozen=True)
class PublishedRun:
    """One published training run: what its team ran and measured."""

    model: ModelShape
    gpus: int
    seq_length: int
    global_batch_size: int
    layout: Layout
    precision: str
    """bf16, or fp8 (Transformer Engine current scaling) as published."""
    tokens_per_gpu: float
    """Measured training tokens per second per GPU."""
    source: str
    micro_batch_size: int = 1
    tp_comm_overlap: bool = False
    """The run overlapped TP communication with GEMMs (TE userbuffers)."""
    moe_comm_overlap: bool = False
    """The run overlapped MoE all-to-alls with compute (overlap_moe_expert_parallel_comm)."""
    moe_dispatcher: str = "alltoall"
    """alltoall, or flex (DeepEP/HybridEP: one copy of a token per destination node)."""
    moe_routing: str = "balanced"
    """balanced (forced load balancing, or a capacity factor that pads every expert), or
    dropless (each expert gets what its router sends: the busiest rank waits on more)."""
    stage: str = "pt"
    lora: bool = False
    """LoRA fine-tuning (rank 32 on every linear layer, Megatron-Bridge's default)."""
    recompute: str = "none"
    """Activation recompute as published, in the planner's names (topology/memory.py)."""
    held_back: bool = False
    """Not used to choose any constant of the cost model: the check."""

    @property
    def name(self) -> str:
        what = "LoRA" if self.lora else self.stage.upper()
        return (f"{self.model.name} {what} {self.precision.upper()} {self.gpus} GPUs "
                f"seq {self.seq_length}")

    def job(self) -> dict:
        """plan()'s arguments for this run's job under its own settings (layout not forced)."""
        return dict(model=self.model, nodes=self.gpus // 8, seq_length=self.seq_length,
                    global_batch_size=self.global_batch_size, precision=self.precision,
                    cp_comm_type="p2p", overlap_param_gather=True, grad_reduce_in_fp32=False,
                    overlap_p2p_comm=True, te_layers=True,
                    tp_comm_overlap=self.tp_comm_overlap, moe_comm_overlap=self.moe_comm_overlap,
                    moe_dispatcher=self.moe_dispatcher, moe_routing=self.moe_routing,
                    stage=self.stage, lora=self.lora, lora_rank=32)


NORM_AND_ACT = "selective:layernorm,moe_act"
"""The MoE model zoo's recompute ("norm, act" in its table; --recompute-modules moe_act
layernorm in its EP32 commands)."""

RUNS = [
    # --- calibrated ---
    PublishedRun(LLAMA3_8B, 8, 8192, 128, Layout(cp=2), "bf16", 85459 / 8,
                 "[dgxc] v25.04 Llama 3.1 8B BF16, 12.27 s a step"),
    PublishedRun(LLAMA3_70B, 64, 8192, 128, Layout(tp=4, pp=4, cp=2, vp=5), "bf16", 71526 / 64,
                 "[dgxc] v25.04 Llama 3.1 70B BF16, 14.66 s a step", tp_comm_overlap=True),
    PublishedRun(LLAMA3_70B, 64, 8192, 128, Layout(tp=4, pp=8, vp=5), "fp8", 1602,
                 "[bridge] 25.11 LLAMA3_70B FP8-CS", tp_comm_overlap=True),
    PublishedRun(QWEN3_235B_A22B, 256, 4096, 2048, Layout(tp=2, pp=8, vp=4, ep=32), "fp8", 1575,
                 "[bridge] 25.11 Qwen3_235B_a22B FP8-CS (dropless, force-balanced)",
                 moe_comm_overlap=True),
    PublishedRun(LLAMA31_405B, 512, 8192, 256, Layout(tp=8, pp=8, cp=2, vp=8), "bf16",
                 106024 / 512, "[dgxc] v25.04 Llama 3.1 405B BF16, 19.78 s a step",
                 tp_comm_overlap=True),
    PublishedRun(LLAMA31_405B, 1024, 8192, 512, Layout(tp=8, pp=8, cp=2, vp=8), "fp8", 292,
                 "[bridge] 25.11 LLAMA3.1_405B FP8-CS", tp_comm_overlap=True),
    PublishedRun(GPT3_175B, 128, 2048, 256, Layout(tp=4, pp=8, vp=6), "bf16", 63099 / 128,
                 "[dgxc] v25.04 GPT-3 175B BF16, 8.309 s a step", tp_comm_overlap=True),
    PublishedRun(NEMOTRON4_15B, 16, 4096, 64, Layout(tp=2), "bf16", 95463 / 16,
                 "[dgxc] v25.05 Nemotron4 15B BF16, 2.746 s a step", micro_batch_size=2,
                 tp_comm_overlap=True),
    PublishedRun(QWEN3_30B_A3B, 16, 4096, 1024, Layout(ep=16), "fp8", 8960,
                 "[bridge] 26.04.01 Qwen3_30B_a3B FP8-CS (HybridEP dispatcher)",
                 moe_dispatcher="flex"),
    # Held back in round 1 (first estimated with the model of commit fb81a38: 5 of 7 within 5%
    # of the pick, Llama2-13B 1.177 and Llama2-70B 1.081, the deepest interleavings); their
    # teams' runs overlap interleaved p2p (Megatron-LM's default), which the estimate now
    # models, so they count as calibrated since.
    PublishedRun(LLAMA2_7B, 8, 4096, 128, Layout(), "fp8", 16934,
                 "[nemo] 24.07 LLAMA2-7B FP8"),
    PublishedRun(LLAMA2_13B, 16, 4096, 128, Layout(pp=4, vp=10), "fp8", 8715,
                 "[nemo] 24.07 LLAMA2-13B FP8"),
    PublishedRun(LLAMA2_70B, 64, 4096, 128, Layout(tp=4, pp=4, vp=20), "fp8", 1728,
                 "[nemo] 24.07 LLAMA2-70B FP8", tp_comm_overlap=True),
    PublishedRun(LLAMA3_8B, 8, 8192, 128, Layout(cp=2), "fp8", 12273,
                 "[nemo] 24.07 LLAMA3-8B FP8"),
    PublishedRun(LLAMA3_70B, 64, 8192, 128, Layout(tp=4, pp=4, cp=2, vp=5), "fp8", 1524,
                 "[nemo] 24.07 LLAMA3-70B FP8", tp_comm_overlap=True),
    PublishedRun(GPT3_175B, 128, 2048, 256, Layout(tp=4, pp=8, vp=6), "fp8", 716,
                 "[nemo] 24.07 GPT3-175B FP8", tp_comm_overlap=True),
    PublishedRun(NEMOTRON4_15B, 16, 4096, 64, Layout(tp=2), "fp8", 131863 / 16,
                 "[dgxc] v25.05 Nemotron4 15B FP8, 1.988 s a step", micro_batch_size=2,
                 tp_comm_overlap=True),
    # Held back in round 2 (first estimated with the model of commit a1b809f: 8 of 9 within
    # ±25% and 8 of 9 within 5% of the pick; GPT3-20B 0.67 and 1.45, its DP32 across 8 nodes
    # charged as if each GPU had one NIC's bandwidth); NCCL's rings drive one NIC per group
    # member in a node, which the estimate now models, so they count as calibrated since.
    PublishedRun(GPT3_5B, 64, 2048, 2048, Layout(), "fp8", 23406, "[nemo] 24.07 GPT3-5B FP8",
                 micro_batch_size=4),
    # TP overlap per the launcher's conf/training/gpt3/20b.yaml at tag 24.07
    # (ub_tp_comm_overlap: True); first estimated without it (1.085 of the pick).
    PublishedRun(GPT3_20B, 64, 2048, 256, Layout(tp=2), "fp8", 5851,
                 "[nemo] 24.07 GPT3-20B FP8", micro_batch_size=2, tp_comm_overlap=True),
    PublishedRun(GPT3_175B, 512, 2048, 2048, Layout(tp=4, pp=8, vp=6), "fp8", 825,
                 "[nemo] 24.07 GPT3-175B FP8 (512 GPUs)", micro_batch_size=2,
                 tp_comm_overlap=True),
    PublishedRun(LLAMA3_8B, 8, 8192, 128, Layout(cp=2), "fp8", 112388 / 8,
                 "[dgxc] v25.04 Llama 3.1 8B FP8, 9.33 s a step"),
    PublishedRun(LLAMA31_405B, 2048, 8192, 1024, Layout(tp=8, pp=8, cp=2, vp=8), "fp8",
                 667883 / 2048, "[dgxc] v25.04 Llama 3.1 405B FP8 (2048 GPUs), 12.56 s a step",
                 tp_comm_overlap=True),
    PublishedRun(LLAMA3_70B, 32, 4096, 32, Layout(tp=4, pp=4, vp=5), "bf16", 39009 / 32,
                 "[dgxc] v25.04 Llama 3 70B SFT BF16 (packed), 3.36 s a step", stage="sft",
                 tp_comm_overlap=True),
    PublishedRun(LLAMA3_70B, 32, 4096, 32, Layout(tp=4, pp=4, vp=5), "fp8", 1638,
                 "[bridge] 26.06 (SFT) LLAMA3_70B FP8 (packed)", stage="sft",
                 tp_comm_overlap=True),
    PublishedRun(LLAMA3_70B, 8, 4096, 32, Layout(tp=2, pp=4, vp=20), "bf16", 14375 / 8,
                 "[dgxc] v25.04 Llama 3 70B LoRA BF16 (packed), 9.118 s a step", stage="sft",
                 lora=True),
    PublishedRun(LLAMA3_70B, 8, 4096, 32, Layout(tp=2, pp=4, vp=20), "fp8", 2643,
                 "[bridge] 26.06 (LoRA) LLAMA3_70B FP8 (packed)", stage="sft", lora=True),
    # --- held back (round 3): first estimated after every constant above was fixed ---
    PublishedRun(LLAMA3_8B, 128, 8192, 2048, Layout(cp=2), "bf16", 1360683 / 128,
                 "[dgxc] v25.04 Llama 3.1 8B BF16 (128 GPUs), 12.33 s a step", held_back=True),
    PublishedRun(LLAMA3_70B, 2048, 8192, 4096, Layout(tp=4, pp=4, cp=2, vp=5), "bf16",
                 2288843 / 2048, "[dgxc] v25.04 Llama 3.1 70B BF16 (2048 GPUs), 14.66 s a step",
                 tp_comm_overlap=True, held_back=True),
    # Calibrated since: its estimate's breakdown was read when the LM head's precision was
    # found (bf16 in an FP8 run, topology/cost.py). Held back until then: 0.93 of its
    # measurement, published layout 1.050x the pick's step; after, 0.89 and 1.071.
    PublishedRun(LLAMA3_70B, 2048, 8192, 4096, Layout(tp=4, pp=8, vp=5), "fp8", 3305855 / 2048,
                 "[dgxc] v25.04 Llama 3.1 70B FP8 (2048 GPUs), 10.15 s a step",
                 tp_comm_overlap=True),
    PublishedRun(LLAMA31_405B, 2048, 8192, 1024, Layout(tp=8, pp=8, cp=2, vp=8), "bf16",
                 422175 / 2048, "[dgxc] v25.04 Llama 3.1 405B BF16 (2048 GPUs), 19.87 s a step",
                 tp_comm_overlap=True, held_back=True),
    PublishedRun(LLAMA2_7B, 8, 4096, 32, Layout(), "fp8", 24824,
                 "[nemo] 24.07 LLAMA2-7B LoRA FP8 (packed)", stage="sft", lora=True,
                 held_back=True),
    PublishedRun(LLAMA2_13B, 8, 4096, 32, Layout(), "fp8", 14629,
                 "[nemo] 24.07 LLAMA2-13B LoRA FP8 (packed)", stage="sft", lora=True,
                 held_back=True),
    PublishedRun(LLAMA2_70B, 8, 4096, 32, Layout(tp=2, pp=4), "fp8", 2621,
                 "[nemo] 24.07 LLAMA2-70B LoRA FP8 (packed)", stage="sft", lora=True,
                 held_back=True),
    PublishedRun(LLAMA2_7B, 8, 4096, 32, Layout(), "fp8", 16891,
                 "[nemo] 24.07 LLAMA2-7B SFT FP8 (packed)", stage="sft", held_back=True),
    # The table prints no VP; the launcher's examples/peft/llama/h100/13b_1node.sh at tag
    # 24.07 runs VP10. Round 3 first estimated it without (0.77, 1.152 of the pick).
    PublishedRun(LLAMA2_13B, 8, 4096, 32, Layout(pp=4, vp=10), "fp8", 10176,
                 "[nemo] 24.07 LLAMA2-13B SFT FP8 (packed)", stage="sft", held_back=True),
    # --- held back (round 4): the 26.04.01 container's runs of three layouts above at their
    # later global batches, added before the MoE dispatch and expert-kernel costs were
    # first estimated on them ---
    PublishedRun(LLAMA3_70B, 64, 8192, 256, Layout(tp=4, pp=8, vp=5), "fp8", 1664,
                 "[bridge] 26.04.01 LLAMA3_70B FP8", tp_comm_overlap=True, held_back=True),
    PublishedRun(LLAMA31_405B, 1024, 8192, 1536, Layout(tp=8, pp=8, cp=2, vp=8), "fp8", 328,
                 "[bridge] 26.04.01 LLAMA3.1_405B FP8", tp_comm_overlap=True, held_back=True),
    PublishedRun(QWEN3_235B_A22B, 256, 4096, 8192, Layout(tp=2, pp=8, vp=4, ep=32), "fp8", 1712,
                 "[bridge] 26.04.01 Qwen3_235B_a22B FP8 (dropless, force-balanced)",
                 moe_comm_overlap=True, held_back=True),
    # --- calibrated (round 4): MoE runs whose dispatcher and overlap are published beside the
    # step time, read while the dispatch and expert-kernel costs were written ---
    PublishedRun(QWEN3_30B_A3B, 16, 4096, 1024, Layout(ep=16), "bf16", 1024 * 4096 / 16 / 24.7138,
                 "[bridge] Qwen3-30B-A3B BF16 EP16 HybridEP, EP overlap off: 24.714 s a step "
                 "(matched A/B)", moe_dispatcher="flex"),
    PublishedRun(QWEN3_30B_A3B, 16, 4096, 1024, Layout(ep=16), "bf16", 1024 * 4096 / 16 / 20.9920,
                 "[bridge] Qwen3-30B-A3B BF16 EP16 HybridEP, EP overlap on: 20.992 s a step "
                 "(matched A/B)", moe_dispatcher="flex", moe_comm_overlap=True),
    PublishedRun(QWEN3_235B_A22B, 256, 4096, 2048, Layout(tp=2, pp=8, vp=4, ep=32), "bf16",
                 2048 * 4096 / 256 / 19.7, "[mz] Qwen3-235B BF16 DeepEP EP32: 19.7 s a step",
                 moe_dispatcher="flex", recompute=NORM_AND_ACT),
    PublishedRun(QWEN3_235B_A22B, 256, 4096, 2048, Layout(tp=2, pp=8, vp=4, ep=32), "bf16",
                 2048 * 4096 / 256 / 17.6, "[mz] Qwen3-235B BF16 DeepEP EP32, 1F1B A2A overlap: "
                 "17.6 s a step", moe_dispatcher="flex", moe_comm_overlap=True,
                 recompute=NORM_AND_ACT),
    # The zoo's in-node EP8 runs (this and the last row) were first estimated with balanced
    # routing at 1.39 (later 1.36) and 1.26; their commands are not published, and the zoo's
    # scripts route dropless unless told otherwise, so they are estimated dropless since the
    # routing model (fitted to the zoo's long-context pairs, not to these rows).
    PublishedRun(QWEN3_235B_A22B, 256, 4096, 2048, Layout(tp=4, pp=8, vp=4, ep=8), "bf16",
                 2048 * 4096 / 256 / 29.0, "[mz] Qwen3-235B BF16 DeepEP TP4 EP8: 29.0 s a step",
                 moe_dispatcher="flex", moe_routing="dropless"),
    # --- calibrated since (round 5, held back until its first estimate in commit daccbab):
    # NVIDIA's DGX Cloud Grok-1 runs (all-to-all dispatcher, capacity factor 1 padded, so
    # balanced expert loads; TP overlap; no EP overlap). v25.04 (741c886) ran NeMo 24.12;
    # v25.05.02 (dfc8039) NeMo 2 on 25.04. Expert TP: v25.05.02's table gives ETP 1; v25.04's
    # recipe (grok1/cfg/grok1_314b.yaml, configure.sh) sets none, so NeMo 24.12
    # (megatron_init.py) and Megatron-Core 0.10 (parallel_state.initialize_model_parallel) took
    # ETP = TP = 4. First estimated as ETP 1 throughout (v25.04 BF16 1.20-1.21, FP8 1.37-1.39;
    # NeMo 2 0.91, 1.08; all 8 within 5% of the pick). Reading the recipe's ETP led to two
    # changes: expert GEMM rows split by sequence parallelism when ETP < TP, and the ETP
    # all-gather of a dispatch (topology/cost.py, network.py). v25.04 also ran flash-attn
    # rather than cuDNN attention (NVTE_FUSED_ATTN=0), ~4% of this model's FLOPs, not modelled.
    *(PublishedRun(GROK1_314B, gpus, 8192, 2 * gpus,
                   Layout(tp=4, pp=8, cp=2, vp=8, ep=8, etp=etp),
                   precision, tokens / gpus, f"[dgxc] {source}", tp_comm_overlap=True)
      for gpus, precision, etp, tokens, source in (
          (512, "bf16", 4, 399191, "v25.04 Grok 1 314b BF16 (512 GPUs), 21.01 s a step"),
          (512, "fp8", 4, 496367, "v25.04 Grok 1 314b FP8 (512 GPUs), 16.90 s a step"),
          (1024, "bf16", 4, 791378, "v25.04 Grok 1 314b BF16 (1024 GPUs), 21.20 s a step"),
          (1024, "fp8", 4, 981295, "v25.04 Grok 1 314b FP8 (1024 GPUs), 17.01 s a step"),
          (2048, "bf16", 4, 1576065, "v25.04 Grok 1 314b BF16 (2048 GPUs), 21.29 s a step"),
          (2048, "fp8", 4, 1939562, "v25.04 Grok 1 314b FP8 (2048 GPUs), 17.30 s a step"),
          (512, "bf16", 1, 526493,
           "v25.05.02 Grok1 314b BF16 (512 GPUs, NeMo 2), 15.933 s a step"),
          (512, "fp8", 1, 624478,
           "v25.05.02 Grok1 314b FP8 (512 GPUs, NeMo 2), 13.433 s a step"),
      )),
    # --- calibrated (added after its first estimate was seen): the zoo's in-node EP8 run of the
    # same Qwen3-235B job with the all-to-all dispatcher, 3 layer-chunks a stage. Its scripts
    # count the embedding and the loss as pipeline layers (--account-for-embedding-in-pipeline-
    # split, --account-for-loss-in-pipeline-split): 96 chunks of one, the first and last empty.
    # It recomputes norms and the MoE activation, as the EP32 runs. The zoo's other in-node
    # EP8 run (Megatron-FSDP, full recompute, 17.6 s) is left out: no FSDP in this model.
    PublishedRun(QWEN3_235B_A22B, 256, 4096, 2048,
                 Layout(tp=2, pp=32, vp=3, ep=8, pipeline_layout=(0,) + (1,) * 94 + (0,)),
                 "bf16", 2048 * 4096 / 256 / 24.2,
                 "[mz] Qwen3-235B BF16 A2A TP2 EP8 PP32 VP3: 24.2 s a step",
                 moe_routing="dropless", recompute=NORM_AND_ACT),
]


@dataclass(frozen=True)
class Row:
    run: PublishedRun
    published: object
    """The forced plan of the published layout (micro-batch and recompute as published)."""
    pick: object
    """The planner's own plan for the job under the run's settings."""
    fits: bool
    """Whether the published layout fits without recompute in our memory model."""

    @property
    def estimate_ratio(self) -> float:
        return self.published.tokens_per_second_per_gpu / self.run.tokens_per_gpu

    @property
    def pick_ratio(self) -> float:
        """Published layout's estimated step over the pick's (1.0: the same estimate)."""
        return self.published.step_time.total / self.pick.step_time.total


def measure(run: PublishedRun) -> Row:
    job = run.job()
    forced = dict(layout=run.layout, micro_batch_size=run.micro_batch_size,
                  recompute=run.recompute)
    try:
        published = plan(**job, **forced)
        fits = True
    except LayoutError:
        # Our memory model says it needs recompute; estimate it as published all the same.
        published = plan(**job, **forced, gpu_memory_gib=1000)
        fits = False
    return Row(run, published, plan(**job), fits)


def _fmt(p) -> str:
    return (f"{p.describe()} mbs{p.micro_batch_size}"
            + ("" if p.recompute == "none" else f" rc={p.recompute}"))


def summary(rows: list[Row]) -> list[str]:
    """The acceptance counts: estimates within ±25%, published layouts within 5% of the pick
    (or picked), and the same for the fastest published layout of each job (model, GPUs,
    sequence, precision, stage, batch), which a team's own slower layouts do not count against."""
    def close(row: Row) -> bool:
        return row.pick.layout == row.published.layout or abs(row.pick_ratio - 1) <= 0.05

    jobs: dict[tuple[str, int], Row] = {}
    for row in rows:
        key = (row.run.name, row.run.global_batch_size)
        if key not in jobs or row.run.tokens_per_gpu > jobs[key].run.tokens_per_gpu:
            jobs[key] = row
    return [f"estimate within ±25% of the published throughput: "
            f"{sum(0.75 <= r.estimate_ratio <= 1.25 for r in rows)} of {len(rows)} runs",
            f"published layout within 5% of the pick, or picked: {sum(map(close, rows))} of "
            f"{len(rows)} runs",
            f"fastest published layout of each job within 5% of the pick, or picked: "
            f"{sum(map(close, jobs.values()))} of {len(jobs)} jobs"]


def main() -> None:
    print("H100-80GB; each run estimated as it ran: its precision, overlaps and recompute.")
    print("| run | set | published layout | GiB | published tok/s/GPU | estimate | ratio "
          "| planner's pick | pick's estimate | published/pick |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [measure(run) for run in RUNS]
    for row in rows:
        run, pub, pick = row.run, row.published, row.pick
        fit = "" if row.fits else " (needs recompute here)"
        print(f"| {run.name} | {'held back' if run.held_back else 'calibrated'} "
              f"| {_fmt(pub)}{fit} | {pub.memory.total / GiB:.1f} | {run.tokens_per_gpu:,.0f} "
              f"| {pub.tokens_per_second_per_gpu:,.0f} | {row.estimate_ratio:.2f} "
              f"| {_fmt(pick)} | {pick.tokens_per_second_per_gpu:,.0f} | {row.pick_ratio:.3f} |")
    for run in RUNS:
        print(f"{run.name}: {run.source}")
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
