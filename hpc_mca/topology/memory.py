"""Per-GPU memory estimate of a Megatron-Core training step.

The estimate is the sum of four parts, each per GPU and in bytes:

* parameters: bf16/fp16 weights take 2 B per parameter (fp32 runs 4 B). DPO without LoRA also
  keeps a frozen reference copy of the policy, sharded the same way.
* gradients: Megatron's DDP accumulates into fp32 ``main_grad`` buffers, 4 B per *trainable*
  parameter (2 B when a run reduces in bf16), allocated in full even with the distributed
  optimizer (it reduce-scatters into them but does not shrink them).
* optimizer state: Adam's two moments plus the fp32 master copy, 12 B per trainable parameter
  (fp32 runs, and LoRA's float32 adapters, need no master copy: 8 B). The distributed optimizer shards this over the
  data-parallel ranks: DP·CP for dense weights, the expert-data-parallel ranks for experts.
* activations: what the backward pass needs, after Korthikanti et al. ("Reducing Activation
  Recomputation in Large Transformer Models"), whose per-layer figure is s·b·h·(34 + 5·a·s/h)
  bytes. We count the saved tensors of a modern block instead of using 34 (GQA, SwiGLU and MoE
  change it; for Llama-3-8B the count below gives exactly 34·h per token), and the 5·a·s/h
  attention-score term vanishes with flash/fused attention. Sequence parallelism splits every
  saved tensor over TP and context parallelism splits the sequence, so the total is divided by
  TP·CP. Full recompute keeps only each layer's input plus one layer's working set; block:N
  does so for the first N layers of each pipeline chunk.

With LoRA only the adapters are trainable: the frozen base costs its weights and nothing else;
with freeze (LLaMA-Factory's partial fine-tuning) only the layers and tables it trains, on the
pipeline ranks that hold them.
Vocabulary padding (to a multiple of 128·TP, as Megatron does) is included; small items
(norm weights counted, router/bias buffers, RNG states, the CUDA context) are left to the
headroom in :class:`hpc_mca.topology.hardware.GpuSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_mca.stages import get_stage

from . import choices
from .attention import mla_qkv_elements, mla_saved_elements
from .freeze import FreezeSizing, layer_ids_on_rank
from .layout import Layout
from .model import ModelShape, layer_view
from .params import (  # noqa: F401 - importable from here as before
    ParamCounts,
    checkpoint_parameters,
    layer_counts,
    layer_kinds_on_rank,
    layers_on_rank,
    mlp_matrices,
    mtp_view,
    padded_vocab,
    stage_counts,
)
from .vision import DEFAULT_IMAGE_MAX_PIXELS

# Defined in choices.py (light enough for the CLI's --help); importable from here as before.
TORCH_CP_COMM_TYPES = choices.TORCH_CP_COMM_TYPES
CP_COMM_TYPES = choices.CP_COMM_TYPES
PRECISIONS = choices.PRECISIONS
RECOMPUTE = choices.RECOMPUTE


@dataclass(frozen=True)
class Workload:
    """What one training step processes and how, apart from the parallel layout."""

    seq_length: int
    """Tokens per sequence (per packed sample with sequence packing)."""
    micro_batch_size: int = 1
    """Sequences per forward/backward on one DP rank."""
    num_microbatches: int = 1
    """Micro-batches per step per DP rank (global / (micro · DP)); bounds pipeline in-flight."""
    stage: str = "pt"
    """pt (pretrain), sft, or dpo (chosen+rejected pairs, plus a reference model)."""
    precision: str = "bf16"
    """bf16, fp16, fp8 (weights stay bf16; Transformer Engine keeps GEMM inputs in fp8 for
    the backward) or fp32."""
    lora: bool = False
    """Train LoRA adapters on all linear layers instead of the full model."""
    lora_rank: int = 16
    """LoRA rank r: each adapted (in → out) linear gains r·(in + out) parameters."""
    recompute: str = "none"
    """none, selective (attention core only), ``selective:A,B`` (the layer parts named, from
    RECOMPUTE_MODULES: Megatron's recompute_modules), ``block:N`` (full recompute of the
    first N layers of each pipeline chunk, Megatron's block method) or full (every layer,
    uniform, 1 layer a group)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron's distributed optimizer)."""
    flash_attention: bool = True
    """Fused attention that never materialises the s×s score matrix."""
    cp_comm_type: str = "all_gather"
    """Context-parallel attention exchange: p2p (TE's ring), all_gather or a2a (Ulysses)."""
    mtp_num_layers: int = 0
    """Multi-token prediction depths: one transformer layer, a 2h→h projection, norms and
    one more output-layer pass each, on the last pipeline stage."""
    freeze: FreezeSizing | None = None
    """finetuning_type freeze: the parts that train (gradients and optimizer state for them
    only); None = every parameter trains (or only LoRA's adapters, with ``lora``)."""
    reference: bool = True
    """Whether the stage's frozen reference runs (false: a reference-free dpo, orpo or simpo;
    :func:`hpc_mca.stages.reference_runs`): no reference weights, no reference forward."""
    separate_reference: bool = False
    """The reference is a model of its own even with ``lora`` (``finetuning.ref_model``): its
    weights count; otherwise a LoRA run's reference is its own frozen base."""
    grad_reduce_in_fp32: bool = True
    """Gradients accumulate and reduce in fp32 main_grad buffers (4 B a parameter), as this
    trainer's DDP does; false: in the weights' bf16 (2 B), as Megatron-Bridge's performance
    recipes run. Only estimates of other trainers' runs set it false."""
    tp_comm_overlap: bool = False
    """TP collectives pipelined with their GEMMs (Transformer Engine's userbuffers). This
    trainer does not run it: only estimates of other trainers' runs set it
    (benchmarks/planner_layouts.py)."""
    overlap_p2p_comm: bool = False
    """Interleaved pipelines' sends overlap the next chunk's compute (Megatron-LM's default,
    Megatron-Core's overlap_p2p_comm); this trainer sends them blocking (Megatron-Core's
    default). Only estimates of other trainers' runs set it."""
    moe_comm_overlap: bool = False
    """MoE all-to-alls run beside another micro-batch's compute (Megatron's
    overlap_moe_expert_parallel_comm). This trainer does not run it, as above."""
    moe_dispatcher: str = "alltoall"
    """alltoall (this trainer's) or flex (DeepEP/HybridEP: one copy of a token per destination
    node across the network); flex only for estimates of other trainers' runs."""
    te_layers: bool = False
    """Transformer Engine's layers (Megatron's TE spec): the norm before QKV, and a dense
    MLP's, fused into those linears (no norm of their own for ``layernorm`` recompute to
    free), and grouped-GEMM experts (``moe_act`` recompute). hpc-mca's trainer builds the
    local spec: only estimates of other trainers' runs set it."""
    moe_routing: str = "balanced"
    """balanced (every expert-parallel rank gets its share of the tokens) or dropless (each
    expert gets what its router sends, and the busiest rank waits on more:
    routing.moe_load_imbalance). Times only: activation memory counts the mean load (a rank's
    memory sums its loads over many layers, whose busiest ranks differ)."""
    image_max_pixels: int = DEFAULT_IMAGE_MAX_PIXELS
    """A VL model: the largest image's pixels (data.image_max_pixels), for the vision tower's
    activations (vision.py)."""
    vision_trains: frozenset[str] = frozenset()
    """A VL model: the parts of its vision side that train (VISION_PARTS: ``tower``,
    ``projector``); empty, LLaMA-Factory's default, keeps no vision activations."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on the busiest pipeline stage."""

    params: int
    """Model weights resident on the GPU (plus the DPO reference copy)."""
    grads: int
    """fp32 gradient buffers of the trainable parameters."""
    optimizer: int
    """Adam moments and fp32 master weights (this rank's shard)."""
    activations: int
    """Saved activations of the in-flight micro-batches plus the loss logits."""
    vision_activations: int = 0
    """Of ``activations``: what a VL model's vision tower keeps (first pipeline stage)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def mtp_on_rank(layout: Layout, work: Workload, rank: int) -> int:
    """MTP depths pipeline rank ``rank`` runs: all of them on the last stage."""
    return work.mtp_num_layers if rank == layout.pp - 1 else 0


def weight_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def grad_bytes(work: Workload) -> int:
    """Bytes a gradient element takes in the DDP buffers (and on the wire)."""
    return 4 if work.grad_reduce_in_fp32 else weight_bytes(work.precision)


def frozen_trainable(model: ModelShape, layout: Layout, rank: int, sizing: FreezeSizing) -> int:
    """Trainable dense parameters on one GPU of pipeline rank ``rank`` under freeze: the
    trained share of its layers, and the tables it holds that train (norms: headroom)."""
    per_layer = layer_counts(model, layout, 1).dense
    layers = sum(sizing.layer_shares[i] for i in layer_ids_on_rank(model, layout, rank))
    table = padded_vocab(model, layout.tp) * model.hidden_size // layout.tp
    output_here = rank == layout.pp - 1 and (layout.pp > 1 or not model.tie_word_embeddings)
    tables = int(rank == 0 and sizing.embedding) + int(output_here and sizing.output)
    return int(layers * per_layer) + tables * table


def _state_memory(counts: ParamCounts, layout: Layout, work: Workload,
                  trainable: int | None = None) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes for the parameters in ``counts``; ``trainable``: the
    dense parameters that train, when not all of them do (freeze)."""
    w = weight_bytes(work.precision)
    base = counts.dense + counts.expert
    # LoRA adapters stay float32 whatever the base's dtype (models.lora): 4 B each, and the
    # optimizer steps them directly (Adam's two moments, no master copy), as the dry run shows.
    params = base * w + (counts.adapters * 4 if work.lora else 0)
    if get_stage(work.stage).reference_model and work.reference and (
            not work.lora or work.separate_reference):
        params += base * w  # frozen reference model (with LoRA the base itself is, unless ref_model)
    dense, expert = (counts.adapters, 0) if work.lora else (counts.dense, counts.expert)
    if trainable is not None:
        dense = trainable  # freeze: dense models only (the config rules refuse MoE)
    grads = grad_bytes(work) * (dense + expert)
    per_param = 8 if work.precision == "fp32" or work.lora else 12
    dp = layout.dp or 1
    dense_shard, expert_shard = 1, 1
    if work.use_distributed_optimizer:
        dense_shard = dp * layout.cp
        expert_shard = max(1, layout.tp * layout.cp * dp // (layout.ep * layout.etp))
    optimizer = per_param * dense // dense_shard + per_param * expert // expert_shard
    return params, grads, optimizer


def microbatch_tokens(work: Workload, layout: Layout) -> int:
    """Tokens of one micro-batch on one CP rank (DPO runs chosen and rejected together)."""
    rows = get_stage(work.stage).rows_per_example
    return -(-work.seq_length // layout.cp) * work.micro_batch_size * rows


def layer_bytes_per_token(model: ModelShape, work: Workload, layout: Layout) -> int:
    """Bytes one layer saves for backward per token, before the TP split (2 B per element);
    an MoE layer if ``model`` has any (layer_view gives the other kind)."""
    h, d, mats = model.hidden_size, model.kv_channels, mlp_matrices(model)
    hq, hkv = model.num_attention_heads * d, model.num_query_groups * d
    if model.is_mla:
        # Norm input, the down-projections' input, then the latents and heads above.
        attn = 2 * (2 * h + mla_saved_elements(model))
    else:
        # Attention: norm input, QKV input, Q/K/V, core-attention output (the proj input).
        attn = 2 * (2 * h + hq + 2 * hkv + hq)
    if work.flash_attention:
        attn += 4 * model.num_attention_heads  # fp32 softmax log-sum-exp per head
    elif "core_attn" not in recompute_modules(work.recompute):
        # Scores, softmax and dropout mask: Korthikanti's 5·a·s per token (s local under CP).
        attn += 5 * model.num_attention_heads * -(-work.seq_length // layout.cp)
    attn += 2 * _cp_attention_elements(model, work, layout)
    out = model.num_attention_heads * model.value_head_dim  # the output projection's input
    if not model.is_moe:
        # Norm input, fc1 input, fc1 output (gate+up), activation output (fc2 input).
        mlp = 2 * (2 * h + mats * model.ffn_hidden_size)
        return attn + mlp - _fp8_saving(work, h, out, h + model.ffn_hidden_size)
    fe, fs, k = model.expert_ffn_hidden_size, model.moe_shared_expert_ffn_hidden_size, \
        model.moe_router_topk
    # Each token is copied to k experts: the dispatched input plus that expert's fc1/act outputs;
    # the router keeps fp32 logits/probabilities per expert. Expert TP gathers ETP ranks' copies
    # onto each of them (whole h-wide inputs, 1/ETP of each output): ETP times the inputs.
    etp = layout.etp
    moe = 2 * (2 * h + k * (etp * h + mats * fe) + mats * fs) + 4 * model.num_experts
    gemm_inputs = k * (etp * h + fe) + (h + fs if fs else 0)  # experts' fc1, fc2; shared expert
    return attn + moe - _fp8_saving(work, h, out, gemm_inputs)


def _fp8_saving(work: Workload, qkv_input: int, proj_input: int, mlp_inputs: int) -> int:
    """Bytes per token an fp8 run saves on one layer: Transformer Engine keeps the fp8-cast
    input of each GEMM for its weight gradient (1 B an element instead of 2): the QKV input
    (its fused norm writes fp8 directly) and the MLP's fc1 and fc2 inputs. The attention
    output stays bf16 for the attention backward, so the projection's fp8 copy adds 1 B."""
    if work.precision != "fp8":
        return 0
    return qkv_input + mlp_inputs - proj_input


def _cp_attention_elements(model: ModelShape, work: Workload, layout: Layout) -> int:
    """Extra elements per local token that CP attention keeps for backward: all_gather keeps
    the whole sequence's keys and values (CP−1 more shares), a2a its head-sharded copies of Q,
    K, V and the output; TE's p2p ring keeps only its own shares."""
    cp, d = layout.cp, model.kv_channels
    hq, hkv = model.num_attention_heads * d, model.num_query_groups * d
    if cp == 1 or work.cp_comm_type == "p2p":
        return 0
    if work.cp_comm_type == "all_gather":
        return 2 * hkv * (cp - 1)
    return 2 * hq + 2 * hkv


def _inflight_layers(model: ModelShape, layout: Layout, work: Workload, rank: int) -> float:
    """Layer-activations a pipeline rank holds at its peak, in units of one micro-batch·layer.

    1F1B: rank r runs PP−r forward micro-batches before its first backward, so rank 0 holds PP
    micro-batches of its L/PP layers (L layers' worth in total). The interleaved schedule warms
    up 2·(PP−r−1) + (VP−1)·PP chunks of L/(PP·VP) layers before the first backward.
    """
    layers = layers_on_rank(model, layout, rank)
    if layout.vp is None:
        return min(layout.pp - rank, work.num_microbatches) * layers
    chunks = 2 * (layout.pp - rank - 1) + (layout.vp - 1) * layout.pp + 1
    return min(chunks, work.num_microbatches * layout.vp) * layers / layout.vp


def discarded_bytes_per_token(model: ModelShape, work: Workload, layout: Layout) -> int:
    """Bytes per token (before the TP split) of layer_bytes_per_token that the parts of a
    selective recompute free: layernorm both norms' outputs (the QKV input, 1 B an element
    where Transformer Engine keeps an fp8 copy; the MLP's or router's input); mlp a dense
    MLP's fc1 and activation outputs; moe all an MoE layer keeps but its input (expert
    inputs and outputs, router logits, a shared expert). core_attn frees only what unfused
    attention keeps (layer_bytes_per_token leaves it out)."""
    modules = recompute_modules(work.recompute)
    h, mats, fp8 = model.hidden_size, mlp_matrices(model), work.precision == "fp8"
    fe, fs, k = (model.expert_ffn_hidden_size, model.moe_shared_expert_ffn_hidden_size,
                 model.moe_router_topk)
    freed = 0
    if "layernorm" in modules:
        # Under TE only an MoE layer's pre-MLP norm is a norm of its own (it feeds the router).
        attention_norm = 0 if work.te_layers else h * (1 if fp8 else 2)
        mlp_norm = 0 if work.te_layers and not model.is_moe else \
            h * (1 if fp8 and not model.is_moe else 2)
        freed += attention_norm + mlp_norm
    if "mlp" in modules and not model.is_moe:
        freed += 2 * mats * model.ffn_hidden_size - (model.ffn_hidden_size if fp8 else 0)
    if "moe" in modules and model.is_moe:
        freed += 2 * (k * (layout.etp * h + mats * fe) + mats * fs) + 4 * model.num_experts
        if fp8:
            freed -= k * (layout.etp * h + fe) + fs
    elif "moe_act" in modules and model.is_moe:
        freed += k * fe * (1 if fp8 else 2)  # the activation's output, fc2's input
    if "mla_up_proj" in modules and model.is_mla:
        # Megatron checkpoints MLA's up-projections without their output: Q, K and V are
        # dropped once the attention kernel has run and rebuilt before its backward.
        freed += 2 * mla_qkv_elements(model)
    return freed


@dataclass(frozen=True)
class LayerActivations:
    """One layer's saved activations for one micro-batch on one GPU, by kind of layer (the
    same on every rank)."""

    dense: int  # a dense-MLP layer (every layer of a dense model)
    moe: int    # an MoE layer (0 for a dense model)

    def on_rank(self, kinds: tuple[int, int]) -> float:
        """The mean over a rank's (dense, MoE) layers: with all of a rank's layers in flight
        alike (1F1B) its sum over layers is this times the layer count."""
        layers = kinds[0] + kinds[1]
        return (kinds[0] * self.dense + kinds[1] * self.moe) / layers if layers else 0.0

    def largest(self, kinds: tuple[int, int]) -> int:
        """The larger working set of a kind the rank holds (what recompute brings back)."""
        return max(self.dense if kinds[0] else 0, self.moe if kinds[1] else 0)


def _layer_activation_bytes(model: ModelShape, layout: Layout, work: Workload) -> LayerActivations:
    def kept(kind: ModelShape) -> int:
        saved = layer_bytes_per_token(kind, work, layout) - discarded_bytes_per_token(
            kind, work, layout)
        return microbatch_tokens(work, layout) * saved // layout.tp

    return LayerActivations(kept(layer_view(model, False)),
                            kept(layer_view(model, True)) if model.is_moe else 0)


def block_layers(recompute: str) -> int | None:
    """N of a ``block:N`` recompute, else None."""
    return int(recompute.split(":", 1)[1]) if recompute.startswith("block:") else None


def recompute_level(recompute: str) -> str:
    """none, selective, block or full (``block:N`` is the block level, ``selective:A,B`` the
    selective one)."""
    return recompute.split(":", 1)[0]


def recompute_modules(recompute: str) -> frozenset[str]:
    """The layer parts a selective recompute runs again: ``selective`` is Megatron-Core's
    default (core_attn), ``selective:A,B`` names them; none for the other levels."""
    if recompute == "selective":
        return frozenset({"core_attn"})
    if recompute.startswith("selective:"):
        return frozenset(recompute.split(":", 1)[1].split(","))
    return frozenset()


def chunk_layers(model: ModelShape, layout: Layout, rank: int) -> list[int]:
    """Layers of each model chunk (virtual stage) pipeline rank ``rank`` holds."""
    if layout.pipeline_layout is not None:
        return list(layout.pipeline_layout[rank::layout.pp])
    chunks = layout.vp or 1
    return [model.num_layers // (layout.pp * chunks)] * chunks


def recomputed_share(model: ModelShape, layout: Layout, work: Workload, rank: int) -> float:
    """Share of pipeline rank ``rank``'s layers whose forward runs again in the backward:
    all with full recompute, the first N of each chunk with ``block:N``, none otherwise."""
    if work.recompute == "full":
        return 1.0
    n = block_layers(work.recompute)
    if n is None:
        return 0.0
    chunks = chunk_layers(model, layout, rank)
    return sum(min(n, c) for c in chunks) / max(1, sum(chunks))


def _activation_memory(model: ModelShape, layout: Layout, work: Workload, rank: int,
                       kinds: LayerActivations) -> int:
    """``kinds``: _layer_activation_bytes(), computed once for all the ranks sized."""
    share = recomputed_share(model, layout, work, rank)
    inflight = _inflight_layers(model, layout, work, rank)
    on_rank = layer_kinds_on_rank(model, layout, rank)
    per_layer, working = kinds.on_rank(on_rank), kinds.largest(on_rank)
    if share:
        # A recomputed layer keeps only its (sequence-parallel) input; backward re-runs one
        # layer at a time, so one layer's full activations come back on top.
        stored = microbatch_tokens(work, layout) * 2 * model.hidden_size // layout.tp
        total = inflight * (share * stored + (1 - share) * per_layer) + working
    else:
        total = inflight * per_layer
    if rank == layout.pp - 1:
        # Loss: bf16 logits plus the fp32 softmax the fused vocab-parallel cross entropy keeps,
        # once for the main head and once per MTP depth; each depth also keeps a layer's
        # activations and its 2h-wide projection input (one micro-batch: the last stage).
        tokens = microbatch_tokens(work, layout)
        depths = mtp_on_rank(layout, work, rank)
        total += (1 + depths) * tokens * padded_vocab(model, layout.tp) // layout.tp * 6
        mtp_layer = kinds.moe if model.is_moe else kinds.dense
        total += depths * (mtp_layer + tokens * 2 * 2 * model.hidden_size // layout.tp)
    return int(total)


def busiest_ranks(model: ModelShape, layout: Layout) -> list[int]:
    """Pipeline ranks that can peak: the first (most micro-batches in flight, embedding), the
    last (output layer, logits), with an explicit layout the one holding most layers and, where
    dense and MoE layers mix, the first holding the most MoE layers (DeepSeek-V3's first stage
    holds its three dense layers, lighter than the MoE layers of the second)."""
    ranks = {0, layout.pp - 1}
    if layout.pipeline_layout is not None:
        loads = [layers_on_rank(model, layout, r) for r in range(layout.pp)]
        ranks.add(loads.index(max(loads)))
    if model.dense_layer_ids and layout.pp > 2:
        moe = [layer_kinds_on_rank(model, layout, r)[1] for r in range(layout.pp)]
        ranks.add(moe.index(max(moe)))
    return sorted(ranks)


def estimate_memory(model: ModelShape, layout: Layout, work: Workload) -> MemoryEstimate:
    """Per-GPU memory of the busiest pipeline stage (first or last) for a resolved layout."""
    per_layer = _layer_activation_bytes(model, layout, work)
    return max((rank_memory(model, layout, work, rank, per_layer)
                for rank in busiest_ranks(model, layout)), key=lambda e: e.total)


def rank_memory(model: ModelShape, layout: Layout, work: Workload, rank: int,
                per_layer: LayerActivations | None = None) -> MemoryEstimate:
    """Per-GPU memory of pipeline rank ``rank`` (``hpc-mca plan --dry-run`` compares its
    static terms with what Megatron builds there)."""
    per_layer = per_layer or _layer_activation_bytes(model, layout, work)
    counts = stage_counts(model, layout, rank, work.lora_rank, mtp_on_rank(layout, work, rank))
    trainable = (frozen_trainable(model, layout, rank, work.freeze)
                 if work.freeze is not None and not work.lora else None)
    params, grads, optimizer = _state_memory(counts, layout, work, trainable)
    vision = vision_activation_memory(model, layout, work) if rank == 0 else 0
    return MemoryEstimate(params, grads, optimizer,
                          _activation_memory(model, layout, work, rank, per_layer) + vision,
                          vision)


def vision_activation_memory(model: ModelShape, layout: Layout, work: Workload) -> int:
    """What a VL model's vision tower keeps on the first pipeline stage (each of its TP ranks
    runs the whole tower on all the micro-batch's images): one micro-batch's worth
    (vision.py) for each micro-batch whose first chunk is in flight at the stage's peak."""
    if model.vision is None or not work.vision_trains:
        return 0
    rows = work.micro_batch_size * get_stage(work.stage).rows_per_example
    per_microbatch = model.vision.microbatch_bytes(
        seq_length=work.seq_length, rows=rows, max_pixels=work.image_max_pixels,
        trains=work.vision_trains, element=2)  # 2 B an element, as layer_bytes_per_token
    return per_microbatch * first_chunk_inflight(layout, work)


def first_chunk_inflight(layout: Layout, work: Workload) -> int:
    """Micro-batches whose first model chunk pipeline rank 0 holds at its peak: PP under 1F1B;
    interleaved, the first chunk's share of the warm-up forwards, which run PP micro-batches
    a chunk at a time (see _inflight_layers)."""
    if layout.vp is None:
        return min(layout.pp, work.num_microbatches)
    warmup = 2 * (layout.pp - 1) + (layout.vp - 1) * layout.pp + 1
    group = layout.pp * layout.vp
    first = warmup // group * layout.pp + min(warmup % group, layout.pp)
    return min(first, work.num_microbatches)
