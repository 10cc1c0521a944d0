"""hpc_mca ranks under a real Slurm job step (2 simulated nodes x 2 tasks), against one process."""

import json
import sys
from pathlib import Path

import pytest
from test_rank_bootstrap import assert_same_numbers, run_smoke

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _job_script(tmp_path: Path, smoke_args: str) -> Path:
    script = tmp_path / "smoke.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=2\n"
        "#SBATCH --ntasks-per-node=2\n"
        "#SBATCH --job-name=hpc-mca-smoke\n"
        f"#SBATCH --output={tmp_path}/%x_%j.out\n"
        "#SBATCH --time=10\n"
        "set -euo pipefail\n"
        "export HPC_MCA_DIST_TIMEOUT=120\n"
        f"srun --unbuffered {sys.executable} -W ignore -m hpc_mca smoke {smoke_args}\n"
    )
    return script


def _log(tmp_path: Path, job_id: str) -> str:
    return (tmp_path / f"hpc-mca-smoke_{job_id}.out").read_text()


def test_tp2_dp2_on_two_nodes_matches_single_process(slurm_cluster, tmp_path):
    import slurm_cluster as slurm

    out = tmp_path / "result.json"
    job_id = slurm.sbatch(_job_script(tmp_path, f"--tp 2 --steps 2 --out {out}"))
    state = slurm.wait_for_job(job_id, timeout=300)
    assert state == "COMPLETED", _log(tmp_path, job_id)[-3000:]
    result = json.loads(out.read_text())
    assert (result["launcher"], result["world_size"], result["backend"]) == ("slurm", 4, "gloo")
    assert result["layout"]["tp"] == 2 and result["layout"]["dp"] == 2
    reference = run_smoke(tmp_path, "reference", 1)
    assert_same_numbers(result, reference)


def test_bad_layout_fails_on_every_rank_without_hanging(slurm_cluster, tmp_path):
    import slurm_cluster as slurm

    job_id = slurm.sbatch(_job_script(tmp_path, "--tp 3"))
    state = slurm.wait_for_job(job_id, timeout=120)
    assert state == "FAILED"
    log = _log(tmp_path, job_id)
    errors = [line for line in log.splitlines() if line.startswith("hpc-mca smoke: error:")]
    assert len(errors) == 4, log[-3000:]
    assert all("tensor_parallel_size=3" in line for line in errors)
