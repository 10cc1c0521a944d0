"""Hang campaign on the local Slurm cluster: a frozen rank (SIGSTOP), a rank blocked in a
collective and a slow rank, injected into --runs jobs each on 2 and 4 nodes, and a table of
how the runs came out: equal to the uninterrupted run, the faulted node excluded from the
restart, and the seconds from the fault to the requeue and to the first resumed step (see
tests/hang_campaign.py). A 4-node job that excludes a node needs a fifth: start the cluster
with LOCAL_SLURM_NODES=6 (sudo bin/local-slurm start). About 75 s per job.

    .venv/bin/python benchmarks/hang_campaign.py [--runs 5] [--kinds freeze] [--nodes 2,4]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fault_campaign  # noqa: E402
import hang_campaign as campaign  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="jobs per fault kind and node count")
    parser.add_argument("--kinds", default=",".join(campaign.KINDS))
    parser.add_argument("--nodes", default="2,4")
    parser.add_argument("--seed", type=int, default=None, help="fault steps/ranks (random)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="hang-campaign-"))
    trials = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        config, reference = fault_campaign.prepare(root / f"setup{nodes}", ranks=nodes)
        for kind in args.kinds.split(","):
            for i in range(args.runs):
                t = campaign.trial(kind, config, reference, root / f"{kind}{nodes}-{i}", rng, nodes)
                trials.append(t)
                print(f"{kind:6s} {nodes} nodes job {t.job_id:>5s}: rank {t.rank} ({t.node or '-'}) "
                      f"at step {t.fault_step}; {t.state}, equal={t.equal}, excluded={t.excluded}, "
                      f"restart on {t.restart_nodes}, requeue {t.requeue_s} s and resumed step "
                      f"{t.resume_s} s after the fault, {t.restarts} restart(s)", flush=True)
    print()
    print(campaign.table(trials))
    hung = [t for t in trials if t.kind != "slow"]
    ok = (all(t.equal for t in trials)
          and all(t.node in t.excluded and t.node not in t.restart_nodes for t in hung)
          and all(t.requeue_s is not None and t.requeue_s <= campaign.HANG_TIMEOUT_S + 60 for t in hung)
          and all(t.restarts == 0 for t in trials if t.kind == "slow"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
