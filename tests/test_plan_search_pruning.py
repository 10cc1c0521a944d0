"""The planner's pruned search against an exhaustive one: the same pick, estimate, reason and
ranked layouts (a floor under the step time that cuts a winner fails here)."""

from __future__ import annotations

import pytest
from test_topology_planner import LLAMA3_8B, QWEN3_30B_A3B

from hpc_mca.topology import ModelShape, PlanRequest
from hpc_mca.topology.search import RANKED_LAYOUTS, search, search_reason, top_layouts

LLAMA3_70B = ModelShape(num_layers=80, hidden_size=8192, num_attention_heads=64,
                        num_query_groups=8, ffn_hidden_size=28672, vocab_size=128256)
LLAMA31_405B = ModelShape(num_layers=126, hidden_size=16384, num_attention_heads=128,
                          num_query_groups=8, ffn_hidden_size=53248, vocab_size=128256)
# A small dense model whose layer count (30) gives uneven pipeline splits.
SMALL = ModelShape(num_layers=30, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                   ffn_hidden_size=8192, vocab_size=32000)

JOBS = [
    dict(model=LLAMA3_8B, nodes=1, seq_length=8192, global_batch_size=128),
    dict(model=LLAMA3_8B, nodes=2, seq_length=16384, global_batch_size=512, cp_comm_type="p2p"),
    dict(model=LLAMA3_8B, nodes=4, seq_length=4096, global_batch_size=256, stage="dpo"),
    dict(model=LLAMA3_8B, nodes=1, seq_length=32768, global_batch_size=16, lora=True),
    dict(model=LLAMA3_70B, nodes=8, seq_length=8192, global_batch_size=128, cp_comm_type="p2p"),
    dict(model=LLAMA3_70B, nodes=4, seq_length=4096, global_batch_size=64, flash_attention=False),
    dict(model=LLAMA31_405B, nodes=64, seq_length=8192, global_batch_size=512),
    dict(model=QWEN3_30B_A3B, nodes=2, seq_length=4096, global_batch_size=512, cp_comm_type="p2p"),
    dict(model=QWEN3_30B_A3B, nodes=4, seq_length=8192, global_batch_size=256, precision="fp8"),
    dict(model=SMALL, nodes=3, seq_length=4096, global_batch_size=96, recompute="full"),
    dict(model=SMALL, nodes=2, seq_length=2048, global_batch_size=64, gpu="A100-40GB"),
]


def _key(option) -> tuple:
    return (option.layout, option.micro_batch_size, option.recompute, option.time.total)


@pytest.mark.parametrize("job", JOBS, ids=lambda j: f"{j['model'].num_layers}L-{j['nodes']}n")
def test_pruned_search_picks_what_the_exhaustive_one_picks(job):
    req = PlanRequest(**job)
    pruned, full = search(req), search(req, exhaustive=True)
    assert _key(pruned.options[0]) == _key(full.options[0])
    assert [_key(o) for o in top_layouts(pruned.options)] == \
        [_key(o) for o in top_layouts(full.options)]
    assert pruned.layouts == full.layouts
    assert search_reason(req, pruned) == search_reason(req, full)


def test_pruning_skips_most_options_of_a_large_search():
    """The comparison above means something only if options are actually skipped."""
    req = PlanRequest(**JOBS[7])
    pruned, full = search(req), search(req, exhaustive=True)
    assert len(top_layouts(full.options)) == RANKED_LAYOUTS
    assert len(pruned.options) < len(full.options) / 2
