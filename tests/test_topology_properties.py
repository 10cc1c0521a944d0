"""Property tests: check_layout against an independent oracle, and the planner over
nodes 1..1024 × GPUs/node {1, 2, 4, 8} × dense, GQA and MoE shapes."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_mca.topology import Layout, LayoutError, ModelShape, PlanRequest, check_layout, plan
from hpc_mca.topology.search import MIN_CP_TOKENS, PLAN_HEADROOM, TIE, candidates

SHAPES = {
    # Qwen2.5-0.5B-like: 14 heads / 2 KV heads leave TP only 1 or 2; tied embeddings.
    "dense-small": ModelShape(num_layers=24, hidden_size=896, num_attention_heads=14,
                              num_query_groups=2, ffn_hidden_size=4864, vocab_size=151936,
                              tie_word_embeddings=True),
    # GPT-2-small-like: no GQA, two-matrix MLP.
    "mha": ModelShape(num_layers=12, hidden_size=768, num_attention_heads=12,
                      num_query_groups=12, ffn_hidden_size=3072, vocab_size=50257,
                      gated_linear_unit=False),
    "gqa-8b": ModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32,
                         num_query_groups=8, ffn_hidden_size=14336, vocab_size=128256),
    "dense-70b": ModelShape(num_layers=80, hidden_size=8192, num_attention_heads=64,
                            num_query_groups=8, ffn_hidden_size=28672, vocab_size=128256),
    "dense-405b": ModelShape(num_layers=126, hidden_size=16384, num_attention_heads=128,
                             num_query_groups=8, ffn_hidden_size=53248, vocab_size=128256),
    "mixtral-8x7b": ModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32,
                               num_query_groups=8, ffn_hidden_size=14336, vocab_size=32000,
                               num_experts=8, moe_router_topk=2),
    "qwen3-moe-30b": ModelShape(num_layers=48, hidden_size=2048, num_attention_heads=32,
                                num_query_groups=4, head_dim=128, ffn_hidden_size=6144,
                                vocab_size=151936, num_experts=128, moe_ffn_hidden_size=768,
                                moe_router_topk=8),
}

shapes = st.sampled_from(sorted(SHAPES)).map(SHAPES.__getitem__)
gpus_per_node = st.sampled_from([1, 2, 4, 8])
nodes = st.integers(min_value=1, max_value=1024)


def oracle_valid(lay: Layout, world: int, model: ModelShape, gpn: int, gbs: int, mbs: int,
                 seq: int) -> bool:
    """The rules restated as plain arithmetic, written independently of rules.py."""
    if world % (lay.tp * lay.pp * lay.cp):
        return False
    dp = world // (lay.tp * lay.pp * lay.cp)
    sp = lay.tp > 1
    tp_ok = (gpn % lay.tp == 0 and model.num_attention_heads % lay.tp == 0
             and model.num_query_groups % lay.tp == 0  # whole KV heads per TP rank
             and model.ffn_hidden_size % lay.tp == 0)
    vp = lay.vp or 1
    pp_ok = model.num_layers % (lay.pp * vp) == 0 and (lay.vp is None or lay.pp > 1)
    align = (2 * lay.cp if lay.cp > 1 else 1) * (lay.tp if sp else 1)
    if model.is_moe:
        moe_ok = (model.num_experts % lay.ep == 0
                  and (lay.tp * lay.cp * dp) % (lay.ep * lay.etp) == 0
                  and model.expert_ffn_hidden_size % lay.etp == 0 and gpn % lay.etp == 0)
    else:
        moe_ok = lay.ep == 1
    batch_ok = gbs % (mbs * dp) == 0 and (
        lay.vp is None or lay.pp == 1 or (gbs // (mbs * dp)) % lay.pp == 0)
    return tp_ok and pp_ok and seq % align == 0 and moe_ok and batch_ok


layouts = st.builds(
    Layout,
    tp=st.sampled_from([1, 2, 3, 4, 6, 8, 16]),
    pp=st.sampled_from([1, 2, 3, 4, 5, 8]),
    cp=st.sampled_from([1, 2, 3, 4, 8]),
    ep=st.sampled_from([1, 2, 3, 4, 8, 16]),
    etp=st.sampled_from([1, 2, 4]),
    vp=st.sampled_from([None, 1, 2, 3, 4]),
)


@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(lay=layouts, n=st.integers(1, 64), gpn=gpus_per_node, model=shapes,
       gbs=st.sampled_from([1, 6, 32, 96, 128, 256, 1000, 1024]), mbs=st.sampled_from([1, 2, 3]),
       seq=st.sampled_from([1000, 2048, 4096, 6144, 32768]))
def test_check_layout_agrees_with_oracle(lay, n, gpn, model, gbs, mbs, seq):
    world = n * gpn
    lines = check_layout(lay, world, model, gpus_per_node=gpn, global_batch_size=gbs,
                         micro_batch_size=mbs, seq_length=seq)
    assert (lines == []) == oracle_valid(lay, world, model, gpn, gbs, mbs, seq), lines
    assert all("\n" not in line and "; valid" in line for line in lines)


_FIELDS = {"tensor_parallel_size": "tp", "pipeline_parallel_size": "pp",
           "expert_parallel_size": "ep", "expert_tensor_parallel_size": "etp"}


@settings(max_examples=300, deadline=None, database=None)
@given(lay=layouts, n=st.integers(1, 64), gpn=gpus_per_node, model=shapes)
def test_suggested_values_fix_their_line(lay, n, gpn, model):
    """Each 'valid:' value for a layout field makes that field's violation go away."""
    world = n * gpn
    for line in check_layout(lay, world, model, gpus_per_node=gpn):
        match = re.match(r"(\w+)=\d+ .*; valid: ([\d, ]+)$", line)
        if not match or match[1] not in _FIELDS:
            continue
        for value in map(int, match[2].split(", ")):
            fixed = Layout(**{**lay.__dict__, _FIELDS[match[1]]: value})
            again = check_layout(fixed, world, model, gpus_per_node=gpn)
            assert not any(other.startswith(match[1] + "=") for other in again), (line, again)


# --- planner -----------------------------------------------------------------------------------


@st.composite
def plan_inputs(draw):
    n, gpn = draw(nodes), draw(gpus_per_node)
    world = n * gpn
    # Half the batches are "nice" multiples of the world size, half arbitrary recipe values.
    gbs = draw(st.one_of(st.sampled_from([16, 64, 128, 256, 512, 1024, 2048, 4096]),
                         st.integers(1, 8).map(lambda k: k * world)))
    return dict(model=draw(shapes), nodes=n, gpus_per_node=gpn, global_batch_size=gbs,
                seq_length=draw(st.sampled_from([2048, 4096, 8192, 32768, 131072])),
                gpu=draw(st.sampled_from(["H100-80GB", "H200-141GB", "A100-40GB", "A100-80GB"])),
                stage=draw(st.sampled_from(["pt", "sft", "dpo", "kto"])), lora=draw(st.booleans()),
                sequence_packing=draw(st.booleans()))


@settings(max_examples=300, deadline=None, database=None)
@given(inputs=plan_inputs())
def test_planner_never_emits_a_layout_that_breaks_a_rule(inputs):
    try:
        p = plan(**inputs)
    except LayoutError as err:
        assert len(err.violations) == 1 and "\n" not in err.violations[0]
        assert err.violations[0].startswith(("no layout fits", f"nodes={inputs['nodes']} gives"))
        return
    world = inputs["nodes"] * inputs["gpus_per_node"]
    assert check_layout(p.layout, world, inputs["model"], gpus_per_node=inputs["gpus_per_node"],
                        global_batch_size=inputs["global_batch_size"],
                        micro_batch_size=p.micro_batch_size, seq_length=inputs["seq_length"],
                        sequence_packing=inputs["sequence_packing"]) == []
    assert p.layout.dp * p.layout.model_parallel_size == world
    assert p.layout.tp <= inputs["gpus_per_node"]
    assert inputs["model"].num_query_groups % p.layout.tp == 0  # never TP above the KV heads
    assert p.memory.total <= (1 - PLAN_HEADROOM) * p.usable_bytes
    assert p.step_time.total > 0 and all(v >= 0 for v in p.step_time.shares().values())
    assert p.num_microbatches * p.micro_batch_size * p.layout.dp == inputs["global_batch_size"]
    assert p.reason and "\n" not in p.reason
    if _short_cp(p):  # CP chunks below the published runs' only where nothing else fits
        assert "because no layout with longer chunks fits the memory" in p.reason


@settings(max_examples=100, deadline=None, database=None)
@given(inputs=plan_inputs())
def test_more_memory_never_gives_a_slower_plan(inputs):
    """Same job on H200 instead of H100 (same compute and links, more memory): the search
    sees a superset of layouts, so its estimated step is never slower beyond the tie band;
    unless the H100 needed CP chunks shorter than MIN_CP_TOKENS, which the bigger GPU need
    not (then the bigger GPU's plan has none)."""
    try:
        small = plan(**{**inputs, "gpu": "H100-80GB"})
    except LayoutError:
        return
    big = plan(**{**inputs, "gpu": "H200-141GB"})
    if _short_cp(small) and not _short_cp(big):
        return
    assert big.step_time.total <= small.step_time.total * (1 + TIE)


def _short_cp(p) -> bool:
    return p.layout.cp > 1 and p.request.seq_length < MIN_CP_TOKENS * p.layout.cp


@settings(max_examples=150, deadline=None, database=None)
@given(inputs=plan_inputs(), data=st.data())
def test_no_forced_layout_that_fits_the_budget_is_faster(inputs, data):
    """Force any split the search could have taken: if it fits the planning budget, the
    search's own choice is at least as fast (within the tie band)."""
    req = PlanRequest(**inputs)
    try:
        layouts = [lay for lay in candidates(req, req.world_size)]
    except LayoutError:
        return
    if not layouts:
        return
    lay = data.draw(st.sampled_from(layouts))
    try:
        forced = plan(req, layout=replace(lay, dp=None))
    except LayoutError:
        return
    if forced.searched is None or forced.memory.total > (1 - PLAN_HEADROOM) * forced.usable_bytes:
        return
    if _short_cp(forced) and not _short_cp(forced.searched):
        return  # the search leaves short CP chunks out while anything else fits
    assert forced.searched.step_time.total <= forced.step_time.total * (1 + TIE)


def _plan_or_none(model: ModelShape, n: int):
    try:
        return plan(model=model, nodes=n, gpus_per_node=8, seq_length=4096,
                    global_batch_size=32 * n)
    except LayoutError:
        return None


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_plans_survive_doubling_the_cluster(name):
    """With whole 8-GPU nodes and 32 sequences per node, a job that plans on n nodes plans on
    2n (its layout with twice the DP still fits), and from 64 nodes up every shape plans.
    Every n of 1..512 (powers of two) is checked: each node count is planned once and serves
    as both the n of one pair and the 2n of the one before (the domain has only 70 pairs, so
    checking them all costs fewer plan() calls than sampling 60 with both ends planned)."""
    model = SHAPES[name]
    counts = [2**k for k in range(11)]  # 1 .. 1024
    plans = {n: _plan_or_none(model, n) is not None for n in counts}
    for n in counts[:-1]:
        if not plans[n]:
            assert n < 64, f"{name}: every test shape, even 405B, should fit on 64 × 8 H100 (n={n})"
            continue
        assert plans[2 * n], f"{name}: plans on {n} nodes but not on {2 * n}"
