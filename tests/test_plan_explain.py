"""hpc-mca plan --explain: the compared layouts with their step time by cost term."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_submit_plan import LLAMA3_8B as LLAMA3_8B_CONFIG
from test_topology_planner import LLAMA3_8B, QWEN3_30B_A3B

from hpc_mca.cli import main
from hpc_mca.topology import Layout, PlanRequest, plan
from hpc_mca.topology.cost import StepTime
from hpc_mca.topology.report import explain_rows, format_explain
from hpc_mca.topology.search import RANKED_LAYOUTS, search, top_layouts

JOBS = [dict(model=LLAMA3_8B, nodes=2, seq_length=16384, global_batch_size=512,
             cp_comm_type="p2p"),
        dict(model=QWEN3_30B_A3B, nodes=2, seq_length=4096, global_batch_size=512)]
TERMS = [f.name for f in fields(StepTime)]


@pytest.mark.parametrize("job", JOBS, ids=["dense", "moe"])
def test_explain_rows_add_up_and_start_with_the_pick(job):
    p = plan(**job)
    rows = explain_rows(p)
    assert len(rows) == RANKED_LAYOUTS and len({r["layout"] for r in rows}) == RANKED_LAYOUTS
    first = rows[0]
    assert (first["layout"], first["micro_batch_size"], first["recompute"]) == \
        (p.describe(), p.micro_batch_size, p.recompute)
    assert first["step_time"] == p.step_time.total
    for row in rows:
        assert list(row["terms"]) == TERMS
        assert sum(row["terms"].values()) == pytest.approx(row["step_time"], rel=1e-12)
    # The same layouts, in the same order, as an exhaustive search ranks them.
    full = top_layouts(search(PlanRequest(**job), exhaustive=True).options)
    assert [(r["layout"], r["step_time"]) for r in rows] == \
        [(o.layout.describe(), o.time.total) for o in full]


def test_forced_layout_comes_first_then_the_search():
    p = plan(**JOBS[0], layout=Layout(tp=4, pp=2, cp=2))
    rows = explain_rows(p)
    assert rows[0]["rank"] == "forced" and rows[0]["layout"] == "TP4 PP2 CP2 DP1"
    assert rows[0]["step_time"] == p.step_time.total
    assert rows[1]["layout"] == p.searched.describe() and len(rows) == 1 + RANKED_LAYOUTS
    text = format_explain(p)
    assert text.splitlines()[2].split()[:2] == ["forced", "TP4"]


def test_cli_explain_table_and_json(tmp_path: Path):
    model = tmp_path / "llama3-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    args = ["plan", "--model", str(model), "--nodes", "2", "--seq-length", "16384",
            "--global-batch-size", "512"]
    table = CliRunner().invoke(main, [*args, "--explain"])
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("explain:"))
    assert "compute" in lines[start + 1] and "total" in lines[start + 1]
    picked = next(line for line in lines if line.strip().startswith("layout "))
    pick = picked.split(None, 1)[1].split("  (")[0]
    assert lines[start + 2].split()[0] == "1" and pick in lines[start + 2]
    out = CliRunner().invoke(main, [*args, "--explain", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["explain"][0]["layout"] == data["plan"]["describe"] == pick
    assert data["explain"][0]["step_time"] == data["plan"]["step_time_s"]["total"]
    plain = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    assert "explain" not in plain
