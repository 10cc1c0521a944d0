"""The communication terms of the step-time estimate (topology/cost.py): seconds per micro-batch
of the TP, CP, EP and pipeline exchanges, and per step of the data-parallel reduction.

A collective over n ranks costs (n−1)·α plus its per-rank volume over the NCCL bus bandwidth
of the slowest link it crosses, with ranks placed in Megatron's order (TP innermost, then CP,
then DP; PP outermost; the expert grid is ETP, EP, expert-DP): a group inside one node runs
over NVLink, one that spans nodes over the NICs, one NIC share for each member it has in a
node (GpuSpec's intra/inter-node figures; Network.ring).

Communication that overlaps compute is not free: NCCL's kernels hold SMs that the GEMMs beside
them then lack (NCCL_OVERLAP_SMS), so a share of every hidden transfer is charged anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from .hardware import GpuSpec
from .layout import Layout
from .memory import Workload, grad_bytes, microbatch_tokens, recompute_modules, weight_bytes
from .model import ModelShape
from .routing import moe_load_imbalance

# SMs an NCCL collective occupies while it runs beside compute: on an H100 an all-gather
# launched 24 thread blocks beside a 132-block GEMM (NVIDIA developer forum, "Compute-
# communication overlap causes severe GEMM performance degradation because of tail effect",
# 2025, nsys trace). Overlapped compute loses that share of the GPU while the transfer runs.
NCCL_OVERLAP_SMS = 24
# One ring step of Transformer Engine's p2p CP attention (AttnFuncWithCPAndKVP2P in its
# context_parallel.py) posts a send/recv pair, makes the compute stream wait on it and runs,
# besides the attention call, the kernels that merge the step's output and log-sum-exp into
# the running result: launches and waits nothing hides. NCCL's send/recv latency alone is the
# GpuSpec α (3 µs in a node, 8 µs across); 20 µs covers it and ~4 kernel launches.
CP_STEP_OVERHEAD_S = 20e-6
# Bytes a ring step moves per element of its partial output (forward) or of its dQ and dKV
# (backward) to merge it: written and read back in bf16, then an fp32 accumulator read and
# written.
CP_MERGE_BYTES = 12
# Every visit of a micro-batch to a pipeline chunk costs the schedule a host round trip that
# no compute hides: Megatron's schedule (pipeline_parallel/schedules.py) posts the chunk's
# receive and send as one batch_isend_irecv (p2p_communication.py), waits on it, then runs the
# chunk's step from Python. 50 µs a visit covers the p2p latency (GpuSpec's α) and that Python;
# it is not measured here: the interleaved runs of benchmarks/planner_layouts.py check it.
PIPELINE_VISIT_OVERHEAD_S = 50e-6
# Megatron DDP's gradient bucket (parameters): the last one is reduced after the backward ends.
DDP_BUCKET_PARAMS = 40_000_000
# The alltoall token dispatcher of a dropless MoE layer copies each expert's token count to the
# host to size its all-to-all (Megatron-Core's MoEAlltoAllTokenDispatcher, its cuda_sync_point):
# the host waits for the GPU, then the GPU waits for the host to launch what follows. One such
# stall a dispatch, forward and backward.
MOE_SYNC_STALL_S = 100e-6


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
            # NCCL's rings cross each node boundary once per channel, each channel through
            # another NIC, so a group with k members in a node drives k NICs (the node's other
            # groups, running at the same time, drive the rest): k NIC shares a member, at most
            # NVLink's. All 8 GPUs of each H100 node in one all-reduce: ~400-450 GB/s bus
            # bandwidth in nccl-tests (Saturn Cloud, "Validating multi-node GPU clusters with
            # NCCL tests": H100 SXM, NVLink + NDR InfiniBand).
            members = max(1.0, ranks * self.gpus_per_node / span)
            alpha = self.gpu.inter_node_latency_us
            beta = min(self.gpu.intra_node_gbps, self.gpu.inter_node_gbps * members)
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
        return self._both_links(ranks, volume * (local - 1) / ranks,
                                volume * (ranks - local) / ranks)

    def node_dispatch(self, ranks: int, stride: int, tokens: float, token_bytes: float,
                      topk: int, experts: int) -> float:
        """Seconds for a flex (DeepEP/HybridEP) dispatch or combine over ``ranks`` placed
        ``stride`` apart: each token crosses the network once to every other node that holds
        one of its ``topk`` experts and reaches each GPU holding one over NVLink once (uniform
        routing: the chance that g of the ranks' shares of experts hold none of the k is
        C(E − E/g, k)/C(E, k)). NVIDIA's measurement on H100 nodes (Megatron-Core MoE report,
        arXiv 2603.07685, table 7: hidden 7168, 4096 tokens, top-8 of 256) has HybridEP's
        dispatch at EP16 in 1485 µs against the all-to-all's 5774: 3.9×, where one copy a
        node instead of eight is 4.0× less traffic over the NICs, each still near its line
        rate; inside a node (EP8) 661 µs against 1265, 4.6 copies a token against 7."""
        if ranks <= 1:
            return 0.0
        local = max(1, min(ranks, self.gpus_per_node // stride))
        nodes = -(-ranks // local)

        def reached(groups: int) -> float:  # expected groups holding one of a token's experts
            return groups * (1 - comb(experts - experts // groups, topk) / comb(experts, topk))

        return self._both_links(ranks, tokens * token_bytes * reached(ranks) * (local - 1) / local,
                                tokens * token_bytes * reached(nodes) * (nodes - 1) / nodes)

    def _both_links(self, ranks: int, inside: float, outside: float) -> float:
        """An exchange among ``ranks`` moving ``inside`` bytes a rank over NVLink and
        ``outside`` over its NIC at the same time: the slower of the two, plus a latency a peer."""
        gpu = self.gpu
        seconds = max(inside / (gpu.intra_node_gbps * 1e9), outside / (gpu.inter_node_gbps * 1e9))
        alpha = gpu.inter_node_latency_us if outside else gpu.intra_node_latency_us
        return (ranks - 1) * alpha * 1e-6 + seconds

    def overlapped(self, transfer: float, compute: float) -> float:
        """Exposed seconds of ``transfer`` run beside ``compute``: what outlasts the compute,
        plus the compute the transfer's SMs slow down while both run."""
        hidden = min(transfer, compute)
        share = NCCL_OVERLAP_SMS / self.gpu.sm_count if self.gpu.sm_count else 0.0
        return transfer - hidden + share * hidden


def tensor_parallel(model: ModelShape, layout: Layout, work: Workload, net: Network,
                    layers: int, forward_passes: float, layer_gemm: float) -> float:
    """Exposed seconds of one micro-batch's TP/SP collectives: every layer all-gathers and
    reduce-scatters its activations twice a pass (4 forward, 4 backward, 4 per extra forward).
    An MoE layer's routed experts take their tokens as sequence parallelism left them (their
    dispatcher moves them over the expert grid: expert_parallel), so without a shared expert,
    which is a TP MLP, it has only its attention's 2. Not overlapped here (this trainer has no
    userbuffers); with ``tp_comm_overlap`` each is cut into TP chunks pipelined with its GEMM
    (Transformer Engine's userbuffers), so only the first chunk and what outlasts the GEMMs is
    exposed."""
    tp = layout.tp
    activation = microbatch_tokens(work, layout) * model.hidden_size * weight_bytes(work.precision)
    each = net.ring(tp, (tp - 1) / tp * activation, tp)
    per_pass = (4 if model.tp_mlp_ffn_hidden_size else 2) * each
    if work.tp_comm_overlap and tp > 1:
        # A forward's collectives run beside its TP-split GEMMs; the backward's beside twice
        # as much.
        per_pass = per_pass / tp + net.overlapped(per_pass * (tp - 1) / tp, layer_gemm)
    # A recomputed MLP (or an MoE layer's shared expert) gathers and scatters again: half a pass.
    again = 0.5 if model.tp_mlp_ffn_hidden_size and {"mlp", "moe"} & recompute_modules(
        work.recompute) else 0.0
    return layers * (forward_passes + 1 + again) * per_pass


def context_parallel(model: ModelShape, layout: Layout, work: Workload, net: Network,
                     attn_forward: float, attn_backward: float, recomputed: float) -> float:
    """Exposed seconds of one layer's CP exchange for one micro-batch, by ``cp_comm_type``:

    * p2p (TE's ring): CP steps, CP−1 of them waiting on a KV hop (forward) or a KV and dKV
      hop (backward) that hides behind the previous step's attention only as far as that
      step's share of the attention lasts; every step also pays CP_STEP_OVERHEAD_S and merges
      its partial result (CP_MERGE_BYTES);
    * all_gather: the keys/values gathered before attention and their gradients reduce-
      scattered after it, not overlapped;
    * a2a (Ulysses): Q, K, V and the output re-sharded forward and their gradients backward,
      not overlapped.

    ``recomputed``: the share of layers whose forward (and its exchange) runs twice.
    """
    cp = layout.cp
    if cp == 1:
        return 0.0
    width = weight_bytes(work.precision)
    tokens = microbatch_tokens(work, layout)
    hq = model.num_attention_heads * model.kv_channels
    hkv = model.num_query_groups * model.kv_channels
    kv = 2 * tokens * hkv * width / layout.tp
    if work.cp_comm_type == "p2p":
        hop = net.ring(2, kv, layout.tp * cp)  # one point-to-point step of the ring
        bandwidth = net.gpu.memory_gbps * 1e9
        merge_fwd = tokens * hq / layout.tp * CP_MERGE_BYTES / bandwidth
        merge_bwd = tokens * (hq + 2 * hkv) / layout.tp * CP_MERGE_BYTES / bandwidth
        forward = ((cp - 1) * net.overlapped(hop, attn_forward / cp)
                   + cp * (CP_STEP_OVERHEAD_S + merge_fwd))
        backward = ((cp - 1) * net.overlapped(2 * hop, attn_backward / cp)
                    + cp * (CP_STEP_OVERHEAD_S + merge_bwd))
    elif work.cp_comm_type == "all_gather":
        forward = backward = net.ring(cp, (cp - 1) * kv, layout.tp * cp)
    else:
        q_and_out = 2 * tokens * hq * width / layout.tp
        forward = backward = net.all_to_all(cp, kv + q_and_out, layout.tp)
    return forward + backward + recomputed * forward  # a recomputed layer exchanges again


def expert_parallel(model: ModelShape, layout: Layout, work: Workload, net: Network,
                    forward_passes: float, layer_compute: float) -> float:
    """Exposed seconds of one MoE layer's dispatch and combine for one micro-batch, two
    all-to-alls a pass, plus a dropless dispatcher's host sync (MOE_SYNC_STALL_S) each
    dispatch. With ``moe_comm_overlap`` (Megatron's overlap_moe_expert_parallel_comm, which
    runs one micro-batch's all-to-alls beside another's compute, and only without a pipeline
    or with an interleaved one) they hide behind the layer's compute.

    With expert TP (ETP > 1) the all-to-all dispatcher then all-gathers the copies it received
    over the ETP group (each of its ranks computes a slice of every local expert for all of
    them) and the combine reduce-scatters them first (Megatron-Core's MoEAlltoAllTokenDispatcher,
    gather_from_sequence_parallel_region over the expert-TP group): (ETP−1) times the copies
    a rank received, over NVLink while ETP fits a node."""
    ep, etp = layout.ep, layout.etp
    if not model.is_moe or ep * etp == 1:
        return 0.0
    tokens = microbatch_tokens(work, layout) / layout.tp
    token_bytes = model.hidden_size * weight_bytes(work.precision)
    k = model.moe_router_topk
    if work.moe_dispatcher == "flex":
        each = net.node_dispatch(ep, etp, tokens, token_bytes, k, model.num_experts)
    else:
        copies = tokens * k * token_bytes
        each = net.all_to_all(ep, copies, etp) + net.ring(etp, (etp - 1) * copies, etp)
    passes = forward_passes + 1 + int("moe" in recompute_modules(work.recompute))
    # The busiest rank receives and returns its excess copies too.
    transfer = 2 * passes * each * moe_load_imbalance(model, layout, work)
    # Megatron runs the overlap only without a pipeline or with an interleaved one.
    if work.moe_comm_overlap and (layout.pp == 1 or layout.vp):
        transfer = net.overlapped(transfer, passes * layer_compute)
    return transfer + passes * MOE_SYNC_STALL_S


def pipeline_sends(model: ModelShape, layout: Layout, work: Workload, net: Network,
                   compute: float) -> float:
    """One micro-batch's activation out and gradient back at each of this rank's chunk
    boundaries (sequence parallel: each TP rank sends its 1/TP), each visit also paying
    PIPELINE_VISIT_OVERHEAD_S. With ``overlap_p2p_comm`` an interleaved schedule's sends run
    beside its chunks' compute (``compute``: the micro-batch's forward and backward here)."""
    if layout.pp == 1:
        return 0.0
    activation = microbatch_tokens(work, layout) * model.hidden_size * weight_bytes(work.precision)
    stride = layout.tp * layout.cp * (layout.dp or 1)
    hop = net.ring(2, activation / layout.tp, stride * layout.pp)
    visits = 2 * (layout.vp or 1)
    sends = visits * hop
    if work.overlap_p2p_comm and layout.vp:
        sends = net.overlapped(sends, compute)
    return sends + visits * PIPELINE_VISIT_OVERHEAD_S


def data_parallel(layout: Layout, work: Workload, net: Network, dense: int, expert: int,
                  forward: float, backward: float, overlap_grad_reduce: bool,
                  overlap_param_gather: bool) -> float:
    """Exposed seconds of gradient reduction (and parameter all-gather) of ``dense`` and
    ``expert`` trained parameters on one pipeline rank: dense weights over DP·CP, experts over
    the expert-data-parallel ranks. Megatron reduces during the last micro-batch's backward
    when overlap_grad_reduce is on, so only what outlasts that backward, at least the last
    bucket, and the SMs the hidden part takes are exposed; likewise the gather beside the
    first forward."""
    dp = layout.dp or 1
    span = layout.tp * layout.cp * dp
    width, grad = weight_bytes(work.precision), grad_bytes(work)
    reduce = gather = 0.0
    for params, ranks in ((dense, dp * layout.cp),
                          (expert, span // (layout.ep * layout.etp))):
        if ranks == 1 or params == 0:
            continue
        share = (ranks - 1) / ranks
        if work.use_distributed_optimizer:
            reduce += net.ring(ranks, share * grad * params, span)
            gather += net.ring(ranks, share * width * params, span)
        else:
            reduce += 2 * net.ring(ranks, share * grad * params, span)
    if overlap_grad_reduce:
        last_bucket = reduce * min(1.0, DDP_BUCKET_PARAMS / max(1, dense + expert))
        reduce = last_bucket + net.overlapped(reduce - last_bucket, backward)
    if overlap_param_gather:
        gather = net.overlapped(gather, forward)
    return reduce + gather
