"""Fault campaign on the local Slurm cluster: each fault injected into --runs 2-node training
jobs, and a table of how the runs came out (see tests/fault_campaign.py for the faults and the
figures). Needs the cluster (sudo bin/local-slurm start); takes about a minute per job.

    .venv/bin/python benchmarks/fault_campaign.py [--runs 10] [--kinds requeue,usr1,kill,kill_in_save]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fault_campaign as campaign  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="jobs per fault kind")
    parser.add_argument("--kinds", default=",".join(campaign.KINDS))
    parser.add_argument("--seed", type=int, default=None, help="fault steps/ranks (random)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="fault-campaign-"))
    config, reference = campaign.prepare(root)
    trials = []
    for kind in args.kinds.split(","):
        for i in range(args.runs):
            result = campaign.trial(kind, config, reference, root / f"{kind}{i}", rng)
            trials.append(result)
            print(f"{kind:13s} job {result.job_id:>5s}: {result.detail} at step "
                  f"{result.fault_step}; {result.state}, equal={result.equal}, resumed step "
                  f"{result.resume_s} s after the fault, orphans gone {result.orphans_s} s "
                  f"after the end, {result.restarts} restart(s)", flush=True)
    print()
    print(campaign.table(trials))
    sys.exit(0 if all(t.equal and t.orphans_s <= 5 for t in trials) else 1)


if __name__ == "__main__":
    main()
