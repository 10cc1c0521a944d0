"""Estimated time of one training step for a layout: what the planner ranks layouts by.

An α-β model of one optimizer step, in seconds, on the slowest pipeline stage:

* compute: GEMM FLOPs at a share of the tensor-core peak that falls for narrow matrices
  (h/TP columns, few tokens per expert); attention at the fused kernel's lower share; and
  element-wise work (norms, SwiGLU, RoPE, residuals, the loss softmax) as HBM traffic over the
  tensors the memory model counts. Backward costs twice the forward GEMMs (input and weight
  gradients; LoRA's frozen weights need only the first) and 2.5 times the forward attention
  (flash attention recomputes the scores). Full recompute adds one forward of every layer,
  selective one of the attention core; DPO adds a forward of the reference model.
* tensor parallel: with sequence parallelism every layer all-gathers and reduce-scatters its
  activations twice a pass (4 collectives forward, 4 backward, 4 more with full recompute).
  This trainer does not overlap them (no TE userbuffers), so all of it is on the critical path.
* context parallel: ring attention passes each KV chunk on CP−1 times in the forward and KV
  plus its gradient in the backward; only what that chunk's attention cannot hide is exposed.
* expert parallel: the dispatch and combine all-to-alls of every routed token, 2 a pass.
* pipeline: micro-batches go at the pace of the slowest stage, the 1F1B warm-up and cool-down
  idle (PP−1)/VP micro-batch times, and every stage boundary sends activations forward and
  gradients back, VP times a micro-batch when interleaved.
* data parallel: fp32 gradients are all-reduced (reduce-scattered, plus a parameter
  all-gather, with the distributed optimizer). Megatron reduces them during the last
  micro-batch's backward when overlap_grad_reduce is on, so only what outlasts that backward
  (and at least the last bucket) is exposed.
* optimizer: Adam over this rank's shard, bound by HBM bandwidth.

A collective over n ranks costs (n−1)·α plus its per-rank volume over the NCCL bus bandwidth
of the slowest link it crosses, with ranks placed in Megatron's order (TP innermost, then CP,
then DP; PP outermost; the expert grid is ETP, EP, expert-DP).

Left out: kernel launch gaps, stragglers, MoE load imbalance (routing is taken as balanced),
packed documents' shorter attention (the full sequence is charged, an upper bound), P2P/compute
overlap. The figure is for ranking layouts against each other; benchmarks/planner_layouts.py
sets its absolute value against published throughputs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from hpc_mca.stages import get_stage

from .freeze import layer_ids_on_rank
from .hardware import GpuSpec
from .layout import Layout
from .memory import (
    Workload,
    busiest_ranks,
    frozen_trainable,
    layer_bytes_per_token,
    layers_on_rank,
    microbatch_tokens,
    mlp_matrices,
    mtp_on_rank,
    padded_vocab,
    stage_counts,
    weight_bytes,
)
from .model import ModelShape

# Share of the tensor-core peak a large bf16 GEMM sustains (cuBLAS on H100 reaches ~700 of
# 989 TFLOP/s on 8k×8k×8k).
GEMM_EFFICIENCY = 0.70
# The narrowest GEMM dimension at which that share halves: a 256-wide matrix (h/TP, or the
# tokens one expert gets) cannot fill the tensor cores' tiles and waves.
GEMM_HALF_WIDTH = 256
# Fused (flash) attention's share of the peak, and the unfused kernel's, which streams the
# s×s scores through HBM.
ATTENTION_EFFICIENCY = 0.45
UNFUSED_ATTENTION_EFFICIENCY = 0.10
# Query rows a kernel call needs to reach half of that share: context parallelism cuts each
# rank's sequence into 2·CP chunks and runs one call per ring step on a chunk.
ATTENTION_HALF_LENGTH = 256
# Flash attention's backward recomputes the scores: ~2.5× its forward FLOPs.
FLASH_BACKWARD_FACTOR = 2.5
# FP8 GEMMs (Transformer Engine, current scaling) over bf16 ones; only GEMMs get faster.
FP8_GEMM_SPEEDUP = 1.6
# Element-wise kernels write each saved activation once and read it about twice a forward.
ELEMENTWISE_PASSES = 3
# Megatron DDP's gradient bucket (parameters): the last one is reduced after the backward ends.
DDP_BUCKET_PARAMS = 40_000_000
# Adam step bytes per parameter of the shard: fp32 master, both moments (read and write), the
# fp32 gradient (read) and the bf16 weight (write); and per local parameter: zeroing and
# norm-clipping the fp32 gradient buffer.
ADAM_BYTES_PER_SHARD_PARAM = 30
GRAD_BUFFER_BYTES_PER_PARAM = 8


@dataclass(frozen=True)
class Network:
    """Where a job's collectives run: the GPU's links and how many GPUs share a node."""

    gpu: GpuSpec
    gpus_per_node: int

    def ring(self, ranks: int, volume: float, span: int) -> float:
        """Seconds for a collective over ``ranks`` that moves ``volume`` bytes per rank and
        whose ranks lie within ``span`` consecutive global ranks (span > node: crosses nodes)."""
        if ranks <= 1:
            return 0.0
        if span > self.gpus_per_node:
            alpha, beta = self.gpu.inter_node_latency_us, self.gpu.inter_node_gbps
        else:
            alpha, beta = self.gpu.intra_node_latency_us, self.gpu.intra_node_gbps
        return (ranks - 1) * alpha * 1e-6 + volume / (beta * 1e9)

    def all_to_all(self, ranks: int, volume: float, stride: int) -> float:
        """Seconds for an all-to-all over ``ranks`` placed ``stride`` apart, each sending
        ``volume`` bytes spread evenly over the group: the share bound for peers in the same
        node goes over NVLink, the rest over the NIC, both at once."""
        if ranks <= 1:
            return 0.0
        local = max(1, min(ranks, self.gpus_per_node // stride))
        inside = volume * (local - 1) / ranks
        outside = volume * (ranks - local) / ranks
        gpu = self.gpu
        seconds = max(inside / (gpu.intra_node_gbps * 1e9), outside / (gpu.inter_node_gbps * 1e9))
        alpha = gpu.inter_node_latency_us if outside else gpu.intra_node_latency_us
        return (ranks - 1) * alpha * 1e-6 + seconds


@dataclass(frozen=True)
class StepTime:
    """Estimated seconds of one optimizer step, by cause (their sum is the step)."""

    compute: float
    """Forward and backward (with recompute and any reference forward) of every micro-batch."""
    tensor_parallel: float
    """TP/SP all-gathers and reduce-scatters (not overlapped)."""
    context_parallel: float
    """The CP attention exchange (p2p ring, all-gather or all-to-all) left exposed."""
    expert_parallel: float
    """MoE token dispatch and combine all-to-alls."""
    pipeline_bubble: float
    """Pipeline warm-up and cool-down idle time."""
    pipeline_p2p: float
    """Activations and gradients sent between pipeline stages."""
    data_parallel: float
    """Exposed gradient reduction and parameter all-gather."""
    optimizer: float
    """The optimizer step on this rank's shard."""

    @property
    def total(self) -> float:
        return (self.compute + self.tensor_parallel + self.context_parallel
                + self.expert_parallel + self.pipeline_bubble + self.pipeline_p2p
                + self.data_parallel + self.optimizer)

    def shares(self) -> dict[str, float]:
        """Each cause's share of the step, for reports."""
        total = self.total
        return {f.name: getattr(self, f.name) / total for f in fields(self)}


@dataclass(frozen=True)
class _Pass:
    """One micro-batch on one pipeline rank, seconds by cause."""

    forward: float   # compute of the forward (what a parameter all-gather can hide behind)
    backward: float  # compute of the backward (what a gradient reduction can hide behind)
    compute: float   # all compute, recompute and reference forward included
    tensor_parallel: float
    context_parallel: float
    expert_parallel: float
    p2p: float

    @property
    def total(self) -> float:
        return (self.compute + self.tensor_parallel + self.context_parallel
                + self.expert_parallel + self.p2p)


def estimate_step_time(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                       gpus_per_node: int, *, overlap_grad_reduce: bool = True,
                       overlap_param_gather: bool = False) -> StepTime:
    """Seconds of one optimizer step of ``work`` on a resolved ``layout`` (see module doc)."""
    net = Network(gpu, gpus_per_node)
    ranks = busiest_ranks(model, layout)  # the first, the last, the most loaded
    passes = {r: _micro_batch(model, layout, work, net, r) for r in ranks}
    slowest = max(ranks, key=lambda r: passes[r].total)
    mb, m = passes[slowest], work.num_microbatches
    grads = max(_data_parallel(model, layout, work, net, r, passes[r], overlap_grad_reduce,
                               overlap_param_gather) for r in ranks)
    return StepTime(
        compute=m * mb.compute, tensor_parallel=m * mb.tensor_parallel,
        context_parallel=m * mb.context_parallel, expert_parallel=m * mb.expert_parallel,
        pipeline_bubble=(layout.pp - 1) / (layout.vp or 1) * mb.total,
        pipeline_p2p=m * mb.p2p, data_parallel=grads,
        optimizer=max(_optimizer(model, layout, work, gpu, r) for r in ranks))


def step_time_floor(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                    gpus_per_node: int) -> float:
    """A lower bound on ``estimate_step_time(...).total`` at a third to a half of its cost,
    which lets the search skip options that cannot win: the first pipeline rank's micro-batch
    pass, m + (PP−1)/VP times. It holds because the step charges the slowest rank's pass
    (rank 0's at least) that many times, micro-batches plus bubble, and every other term is
    non-negative (tests/test_plan_search_pruning.py fails if a change here breaks that)."""
    passed = _micro_batch(model, layout, work, Network(gpu, gpus_per_node), 0)
    return (work.num_microbatches + (layout.pp - 1) / (layout.vp or 1)) * passed.total


# --- compute -----------------------------------------------------------------------------------

def _gemm_rate(gpu: GpuSpec, precision: str, width: float) -> float:
    """FLOP/s of a GEMM whose narrowest dimension is ``width``."""
    if precision == "fp32":
        peak = gpu.fp32_tflops
    else:
        peak = gpu.peak_tflops * (FP8_GEMM_SPEEDUP if precision == "fp8" else 1.0)
    return peak * 1e12 * GEMM_EFFICIENCY * width / (width + GEMM_HALF_WIDTH)


def _layer_gemm_seconds(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                        tokens: int) -> float:
    """Forward GEMMs of one layer on one GPU (sequence parallel splits tokens over TP)."""
    h, d, tp, mats = model.hidden_size, model.kv_channels, layout.tp, mlp_matrices(model)
    hq, hkv = model.num_attention_heads * d, model.num_query_groups * d
    attn = h * hq + 2 * h * hkv + hq * h
    seconds = 2 * tokens * attn / tp / _gemm_rate(gpu, work.precision, h / tp)
    if not model.is_moe:
        mlp = mats * h * model.ffn_hidden_size
        return seconds + 2 * tokens * mlp / tp / _gemm_rate(gpu, work.precision, h / tp)
    fe, k, experts = model.expert_ffn_hidden_size, model.moe_router_topk, model.num_experts
    shared = mats * h * model.moe_shared_expert_ffn_hidden_size + h * experts  # and router
    seconds += 2 * tokens * shared / tp / _gemm_rate(gpu, work.precision, h / tp)
    per_expert = tokens * k * layout.ep / experts  # tokens each local expert gets (balanced)
    width = min(fe / layout.etp, per_expert)
    return seconds + 2 * tokens * k * mats * h * fe / tp / _gemm_rate(gpu, work.precision, width)


def _attention_seconds(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                       tokens: int) -> float:
    """Forward of one layer's attention core: each token attends to half the sequence on
    average (causal), on every CP rank alike (Megatron's load-balanced chunks)."""
    hq = model.num_attention_heads * model.kv_channels
    flops = 4 * hq * (work.seq_length / 2) * tokens / layout.tp
    share = ATTENTION_EFFICIENCY if work.flash_attention else UNFUSED_ATTENTION_EFFICIENCY
    rows = work.seq_length / (2 * layout.cp) if layout.cp > 1 else work.seq_length
    share *= rows / (rows + ATTENTION_HALF_LENGTH)
    peak = gpu.fp32_tflops if work.precision == "fp32" else gpu.peak_tflops
    return flops / (peak * 1e12 * share)


def _elementwise_seconds(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                         tokens: int) -> float:
    """Forward element-wise traffic of one layer (norms, activation, RoPE, residuals). The
    unfused attention's score traffic is in its own (lower) efficiency, so it is left out."""
    fused = work if work.flash_attention else replace(work, flash_attention=True)
    saved = tokens * layer_bytes_per_token(model, fused, layout) / layout.tp
    return ELEMENTWISE_PASSES * saved / (gpu.memory_gbps * 1e9)


def _output_layer_seconds(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                          tokens: int) -> tuple[float, float]:
    """(GEMM, loss element-wise) forward seconds of the output layer on the last stage."""
    vocab = padded_vocab(model, layout.tp) / layout.tp
    gemm = 2 * tokens * model.hidden_size * vocab / _gemm_rate(gpu, work.precision,
                                                               model.hidden_size)
    # bf16 logits and the fp32 softmax of the fused vocab-parallel cross entropy (6 B/element).
    loss = ELEMENTWISE_PASSES * 6 * tokens * vocab / (gpu.memory_gbps * 1e9)
    return gemm, loss


def _compute(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
             rank: int) -> tuple[float, float, float, float]:
    """(forward, backward, all compute, attention forward per layer) seconds of one
    micro-batch on pipeline rank ``rank``."""
    tokens = microbatch_tokens(work, layout)
    depths = mtp_on_rank(layout, work, rank)  # each: one more layer and output-layer pass
    layers = layers_on_rank(model, layout, rank) + depths
    gemm = _layer_gemm_seconds(model, layout, work, gpu, tokens)
    attn = _attention_seconds(model, layout, work, gpu, tokens)
    elem = _elementwise_seconds(model, layout, work, gpu, tokens)
    out_gemm, loss = (_output_layer_seconds(model, layout, work, gpu, tokens)
                      if rank == layout.pp - 1 else (0.0, 0.0))
    out_gemm, loss = (1 + depths) * out_gemm, (1 + depths) * loss
    weight_grads = 0.0 if work.lora else 1.0  # LoRA: frozen weights need no weight gradient
    if work.freeze is not None and not work.lora and layers:  # freeze: the trained share
        weight_grads = sum(work.freeze.layer_shares[i]
                           for i in layer_ids_on_rank(model, layout, rank)) / layers
    flash_bwd = FLASH_BACKWARD_FACTOR if work.flash_attention else 2.0
    forward = layers * (gemm + attn + elem) + out_gemm + loss
    backward = (layers * ((1 + weight_grads) * gemm + flash_bwd * attn + 2 * elem)
                + (1 + weight_grads) * out_gemm + loss)
    extra = 0.0
    if work.recompute == "full":
        extra += layers * (gemm + attn + elem)
    elif work.recompute == "selective":
        extra += layers * attn
    # E.g. dpo's frozen reference: its log-probabilities, forward only.
    extra += _extra_forwards(work) * forward
    return forward, backward, forward + backward + extra, attn


# --- communication -----------------------------------------------------------------------------

def _extra_forwards(work: Workload) -> int:
    """The stage's extra forward passes; none for a reference-free run (its only one is the
    reference's)."""
    stage = get_stage(work.stage)
    return 0 if stage.reference_model and not work.reference else stage.extra_forwards


def _micro_batch(model: ModelShape, layout: Layout, work: Workload, net: Network,
                 rank: int) -> _Pass:
    forward, backward, compute, attn = _compute(model, layout, work, net.gpu, rank)
    tokens = microbatch_tokens(work, layout)
    layers = layers_on_rank(model, layout, rank)
    width = weight_bytes(work.precision)
    activation = tokens * model.hidden_size * width  # one layer's input for the TP group
    forward_passes = 1 + (work.recompute == "full") + _extra_forwards(work)
    tp = layout.tp
    # 4 collectives a forward pass and 4 a backward, each moving (TP−1)/TP of the activation.
    tp_each = net.ring(tp, (tp - 1) / tp * activation, tp)
    tensor_parallel = layers * 4 * (forward_passes + 1) * tp_each
    return _Pass(forward=forward, backward=backward, compute=compute,
                 tensor_parallel=tensor_parallel,
                 context_parallel=layers * _cp_attention(model, layout, work, net, attn),
                 expert_parallel=layers * _all_to_all(model, layout, work, net, forward_passes),
                 p2p=_pipeline_sends(layout, net, activation))


def _cp_attention(model: ModelShape, layout: Layout, work: Workload, net: Network,
                  attn_forward: float) -> float:
    """Exposed seconds of one layer's CP exchange, by ``cp_comm_type``:

    * p2p (TE's ring): CP−1 KV hops forward, KV and dKV backward, each hidden behind that
      pass's attention;
    * all_gather: the keys/values gathered before attention and their gradients reduce-
      scattered after it, not overlapped;
    * a2a (Ulysses): Q, K, V and the output re-sharded forward and their gradients backward,
      not overlapped.
    """
    cp = layout.cp
    if cp == 1:
        return 0.0
    width = weight_bytes(work.precision)
    tokens = microbatch_tokens(work, layout)
    kv = 2 * tokens * model.num_query_groups * model.kv_channels * width / layout.tp
    if work.cp_comm_type == "p2p":
        hop = net.ring(2, kv, layout.tp * cp)  # one point-to-point step of the ring
        forward = max(0.0, (cp - 1) * hop - attn_forward)
        backward = max(0.0, 2 * (cp - 1) * hop - FLASH_BACKWARD_FACTOR * attn_forward)
    elif work.cp_comm_type == "all_gather":
        forward = backward = net.ring(cp, (cp - 1) * kv, layout.tp * cp)
    else:
        q_and_out = 2 * tokens * model.num_attention_heads * model.kv_channels * width / layout.tp
        forward = backward = net.all_to_all(cp, kv + q_and_out, layout.tp)
    recompute = forward if work.recompute == "full" else 0.0
    return forward + backward + recompute


def _all_to_all(model: ModelShape, layout: Layout, work: Workload, net: Network,
                forward_passes: int) -> float:
    """Seconds of one MoE layer's dispatch and combine, two a pass."""
    ep = layout.ep
    if not model.is_moe or ep == 1:
        return 0.0
    width = weight_bytes(work.precision)
    routed = microbatch_tokens(work, layout) / layout.tp * model.moe_router_topk \
        * model.hidden_size * width
    each = net.all_to_all(ep, routed, layout.etp)
    return 2 * (forward_passes + 1) * each


def _pipeline_sends(layout: Layout, net: Network, activation: int) -> float:
    """One micro-batch's activation out and gradient back at each of this rank's chunk
    boundaries (sequence parallel: each TP rank sends its 1/TP)."""
    if layout.pp == 1:
        return 0.0
    stride = layout.tp * layout.cp * (layout.dp or 1)
    hop = net.ring(2, activation / layout.tp, stride * layout.pp)
    return 2 * (layout.vp or 1) * hop


def _data_parallel(model: ModelShape, layout: Layout, work: Workload, net: Network, rank: int,
                   mb: _Pass, overlap_grad_reduce: bool, overlap_param_gather: bool) -> float:
    """Exposed seconds of gradient reduction (and parameter all-gather) on pipeline rank
    ``rank``: dense weights over DP·CP, experts over the expert-data-parallel ranks."""
    dense, expert = _trained_counts(model, layout, work, rank)
    dp = layout.dp or 1
    span = layout.tp * layout.cp * dp
    width = weight_bytes(work.precision)
    reduce = gather = 0.0
    for params, ranks in ((dense, dp * layout.cp),
                          (expert, span // (layout.ep * layout.etp))):
        if ranks == 1 or params == 0:
            continue
        share = (ranks - 1) / ranks
        if work.use_distributed_optimizer:
            reduce += net.ring(ranks, share * 4 * params, span)
            gather += net.ring(ranks, share * width * params, span)
        else:
            reduce += 2 * net.ring(ranks, share * 4 * params, span)
    if overlap_grad_reduce:
        last_bucket = reduce * min(1.0, DDP_BUCKET_PARAMS / max(1, dense + expert))
        reduce = max(last_bucket, reduce - mb.backward)
    if overlap_param_gather:
        gather = max(0.0, gather - mb.forward)
    return reduce + gather


def _optimizer(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
               rank: int) -> float:
    dense, expert = _trained_counts(model, layout, work, rank)
    shard = dense + expert
    if work.use_distributed_optimizer:
        dp = layout.dp or 1
        shard = dense / (dp * layout.cp) + expert / max(
            1, layout.tp * layout.cp * dp // (layout.ep * layout.etp))
    traffic = GRAD_BUFFER_BYTES_PER_PARAM * (dense + expert) + ADAM_BYTES_PER_SHARD_PARAM * shard
    return traffic / (gpu.memory_gbps * 1e9)


def _trained_counts(model: ModelShape, layout: Layout, work: Workload, rank: int) -> tuple[int, int]:
    """(dense, expert) parameters of pipeline rank ``rank`` whose gradients are reduced and
    updated: LoRA's adapters, freeze's trained part, or every weight."""
    counts = stage_counts(model, layout, rank, work.lora_rank, mtp_on_rank(layout, work, rank))
    if work.lora:
        return counts.adapters, 0
    if work.freeze is not None:
        return frozen_trainable(model, layout, rank, work.freeze), 0
    return counts.dense, counts.expert
