"""Topology planner: memory model, plan(), forced layouts, presets, bad input and the table."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpc_mca.topology import (
    GPU_PRESETS,
    Layout,
    LayoutError,
    ModelShape,
    PlanRequest,
    Workload,
    check_layout,
    estimate_memory,
    format_plan_table,
    get_gpu,
    plan,
)
from hpc_mca.topology.cost import estimate_step_time
from hpc_mca.topology.hardware import GiB
from hpc_mca.topology.memory import block_layers, stage_counts
from hpc_mca.topology.search import MIN_CP_TOKENS

LLAMA3_8B = ModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32,
                       num_query_groups=8, ffn_hidden_size=14336, vocab_size=128256)
QWEN3_30B_A3B = ModelShape(num_layers=48, hidden_size=2048, num_attention_heads=32,
                           num_query_groups=4, head_dim=128, ffn_hidden_size=6144,
                           vocab_size=151936, num_experts=128, moe_ffn_hidden_size=768,
                           moe_router_topk=8)
LLAMA3_405B = ModelShape(num_layers=126, hidden_size=16384, num_attention_heads=128,
                         num_query_groups=8, ffn_hidden_size=53248, vocab_size=128256)

# The public Megatron-Bridge recipe: Llama3-8B pretrain on 16×H100 at seq 16384, TP4 PP2 CP2
# (Transformer Engine: the p2p ring for CP attention).
RECIPE = dict(model=LLAMA3_8B, nodes=2, gpus_per_node=8, gpu="H100-80GB", seq_length=16384,
              global_batch_size=512, cp_comm_type="p2p")


def _valid(p) -> list[str]:
    req = p.request
    return check_layout(p.layout, req.world_size, req.shape, gpus_per_node=req.node_size,
                        global_batch_size=req.global_batch_size,
                        micro_batch_size=p.micro_batch_size, seq_length=req.seq_length,
                        sequence_packing=req.sequence_packing)


# --- acceptance --------------------------------------------------------------------------------

def test_recipe_layout_is_accepted_and_fits():
    p = plan(**RECIPE, layout=Layout(tp=4, pp=2, cp=2))
    assert p.forced and p.layout == Layout(tp=4, pp=2, cp=2, dp=1)
    assert p.memory.total <= p.usable_bytes and p.recompute == "none"
    assert _valid(p) == []


def test_planner_estimate_for_its_own_choice_beats_the_recipe():
    """The acceptance figure: the search's choice is within 10% of the published layout's
    estimated step time or faster, and keeps the 10% memory headroom the recipe has."""
    forced = plan(**RECIPE, layout=Layout(tp=4, pp=2, cp=2))
    own = forced.searched
    assert own is not None and own == plan(**RECIPE)
    assert own.step_time.total <= 1.10 * forced.step_time.total
    assert own.memory.total <= 0.9 * own.usable_bytes
    assert not own.forced and own.searched is None


def test_planner_own_plan_for_recipe_fits_and_is_valid():
    p = plan(**RECIPE)
    assert _valid(p) == [] and p.memory.total <= p.usable_bytes
    assert p.layout.dp * p.layout.model_parallel_size == 16
    assert "\n" not in p.reason and p.layout.describe() in p.reason


def test_sequence_parallel_with_tp_on_every_gpu_and_for_moe_on_cpu():
    small = ModelShape(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=4,
                       ffn_hidden_size=512, vocab_size=128)
    moe = replace(small, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128)
    common = dict(nodes=1, gpus_per_node=2, seq_length=64, global_batch_size=8)
    for gpu in (name for name in GPU_PRESETS if name != "CPU"):
        assert plan(model=small, **common, gpu=gpu, layout=Layout(tp=2)).sequence_parallel
        assert not plan(model=small, **common, gpu=gpu, layout=Layout(tp=1)).sequence_parallel
    # Dense on CPU: gloo makes its extra collectives slower than the memory is worth.
    assert not plan(model=small, **common, gpu="CPU", layout=Layout(tp=2)).sequence_parallel
    # MoE under TP: Megatron's MoE layer refuses to train without it, on any hardware.
    assert plan(model=moe, **common, gpu="CPU", layout=Layout(tp=2)).sequence_parallel
    assert not plan(model=moe, **common, gpu="CPU", layout=Layout(tp=1, ep=2)).sequence_parallel


def test_recipe_memory_matches_hand_count():
    """TP4 PP2 CP2 DP1, first pipeline stage, counted by hand from the formulas."""
    layout = Layout(tp=4, pp=2, cp=2).resolved(16)
    work = Workload(seq_length=16384, num_microbatches=512, cp_comm_type="p2p")
    est = estimate_memory(LLAMA3_8B, layout, work)
    attn = 4096 * 4096 * 2 + 2 * 4096 * 1024          # Q and O full width, K and V GQA-narrow
    mlp = 3 * 4096 * 14336                             # SwiGLU: gate, up, down
    per_layer = (attn + mlp) // 4 + 2 * 4096           # TP4 shards; two norms replicated
    embedding = 128512 * 4096 // 4                     # vocab padded to a multiple of 128·TP
    params = 16 * per_layer + embedding                # 16 layers on a PP2 stage
    assert est.params == 2 * params                    # bf16
    assert est.grads == 4 * params                     # fp32 main_grad
    assert est.optimizer == 12 * params // 2           # Adam + master, sharded over DP·CP = 2
    # 8192 tokens per CP rank; 34·h bytes per token and layer (+ fp32 LSE), split over TP4;
    # 1F1B keeps PP=2 micro-batches of 16 layers in flight on the first stage.
    per_token = 34 * 4096 + 4 * 32
    assert est.activations == 32 * (8192 * per_token // 4)
    assert round(est.total / GiB, 1) == 19.7
    # all_gather keeps the other CP rank's K and V (2·1024 bf16 elements a token) per layer;
    # a2a keeps head-sharded copies of Q, K, V and the output.
    gathered = estimate_memory(LLAMA3_8B, layout, replace(work, cp_comm_type="all_gather"))
    assert gathered.activations == 32 * (8192 * (per_token + 2 * 2 * 1024) // 4)
    a2a = estimate_memory(LLAMA3_8B, layout, replace(work, cp_comm_type="a2a"))
    assert a2a.activations == 32 * (8192 * (per_token + 2 * (2 * 4096 + 2 * 1024)) // 4)


def test_mtp_depths_are_counted_on_the_last_stage():
    """One MTP depth: the last pipeline stage gains a layer, a 2h→h projection, three norms
    and its own copy of the embedding (Megatron's MTP embeds its input there) of parameters
    (TP4 PP2), and, on TP4 CP2 (one stage), a layer's activations, its 2h-wide
    projection input and one more set of logits."""
    h = 4096
    layer = (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336) // 4 + 2 * h
    piped = Layout(tp=4, pp=2, cp=2).resolved(16)
    params = [stage_counts(LLAMA3_8B, piped, 1, 16, mtp).dense for mtp in (0, 1)]
    embedding = 128512 * h // 4  # Llama-3's 128,256 rows padded to a multiple of 128 × TP4
    assert params[1] - params[0] == layer + 2 * h * h // 4 + 3 * h + embedding
    assert stage_counts(LLAMA3_8B, piped, 0, 16) == stage_counts(LLAMA3_8B, piped, 0, 16, 0)
    layout = Layout(tp=4, cp=2).resolved(16)
    work = Workload(seq_length=16384, num_microbatches=256, cp_comm_type="p2p")
    est = [estimate_memory(LLAMA3_8B, layout, replace(work, mtp_num_layers=k)) for k in (0, 1)]
    tokens, per_token = 8192, 34 * 4096 + 4 * 32
    per_layer, logits = tokens * per_token // 4, tokens * 128512 // 4 * 6
    assert est[0].activations == 32 * per_layer + logits
    assert est[1].activations == 33 * per_layer + tokens * 2 * 2 * h // 4 + 2 * logits


# --- memory model directions ---------------------------------------------------------------------

def _est(layout: Layout, world: int, **work) -> object:
    base = dict(seq_length=4096, num_microbatches=64)
    return estimate_memory(LLAMA3_8B, layout.resolved(world), Workload(**{**base, **work}))


def test_lora_trains_only_adapters():
    full, lora = _est(Layout(), 8), _est(Layout(), 8, lora=True)
    assert lora.grads < full.grads / 100 and lora.optimizer < full.optimizer / 100
    assert lora.params > full.params  # base weights plus adapters
    assert lora.activations == full.activations


def test_dpo_adds_reference_and_pairs():
    pt, dpo = _est(Layout(), 8), _est(Layout(), 8, stage="dpo")
    assert dpo.params == 2 * pt.params and dpo.grads == pt.grads
    assert dpo.activations > 1.9 * pt.activations
    assert _est(Layout(), 8, stage="dpo", lora=True).params < dpo.params  # base is reference


def test_distributed_optimizer_shards_by_dp():
    sharded = _est(Layout(), 8)
    replicated = _est(Layout(), 8, use_distributed_optimizer=False)
    assert replicated.optimizer == pytest.approx(8 * sharded.optimizer, rel=1e-6)


def test_full_recompute_shrinks_activations():
    # Layer activations drop ~17x (2·h of 34·h per token kept); the loss logits stay.
    assert _est(Layout(), 8, recompute="full").activations < _est(Layout(), 8).activations / 4


def test_tp_and_cp_divide_activations():
    one = _est(Layout(), 8, seq_length=8192).activations
    assert _est(Layout(tp=2, cp=2), 8, seq_length=8192).activations < one / 3.5


def test_no_flash_attention_costs_score_memory():
    flash = _est(Layout(), 8).activations
    assert _est(Layout(), 8, flash_attention=False).activations > 2 * flash
    assert _est(Layout(), 8, flash_attention=False, recompute="selective").activations == \
        pytest.approx(flash, rel=0.01)


def test_fp32_weights_and_optimizer():
    bf16, fp32 = _est(Layout(), 8), _est(Layout(), 8, precision="fp32")
    assert fp32.params == 2 * bf16.params
    assert fp32.optimizer == pytest.approx(bf16.optimizer * 8 / 12, rel=1e-6)


def test_moe_experts_shard_over_ep():
    layout = Layout(ep=8).resolved(8)
    est = estimate_memory(QWEN3_30B_A3B, layout, Workload(seq_length=4096))
    dense_only = estimate_memory(QWEN3_30B_A3B, Layout(ep=1).resolved(8), Workload(4096))
    assert est.params < dense_only.params / 4


def test_expert_tensor_parallel_keeps_the_gathered_copies():
    """TP4 with ETP4: each rank keeps the whole h-wide input of every copy its ETP group
    gathered (4× ETP1's) and a quarter of each copy's fc1 and activation outputs (the same
    bytes as ETP1's whole outputs of a quarter of the copies): 3·k·h more per token, over TP."""
    from hpc_mca.topology.memory import layer_bytes_per_token
    work = Workload(seq_length=4096)
    one = layer_bytes_per_token(QWEN3_30B_A3B, work, Layout(tp=4, ep=2).resolved(8))
    four = layer_bytes_per_token(QWEN3_30B_A3B, work, Layout(tp=4, ep=2, etp=4).resolved(32))
    k, h = QWEN3_30B_A3B.moe_router_topk, QWEN3_30B_A3B.hidden_size
    assert four - one == 2 * 3 * k * h


def test_pipeline_interleaving_memory_factor():
    # Interleaving holds (1 + (PP-1)/(PP·VP)) times the 1F1B activations on the first stage.
    plain = _est(Layout(pp=4), 4, num_microbatches=64).activations
    inter = _est(Layout(pp=4, vp=2), 4, num_microbatches=64).activations
    assert inter / plain == pytest.approx(1 + 3 / 8, rel=0.01)


# --- plan() choices -----------------------------------------------------------------------------

def test_small_model_is_pure_data_parallel():
    p = plan(model=LLAMA3_8B, nodes=4, seq_length=2048, global_batch_size=256, lora=True)
    assert (p.layout.tp, p.layout.pp, p.layout.cp) == (1, 1, 1) and p.layout.dp == 32
    assert p.micro_batch_size == 4  # grows to 8k tokens per micro-batch
    assert "fits one GPU" in p.reason


def test_long_sequence_uses_context_parallel():
    p = plan(model=LLAMA3_8B, nodes=4, seq_length=131072, global_batch_size=64)
    assert p.layout.cp > 1 and "CP" in p.reason and _valid(p) == []


def test_no_cp_chunk_below_published_lengths_unless_memory_requires_it():
    """Published runs split sequences into at least 4096 tokens a CP rank (MIN_CP_TOKENS): at
    8k on 64 GPUs the planner stays at CP ≤ 2. Where nothing else fits (a small-head model on
    4 single-GPU nodes of 8 GiB), it takes the shorter chunks and says why."""
    model70 = ModelShape(num_layers=80, hidden_size=8192, num_attention_heads=64,
                         num_query_groups=8, ffn_hidden_size=28672, vocab_size=128256)
    p = plan(model=model70, nodes=8, seq_length=8192, global_batch_size=128)
    assert p.layout.cp <= 8192 // MIN_CP_TOKENS
    assert all(o.layout.cp <= 2 for o in p.ranking)
    small = ModelShape(num_layers=24, hidden_size=896, num_attention_heads=14,
                       num_query_groups=2, ffn_hidden_size=4864, vocab_size=151936,
                       tie_word_embeddings=True)
    forced = plan(model=small, nodes=4, gpus_per_node=1, seq_length=4096, global_batch_size=16,
                  gpu_memory_gib=8)
    assert forced.layout.cp == 2 and _valid(forced) == []
    assert ("CP2 splits the 4096-token sequences into 2048-token chunks, below the 4096 of any "
            "published run, because no layout with longer chunks fits the memory") in forced.reason
    roomy = plan(model=small, nodes=4, gpus_per_node=1, seq_length=4096, global_batch_size=16,
                 gpu_memory_gib=80)
    assert roomy.layout.cp == 1


def test_moe_uses_expert_parallel():
    p = plan(model=QWEN3_30B_A3B, nodes=2, seq_length=4096, global_batch_size=512)
    assert p.layout.ep > 1 and "experts" in p.reason and _valid(p) == []


def test_moe_dispatcher_is_estimate_only_and_refused_by_name():
    """flex (DeepEP/HybridEP) sends a token once a node: a cross-node EP costs less with it.
    Any other name is refused in one line that lists the valid ones."""
    job = dict(model=QWEN3_30B_A3B, nodes=2, seq_length=4096, global_batch_size=512,
               layout=Layout(ep=16))
    alltoall, flex = plan(**job), plan(**job, moe_dispatcher="flex")
    assert flex.step_time.expert_parallel < alltoall.step_time.expert_parallel / 2
    with pytest.raises(LayoutError) as err:
        plan(**job, moe_dispatcher="deepep")
    assert str(err.value) == "moe_dispatcher='deepep' is not valid; valid: alltoall, flex"


def test_pipeline_gets_interleaved_when_the_bubble_costs_more_than_the_sends():
    """70B on 8192 GPUs leaves 32 micro-batches a pipeline: interleaving pays for its extra
    point-to-point sends, and the chosen depth beats the plain pipeline of the same split."""
    model = ModelShape(num_layers=80, hidden_size=8192, num_attention_heads=64,
                       num_query_groups=8, ffn_hidden_size=28672, vocab_size=128256)
    p = plan(model=model, nodes=1024, seq_length=8192, global_batch_size=2048)
    assert p.layout.pp > 1 and p.layout.vp is not None and _valid(p) == []
    plain = plan(model=model, nodes=1024, seq_length=8192, global_batch_size=2048,
                 layout=replace(p.layout, vp=None, dp=None), recompute=p.recompute)
    assert p.step_time.pipeline_bubble < plain.step_time.pipeline_bubble
    assert p.step_time.total < plain.step_time.total
    assert f"VP{p.layout.vp} cuts the pipeline bubble" in p.reason


def test_recompute_only_as_much_as_nothing_less_fits():
    """One GPU per node rules out TP; PP and CP cannot shrink 16k-token activations enough, so
    part of every layer recomputes: the norms and the MLP (Megatron's recompute_modules). Neither
    the norms alone nor none fit at all. The block level (the
    fewest whole layers a chunk that fit: one fewer does not) is no faster beyond the 1% tie, so
    the plainer level is taken; full recompute of every layer fits but is slower."""
    job = dict(model=LLAMA3_8B, nodes=2, gpus_per_node=1, seq_length=16384, global_batch_size=16,
               gpu="H200-141GB")
    p = plan(**job)
    assert p.recompute == "selective:layernorm,mlp"
    assert "with selective:layernorm,mlp recompute" in p.reason
    budget = 0.9 * p.usable_bytes
    assert p.memory.total <= budget
    with pytest.raises(LayoutError, match="needs .* with recompute=selective:layernorm,"):
        plan(**job, layout=p.layout, recompute="selective:layernorm")
    block = plan(**job, recompute="block")  # the block level's own search
    n = block_layers(block.recompute)
    assert n is not None and 1 <= n < LLAMA3_8B.num_layers // block.layout.pp
    assert f"first {n} layer(s) of each pipeline chunk (block), the fewest that fit" in block.reason
    assert block.memory.total <= budget
    assert block.step_time.total >= 0.99 * p.step_time.total  # not faster beyond the tie
    if n > 1:
        fewer = plan(**job, layout=block.layout, recompute=f"block:{n - 1}")
        assert fewer.memory.total > budget
    full = plan(**job, layout=p.layout, recompute="full")
    assert full.memory.total < p.memory.total and full.step_time.total > p.step_time.total
    with pytest.raises(LayoutError, match="needs .* with recompute=none"):
        plan(**job, layout=p.layout, recompute="none")


def test_block_recompute_memory_and_time_by_hand():
    """block:N keeps only the input of the first N layers of each chunk (TP4 PP2 VP2 on 32
    layers: chunks of 8, N=3) and runs their forward again in the backward."""
    layout = Layout(tp=4, pp=2, vp=2).resolved(16)
    work = Workload(seq_length=16384, num_microbatches=64)
    per_token = 34 * 4096 + 4 * 32
    per_layer = 16384 * per_token // 4
    stored = 16384 * 2 * 4096 // 4
    none, block = (estimate_memory(LLAMA3_8B, layout, replace(work, recompute=r))
                   for r in ("none", "block:3"))
    inflight = (2 * (2 - 0 - 1) + (2 - 1) * 2 + 1) * 16 / 2  # rank 0: 5 chunks of 8 layers
    assert none.activations == int(inflight * per_layer)
    assert block.activations == int(inflight * (3 / 8 * stored + 5 / 8 * per_layer) + per_layer)
    h100 = get_gpu("H100-80GB")
    t_none, t_block, t_full = (estimate_step_time(LLAMA3_8B, layout, replace(work, recompute=r),
                                                  h100, 8) for r in ("none", "block:3", "full"))
    assert t_none.recomputation == 0 and t_block.compute == pytest.approx(t_none.compute)
    assert t_block.recomputation == pytest.approx(3 / 8 * t_full.recomputation)


def test_the_search_keeps_a_memory_headroom():
    """A layout that fits the usable memory but not the 10% headroom is never chosen by the
    search, though a user may force it (and is told it sits inside the headroom)."""
    # 8B at 4k on 8 GPUs: PP2 with 2-sequence micro-batches fills ~97% of usable.
    common = dict(model=LLAMA3_8B, nodes=1, seq_length=4096, global_batch_size=64)
    tight = plan(**common, layout=Layout(pp=2), recompute="none", micro_batch_size=2)
    assert 0.9 * tight.usable_bytes < tight.memory.total <= tight.usable_bytes
    assert "inside the 10% headroom" in tight.reason
    chosen = plan(**common)
    assert chosen.memory.total <= 0.9 * chosen.usable_bytes


def test_plan_is_deterministic():
    assert plan(**RECIPE) == plan(**RECIPE)


def test_plan_accepts_request_object_and_overrides():
    req = PlanRequest(**RECIPE)
    assert plan(req) == plan(**RECIPE)
    wider = plan(req, nodes=4)
    lay = wider.layout
    assert wider.request.nodes == 4 and lay.tp * lay.pp * lay.cp * lay.dp == 32


def test_gpu_memory_override_and_presets():
    assert set(GPU_PRESETS) == {"H100-80GB", "H200-141GB", "A100-40GB", "A100-80GB", "CPU"}
    assert get_gpu("h100").name == "H100-80GB"
    assert get_gpu("A100-80GB", memory_gib=40).memory_bytes == 40 * GiB
    tiny = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                      ffn_hidden_size=256, vocab_size=1000)
    p = plan(model=tiny, nodes=1, gpu="CPU", gpus_per_node=2, seq_length=128,
             global_batch_size=8)
    assert p.layout.dp == 2 and p.usable_bytes < 16 * GiB


# --- bad input: one line each -----------------------------------------------------------------

def _error_lines(**kwargs) -> list[str]:
    with pytest.raises(LayoutError) as err:
        plan(**{**RECIPE, **kwargs})
    assert str(err.value) == "\n".join(err.value.violations)
    return err.value.violations


def test_zero_nodes():
    assert _error_lines(nodes=0) == ["nodes=0 must be a positive integer"]


def test_unknown_gpu_preset_names_valid_ones():
    assert _error_lines(gpu="V100") == [
        "gpu='V100' is not a known GPU preset; valid: A100-40GB, A100-80GB, CPU, H100-80GB, "
        "H200-141GB"]


def test_forced_tp3_with_32_heads():
    [line] = _error_lines(layout=Layout(tp=3))
    assert line.startswith("tensor_parallel_size=3 does not divide num_attention_heads=32")
    assert line.endswith("valid: 1, 2, 4, 8")


def test_missing_config_path(tmp_path):
    [line] = _error_lines(model=tmp_path / "llama")
    assert line.startswith("model config not found: ") and "llama" in line


def test_other_bad_fields_each_one_line():
    lines = _error_lines(stage="ppo", precision="int4", seq_length=0, recompute="some")
    assert lines == ["seq_length=0 must be a positive integer",
                     "stage='ppo' is not valid; valid: pt, sft, dpo, kto",
                     "precision='int4' is not valid; valid: bf16, fp16, fp8, fp32",
                     "recompute='some' is not valid; valid: none, selective, block, full "
                     "(or block:N, N ≥ 1, or selective:A,B with A, B from core_attn, "
                     "layernorm, mlp)"]
    assert _error_lines(recompute="block:0") == [
        "recompute='block:0' is not valid; valid: none, selective, block, full (or block:N, "
        "N ≥ 1, or selective:A,B with A, B from core_attn, layernorm, mlp)"]
    # The parts of a dense model (this trainer's: no moe, no grouped-GEMM moe_act).
    for parts in ("layernorm,moe", "mlp,mlp", "moe_act", ""):
        assert _error_lines(recompute=f"selective:{parts}") == [
            f"recompute='selective:{parts}' names a layer part twice or one this model has "
            "not; valid: selective:A,B with each of A, B once from core_attn, layernorm, mlp"]


def test_fp8_needs_hopper():
    [line] = _error_lines(gpu="A100-80GB", precision="fp8")
    assert line.startswith("precision='fp8' needs an FP8 GPU (H100-80GB, H200-141GB)")


def test_forced_layout_that_does_not_fit():
    [line] = _error_lines(model=LLAMA3_405B, nodes=1, layout=Layout(tp=8))
    assert "needs" in line and "usable on H100-80GB" in line


def test_nothing_fits():
    [line] = _error_lines(model=LLAMA3_405B, nodes=1)
    assert line.startswith("no layout fits 1 node(s) × 8 H100-80GB")


def test_no_valid_split_suggests_node_counts():
    # 19 × 8 GPUs: the factor 19 fits neither DP (128 is a power of two), TP (> 8) nor PP
    # (32 layers over 19 stages would leave the first stage empty).
    [line] = _error_lines(nodes=19, seq_length=4096, global_batch_size=128)
    assert line.startswith("nodes=19 gives world_size=152") and line.endswith("valid nodes: 18, 20")


def test_uneven_pipeline_gets_balanced_layout():
    # 3 nodes × 8 with a power-of-two batch: the factor 3 has to go into PP, 32 layers / 3.
    p = plan(**{**RECIPE, "nodes": 3, "seq_length": 4096, "global_batch_size": 128})
    assert p.layout.pp % 3 == 0 and sum(p.layout.pipeline_layout) == 32
    assert _valid(p) == []


# --- table ------------------------------------------------------------------------------------

def test_format_plan_table():
    text = format_plan_table(plan(**RECIPE, layout=Layout(tp=4, pp=2, cp=2)))
    lines = text.splitlines()
    assert lines[0].startswith("plan for 32-layer model: 2 node(s) × 8 H100-80GB (world 16)")
    assert any(line.strip().startswith("layout") and "TP4 PP2 CP2 DP1" in line
               and "CP attention p2p" in line for line in lines)
    assert "params 1.9 GiB | grads 3.7 GiB | optimizer 5.6 GiB | activations 8.5 GiB" in text
    assert "total 19.7 GiB of 70.1 GiB usable" in text and "why" in text
    p = plan(**RECIPE, layout=Layout(tp=4, pp=2, cp=2))
    assert f"step time   ~{p.step_time.total:.3g} s estimated" in text
    assert "compute 8" in text and "tensor parallel 1" in text  # the largest causes
    own = p.searched.layout.describe()
    assert any(line.strip().startswith(f"planner     would choose {own}") for line in lines)
