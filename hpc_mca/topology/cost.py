"""Estimated time of one training step for a layout: what the planner ranks layouts by.

A model of one optimizer step, in seconds, on the slowest pipeline stage:

* compute: GEMM FLOPs at a share of the tensor-core peak that falls for narrow matrices
  (h/TP columns, few tokens per expert), plus a fixed cost for each local expert's GEMM
  kernels (one per expert, each FP8 one after its input's quantization); attention at the
  fused kernel's share, which falls for short rows (few keys a call: short sequences, small
  CP chunks) and for calls with fewer thread blocks than SMs; and element-wise work (norms,
  SwiGLU, RoPE, residuals, the loss softmax) as HBM traffic over the tensors the memory
  model counts. Backward costs twice the
  forward GEMMs (input and weight gradients; LoRA's frozen weights need only the first) and
  2.5 times the forward attention (flash attention recomputes the scores). The first stage
  adds the embedding's dense gradient, the last the output layer and loss. Full recompute adds
  one forward of every layer, block:N of the first N layers of each chunk, selective one of
  the attention core; DPO adds a forward of the reference model.
* communication (topology/network.py): TP/SP collectives (not overlapped by this trainer), the
  CP exchange as far as each ring step's attention cannot hide it plus each step's fixed
  cost, MoE dispatch and combine (all-to-all, or a flex dispatcher's one copy a node) and a
  dropless dispatcher's host sync, pipeline sends and each chunk visit's host round trip,
  and the data-parallel reduction beyond what the last backward hides. Hidden transfers
  still cost the SMs NCCL takes from the compute beside them.
* pipeline: micro-batches go at the pace of the slowest stage, and the 1F1B warm-up and
  cool-down idle (PP−1)/VP micro-batch times.
* optimizer: Adam over this rank's shard, bound by HBM bandwidth.

MoE layers' routing is taken as balanced unless the request says dropless (routing.py: the
busiest expert-parallel rank's excess tokens, in its expert GEMMs and all-to-alls).

Left out: stragglers, packed documents' shorter attention (the full sequence is charged, an
upper bound). The constants cite their sources; benchmarks/planner_layouts.py sets the whole
against published runs, some of them held back from every choice made here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from hpc_mca.stages import get_stage

from . import network
from .attention import attention_gemm_flops
from .freeze import layer_ids_on_rank
from .hardware import GpuSpec
from .layout import Layout
from .memory import (
    Workload,
    busiest_ranks,
    frozen_trainable,
    layer_bytes_per_token,
    layer_kinds_on_rank,
    microbatch_tokens,
    mlp_matrices,
    mtp_on_rank,
    mtp_view,
    padded_vocab,
    recompute_modules,
    recomputed_share,
    stage_counts,
)
from .model import ModelShape, layer_view
from .network import Network
from .routing import moe_load_imbalance

# Share of the tensor-core peak a large bf16 GEMM sustains (cuBLAS on H100 reaches ~700 of
# 989 TFLOP/s on 8k×8k×8k).
GEMM_EFFICIENCY = 0.70
# The narrowest GEMM dimension at which that share halves: a 256-wide matrix (h/TP, or the
# tokens one expert gets) cannot fill the tensor cores' tiles and waves.
GEMM_HALF_WIDTH = 256
# Fused (flash) attention's share of the peak for long rows, and the unfused kernel's, which
# streams the s×s scores through HBM. FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608,
# fig. "attention forward speed, with causal mask, head dim 128", H100 SXM5 BF16) measures
# cuDNN's kernel, the one Transformer Engine calls on Hopper, at 539 TFLOP/s at 16k tokens
# (55% of 989) and FA3 at 616; the backward runs below its forward's rate, so 0.52 is charged.
ATTENTION_EFFICIENCY = 0.52
UNFUSED_ATTENTION_EFFICIENCY = 0.10
# The mean keys per query row of one kernel call at which that share halves: each query tile
# pays a fixed prologue and epilogue (load Q, rescale and write O and the log-sum-exp) and the
# causal diagonal tiles are half wasted. In the same figure FA3 runs at 292/423/521/579/602/616
# TFLOP/s from 512 to 16k tokens (cuDNN 315 to 539): 0.47, 0.69, 0.85 and 0.94 of its 16k
# speed at 512, 1k, 2k and 4k, which keys/(keys + 256) reproduces within 0.05 with causal rows'
# s/2 keys. Context parallelism's ring calls see one chunk pair at a time: s/(2·CP) keys.
ATTENTION_HALF_KEYS = 256
# Query rows a flash-attention thread block takes: a call with fewer blocks (micro-batch ·
# heads per TP rank · rows/128) than the GPU has SMs leaves SMs idle.
ATTENTION_TILE_ROWS = 128
# Fixed seconds of each expert's GEMM kernel beyond its FLOPs at _gemm_rate: Transformer
# Engine's grouped linear runs one cuBLAS GEMM per local expert (multi_stream_cublas_gemm in
# common/gemm/cublaslt_gemm.cu; FP8 on Hopper always takes that path), and a GEMM of a few
# hundred rows fills neither the SMs nor the host's launch queue. On an H100 such a loop over
# Qwen3-30B-A3B's 128 up-projections (512 rows each, K 2048, N 1536, BF16) runs at 129.5
# TFLOP/s (tgale96/grouped_gemm pull request 37): 24.9 µs a GEMM, of which _gemm_rate's
# FLOP time is 7.0 µs. hpc-mca's own trainer runs Megatron's SequentialMLP, the same GEMMs
# an expert at a time from Python: for its plans this is a lower bound (unmeasured on a GPU).
EXPERT_GEMM_OVERHEAD_S = 18e-6
# Fixed seconds an FP8 expert GEMM adds to quantize its input: current scaling casts each
# expert's slice on its own (Transformer Engine's split_quantize), an amax reduction and then
# the cast, two launches at the "several µs" of host time each that the Megatron-Core MoE
# report gives a kernel launch (arXiv 2603.07685, §4.3.6). It cancels FP8's GEMM speed-up on
# fine-grained experts, as measured: Qwen3-30B-A3B on 32 H100s (TP1 EP8) runs at 240.5 model
# TFLOP/s in BF16 and 242.9 in FP8 (Megatron-LM examples/moe_recipes/README.md). Dense layers
# quantize one tensor a GEMM (fused into the norm for QKV and fc1): traffic counted above.
FP8_QUANTIZE_OVERHEAD_S = 10e-6
# Flash attention's backward recomputes the scores: ~2.5× its forward FLOPs.
FLASH_BACKWARD_FACTOR = 2.5
# FP8 GEMMs (Transformer Engine, current scaling) over bf16 ones; only GEMMs get faster.
FP8_GEMM_SPEEDUP = 1.6
# Element-wise kernels write each saved activation once and read it about twice a forward.
ELEMENTWISE_PASSES = 3
# The embedding backward per element of the table's shard: the bf16 gradient zeroed and read
# back (2 + 2 B) and the fp32 main_grad read and written (4 + 4 B).
EMBEDDING_GRAD_BYTES = 12
# Adam step bytes per parameter of the shard: fp32 master, both moments (read and write), the
# fp32 gradient (read) and the bf16 weight (write); and per local parameter: zeroing and
# norm-clipping the fp32 gradient buffer.
ADAM_BYTES_PER_SHARD_PARAM = 30
GRAD_BUFFER_BYTES_PER_PARAM = 8


@dataclass(frozen=True)
class StepTime:
    """Estimated seconds of one optimizer step, by cause (their sum is the step)."""

    compute: float
    """Forward and backward (and any reference forward) of every micro-batch."""
    recomputation: float
    """The forwards activation recompute runs again in the backward (``recompute`` is the
    level's name elsewhere: plans and ``plan --explain`` rows)."""
    tensor_parallel: float
    """TP/SP all-gathers and reduce-scatters left exposed."""
    context_parallel: float
    """The CP attention exchange (p2p ring, all-gather or all-to-all) left exposed."""
    expert_parallel: float
    """MoE token dispatch and combine all-to-alls, and the dispatcher's host syncs."""
    pipeline_bubble: float
    """Pipeline warm-up and cool-down idle time."""
    pipeline_p2p: float
    """Activations and gradients sent between pipeline stages, and each visit's host round
    trip."""
    data_parallel: float
    """Exposed gradient reduction and parameter all-gather."""
    optimizer: float
    """The optimizer step on this rank's shard."""

    @property
    def total(self) -> float:
        return (self.compute + self.recomputation + self.tensor_parallel
                + self.context_parallel + self.expert_parallel + self.pipeline_bubble
                + self.pipeline_p2p + self.data_parallel + self.optimizer)

    def shares(self) -> dict[str, float]:
        """Each cause's share of the step, for reports."""
        total = self.total
        return {f.name: getattr(self, f.name) / total for f in fields(self)}


@dataclass(frozen=True)
class _Pass:
    """One micro-batch on one pipeline rank, seconds by cause."""

    forward: float   # compute of the forward (what a parameter all-gather can hide behind)
    backward: float  # compute of the backward (what a gradient reduction can hide behind)
    compute: float   # all compute but recompute, reference forward included
    recompute: float
    tensor_parallel: float
    context_parallel: float
    expert_parallel: float
    p2p: float

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tensor_parallel + self.context_parallel
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
        compute=m * mb.compute, recomputation=m * mb.recompute,
        tensor_parallel=m * mb.tensor_parallel,
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
                        tokens: int) -> tuple[float, float]:
    """Forward GEMMs of one layer on one GPU (sequence parallel splits tokens over TP), as
    (TP-split, other): the attention projections and a dense or shared-expert MLP, which TP's
    collectives feed and which TE's TP overlap pipelines them with; and the router and
    routed experts, which take the tokens as sequence parallelism left them."""
    h, tp = model.hidden_size, layout.tp
    # GQA's QKV and output projections, or MLA's down- and up-projections (memory.py).
    attn = tokens * attention_gemm_flops(model) / tp / _gemm_rate(gpu, work.precision, h / tp)
    split = attn + _mlp_gemm_seconds(model, layout, work, gpu, tokens)
    return split, _expert_gemm_seconds(model, layout, work, gpu, tokens)


def _mlp_gemm_seconds(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                      tokens: int) -> float:
    """Forward GEMMs of one layer's TP-split MLP (dense, or an MoE's shared expert)."""
    h, tp = model.hidden_size, layout.tp
    flops = 2 * tokens * mlp_matrices(model) * h * model.tp_mlp_ffn_hidden_size / tp
    return flops / _gemm_rate(gpu, work.precision, h / tp)


def _expert_gemm_seconds(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                         tokens: int) -> float:
    """Forward GEMMs of one MoE layer's router and routed experts on one GPU (0 if dense)."""
    if not model.is_moe:
        return 0.0
    h, tp, mats = model.hidden_size, layout.tp, mlp_matrices(model)
    fe, k, experts = model.expert_ffn_hidden_size, model.moe_router_topk, model.num_experts
    # The router, and a Qwen2-MoE shared expert's 1-wide gate.
    router = 2 * tokens * h * (experts + int(model.moe_shared_expert_gate)) / tp / _gemm_rate(
        gpu, work.precision, h / tp)
    # Rows each local expert gets (the mean load): the micro-batch's tokens are split over
    # TP by sequence parallelism, gathered again over the expert-TP group, copied to k experts,
    # and the EP group's copies spread over its experts. With ETP = TP every rank sees all
    # the tokens; with ETP 1 under TP4, a quarter (fewer rows: a narrower, slower GEMM).
    per_expert = tokens / layout.tp * layout.etp * k * layout.ep / experts
    width = min(fe / layout.etp, per_expert)
    routed = 2 * tokens * k * mats * h * fe / tp / _gemm_rate(gpu, work.precision, width)
    routed *= moe_load_imbalance(model, layout, work)  # the busiest rank's rows
    # Two GEMM kernels (fc1, fc2) for each local expert, each FP8 one after its input's
    # quantization; the backward's dgrad and wgrad kernels follow from the backward's
    # multiple of the forward GEMMs.
    fixed = EXPERT_GEMM_OVERHEAD_S + (FP8_QUANTIZE_OVERHEAD_S if work.precision == "fp8" else 0)
    return router + routed + 2 * experts // layout.ep * fixed


def _module_recompute_seconds(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                              tokens: int, attn: float) -> float:
    """One layer's forward parts that a selective recompute runs again (``attn``: its
    attention core's forward): core_attn that core; layernorm both norms (read the input,
    write the output, 2 B each); mlp the dense MLP's GEMMs; moe the router, the routed
    experts and a shared expert (its all-to-alls: network.expert_parallel); moe_act (TE's
    grouped-GEMM experts only) the experts' activation."""
    modules = recompute_modules(work.recompute)
    seconds = attn if "core_attn" in modules else 0.0
    if "layernorm" in modules:
        seconds += 2 * 2 * 2 * tokens * model.hidden_size / layout.tp / (gpu.memory_gbps * 1e9)
    # mlp recomputes a dense layer's MLP only (Megatron's TransformerLayer skips MoE layers);
    # moe an MoE layer's whole block, its shared expert included.
    if ("mlp" in modules and not model.is_moe) or ("moe" in modules and model.is_moe):
        seconds += _mlp_gemm_seconds(model, layout, work, gpu, tokens)
    if "moe" in modules:
        seconds += _expert_gemm_seconds(model, layout, work, gpu, tokens)
    elif "moe_act" in modules and model.is_moe:
        # The experts' activation: read fc1's output (gate and up), write fc2's input.
        rows = tokens * model.moe_router_topk * layout.etp / layout.tp
        seconds += 2 * 3 * model.expert_ffn_hidden_size / layout.etp * rows / (
            gpu.memory_gbps * 1e9)
    if "mla_up_proj" in modules and model.is_mla:
        # MLA's up-projections (q_b_proj, kv_b_proj; column-parallel) and the RoPE on Q and K.
        heads, ups = model.num_attention_heads, []
        if model.q_lora_rank:
            ups.append(model.q_lora_rank * heads * model.qk_head_dim)
        ups.append((model.kv_lora_rank or 0) * heads * (model.qk_nope_head_dim
                                                        + model.v_head_dim))
        seconds += 2 * tokens * sum(ups) / layout.tp / _gemm_rate(
            gpu, work.precision, model.hidden_size / layout.tp)
    return seconds


def _attention_seconds(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                       tokens: int) -> float:
    """Forward of one layer's attention core: each token attends to half the sequence on
    average (causal), on every CP rank alike (Megatron's load-balanced chunks). QKᵀ multiplies
    over the query/key head width, the weighted sum over the value width (MLA: nope + rope
    and v_head_dim)."""
    widths = model.num_attention_heads * (model.qk_head_dim + model.value_head_dim)
    flops = 2 * widths * (work.seq_length / 2) * tokens / layout.tp
    peak = gpu.fp32_tflops if work.precision == "fp32" else gpu.peak_tflops
    return flops / (peak * 1e12 * attention_share(model, layout, work, gpu, tokens))


def attention_share(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                    tokens: int) -> float:
    """Share of the peak one layer's attention kernel calls sustain (see ATTENTION_HALF_KEYS
    and ATTENTION_TILE_ROWS)."""
    if not work.flash_attention:
        return UNFUSED_ATTENTION_EFFICIENCY
    keys = work.seq_length / (2 * layout.cp)
    share = ATTENTION_EFFICIENCY * keys / (keys + ATTENTION_HALF_KEYS)
    if gpu.sm_count:
        blocks = model.num_attention_heads / layout.tp * tokens / ATTENTION_TILE_ROWS
        share *= min(1.0, blocks / gpu.sm_count)
    return share


def _elementwise_seconds(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                         tokens: int) -> float:
    """Forward element-wise traffic of one layer (norms, activation, RoPE, residuals). The
    unfused attention's score traffic is in its own (lower) efficiency, so it is left out."""
    fused = work if work.flash_attention else replace(work, flash_attention=True)
    saved = tokens * layer_bytes_per_token(model, fused, layout) / layout.tp
    return ELEMENTWISE_PASSES * saved / (gpu.memory_gbps * 1e9)


def _output_layer_seconds(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
                          tokens: int) -> tuple[float, float]:
    """(GEMM, loss element-wise) forward seconds of the output layer on the last stage. Its
    GEMM stays bf16 in an FP8 run: Megatron-Core's GPTModel builds it as a plain
    ColumnParallelLinear, outside Transformer Engine's fp8 autocast (a TE layer only for
    MXFP8 with fp8_output_proj, a Blackwell recipe)."""
    vocab = padded_vocab(model, layout.tp) / layout.tp
    precision = "bf16" if work.precision == "fp8" else work.precision
    gemm = 2 * tokens * model.hidden_size * vocab / _gemm_rate(gpu, precision, model.hidden_size)
    # bf16 logits and the fp32 softmax of the fused vocab-parallel cross entropy (6 B/element).
    loss = ELEMENTWISE_PASSES * 6 * tokens * vocab / (gpu.memory_gbps * 1e9)
    return gemm, loss


@dataclass(frozen=True)
class _LayerTime:
    """Forward seconds of one layer of one kind (dense-MLP or MoE) for one micro-batch."""

    split_gemm: float  # TP-split GEMMs (what TP overlap hides behind)
    other_gemm: float  # router and routed experts
    elementwise: float
    module_recompute: float  # what a selective recompute runs again (attention core included)


@dataclass(frozen=True)
class _Compute:
    """Compute seconds of one micro-batch on one pipeline rank."""

    forward: float   # what a parameter all-gather can hide behind
    backward: float  # what a gradient reduction can hide behind
    total: float     # forward, backward and any reference forward
    recompute: float  # the forwards recompute runs again
    layer_attention: float    # one layer's forward attention core
    layer_attention_backward: float
    kinds: dict[bool, _LayerTime]  # by is-MoE: each kind of layer the rank holds

    def layer_forward(self, moe: bool) -> float:
        """One layer's whole forward."""
        kind = self.kinds[moe]
        return kind.split_gemm + kind.other_gemm + self.layer_attention + kind.elementwise


def _layer_time(kind: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec, tokens: int,
                attn: float) -> _LayerTime:
    split, other = _layer_gemm_seconds(kind, layout, work, gpu, tokens)
    return _LayerTime(split, other, _elementwise_seconds(kind, layout, work, gpu, tokens),
                      _module_recompute_seconds(kind, layout, work, gpu, tokens, attn))


def _compute(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
             rank: int) -> _Compute:
    """Compute of one micro-batch on pipeline rank ``rank``: its dense-MLP and MoE layers
    (each kind timed on its own: DeepSeek-V3's first layers are dense) and MTP depths."""
    tokens = microbatch_tokens(work, layout)
    depths = mtp_on_rank(layout, work, rank)  # each: one more layer and output-layer pass
    dense, moe = layer_kinds_on_rank(model, layout, rank)
    counts = {False: dense, True: moe}
    counts[mtp_view(model).is_moe] += depths
    layers = dense + moe + depths
    attn = _attention_seconds(model, layout, work, gpu, tokens)
    kinds = {is_moe: _layer_time(layer_view(model, is_moe), layout, work, gpu, tokens, attn)
             for is_moe, n in counts.items() if n}
    gemm = sum(counts[k] * (t.split_gemm + t.other_gemm) for k, t in kinds.items())
    elem = sum(counts[k] * t.elementwise for k, t in kinds.items())
    out_gemm, loss = (_output_layer_seconds(model, layout, work, gpu, tokens)
                      if rank == layout.pp - 1 else (0.0, 0.0))
    out_gemm, loss = (1 + depths) * out_gemm, (1 + depths) * loss
    weight_grads = 0.0 if work.lora else 1.0  # LoRA: frozen weights need no weight gradient
    if work.freeze is not None and not work.lora and layers:  # freeze: the trained share
        weight_grads = sum(work.freeze.layer_shares[i]
                           for i in layer_ids_on_rank(model, layout, rank)) / layers
    flash_bwd = FLASH_BACKWARD_FACTOR if work.flash_attention else 2.0
    forward = gemm + layers * attn + elem + out_gemm + loss
    backward = ((1 + weight_grads) * gemm + flash_bwd * layers * attn + 2 * elem
                + (1 + weight_grads) * out_gemm + loss)
    if rank == 0:
        backward += _embedding_backward_seconds(model, layout, work, gpu)
    recomputed = recomputed_share(model, layout, work, rank)
    if recomputed:
        recompute = recomputed * (gemm + layers * attn + elem)
    else:
        recompute = sum(counts[k] * t.module_recompute for k, t in kinds.items())
    # E.g. dpo's frozen reference: its log-probabilities, forward only.
    reference = _extra_forwards(work) * forward
    return _Compute(forward, backward, forward + backward + reference, recompute, attn,
                    flash_bwd * attn, kinds)


def _embedding_backward_seconds(model: ModelShape, layout: Layout, work: Workload,
                                gpu: GpuSpec) -> float:
    """The first stage's embedding backward, once a micro-batch: PyTorch's embedding backward
    (aten embedding_dense_backward) fills a dense gradient the size of the table's TP shard
    and scatters the tokens' rows into it, and Megatron's DDP then adds it into the fp32
    main_grad (gradient-accumulation fusion covers linear layers only): EMBEDDING_GRAD_BYTES
    an element, however few tokens the micro-batch has. A frozen table (LoRA, or freeze
    without the embedding) has no gradient."""
    if work.lora or (work.freeze is not None and not work.freeze.embedding):
        return 0.0
    elements = padded_vocab(model, layout.tp) / layout.tp * model.hidden_size
    return EMBEDDING_GRAD_BYTES * elements / (gpu.memory_gbps * 1e9)


# --- communication (topology/network.py) ---------------------------------------------------

def _extra_forwards(work: Workload) -> int:
    """The stage's extra forward passes; none for a reference-free run (its only one is the
    reference's)."""
    stage = get_stage(work.stage)
    return 0 if stage.reference_model and not work.reference else stage.extra_forwards


def _micro_batch(model: ModelShape, layout: Layout, work: Workload, net: Network,
                 rank: int) -> _Pass:
    c = _compute(model, layout, work, net.gpu, rank)
    dense, moe = layer_kinds_on_rank(model, layout, rank)
    recomputed = recomputed_share(model, layout, work, rank)
    forward_passes = 1 + recomputed + _extra_forwards(work)
    # A dense layer's MLP is TP-split and an MoE layer's routed experts are not: each kind's
    # collectives from its own view; only MoE layers dispatch.
    tensor_parallel = sum(
        network.tensor_parallel(layer_view(model, is_moe), layout, work, net, n,
                                forward_passes, c.kinds[is_moe].split_gemm)
        for is_moe, n in ((False, dense), (True, moe)) if n)
    expert_parallel = moe * network.expert_parallel(
        layer_view(model, True), layout, work, net, forward_passes,
        c.layer_forward(True)) if moe else 0.0
    return _Pass(
        forward=c.forward, backward=c.backward, compute=c.total, recompute=c.recompute,
        tensor_parallel=tensor_parallel,
        context_parallel=(dense + moe) * network.context_parallel(
            model, layout, work, net, c.layer_attention, c.layer_attention_backward, recomputed),
        expert_parallel=expert_parallel,
        p2p=network.pipeline_sends(model, layout, work, net, c.forward + c.backward))


def _data_parallel(model: ModelShape, layout: Layout, work: Workload, net: Network, rank: int,
                   mb: _Pass, overlap_grad_reduce: bool, overlap_param_gather: bool) -> float:
    dense, expert = _trained_counts(model, layout, work, rank)
    return network.data_parallel(layout, work, net, dense, expert, mb.forward, mb.backward,
                                 overlap_grad_reduce, overlap_param_gather)


def _optimizer(model: ModelShape, layout: Layout, work: Workload, gpu: GpuSpec,
               rank: int) -> float:
    dense, expert = _trained_counts(model, layout, work, rank)
    shard: float = dense + expert
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
