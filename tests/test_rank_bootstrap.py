"""Rank bootstrap with real processes: torchrun (gloo) ranks against a single-process reference,
and the fork launcher (hpc_mca/runtime/forkrun.py) that the trainer tests start their ranks with.

The Slurm variant of the same comparison lives in tests/test_slurm_ranks.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_fixtures import FORKRUN, launch_ranks

HPC_MCA = [sys.executable, "-W", "ignore", "-m", "hpc_mca"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for var in [k for k in env if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))]:
        env.pop(var)
    env["HPC_MCA_DIST_TIMEOUT"] = "120"
    return env


def run_smoke(tmp_path: Path, name: str, nproc: int, *args: str, fork: bool = False) -> dict:
    out = tmp_path / f"{name}.json"
    launcher = TORCHRUN + [f"--nproc-per-node={nproc}", "-m", "hpc_mca"] if nproc > 1 else HPC_MCA
    if fork:
        launcher = FORKRUN + [f"--nproc-per-node={nproc}"]
    launcher = [*launcher, "smoke", "--steps", "2"]
    proc = subprocess.run([*launcher, *args, "--out", str(out)], env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_smoke(tmp_path_factory.mktemp("ref"), "ref", 1)


def assert_same_numbers(result: dict, reference: dict, tol: float = 1e-6) -> None:
    assert len(result["steps"]) == len(reference["steps"]) == 2
    for got, want in zip(result["steps"], reference["steps"]):
        assert got["loss"] == pytest.approx(want["loss"], abs=tol), (got, want)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], abs=tol), (got, want)


def test_reference_trains(reference):
    assert reference["world_size"] == 1 and reference["backend"] == "gloo"
    first, second = reference["steps"]
    assert 4.0 < first["loss"] < 6.0  # ~ln(128): an untrained model on a 128-token vocabulary
    assert second["loss"] < first["loss"]  # the optimizer step happened and helped


def test_a_single_process_binds_no_rendezvous_port(tmp_path, reference):
    """A single local run meets nobody: its process group needs no TCP port, so a port taken
    by someone else (here its own MASTER_PORT, held open) cannot fail it with EADDRINUSE."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        out = tmp_path / "held.json"
        env = {**_env(), "MASTER_PORT": str(held.getsockname()[1])}
        proc = subprocess.run([*HPC_MCA, "smoke", "--steps", "2", "--out", str(out)], env=env,
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_numbers(json.loads(out.read_text()), reference, tol=0)


@pytest.mark.slow
def test_forked_ranks_tp2_dp2_match_single_process(tmp_path, reference):
    result = run_smoke(tmp_path, "fork_tp2dp2", 4, "--tp", "2", fork=True)
    assert result["world_size"] == 4 and result["launcher"] == "torchrun"  # torchrun's variables
    assert result["layout"] == {"tp": 2, "pp": 1, "vp": None, "ep": 1, "dp": 2}
    assert_same_numbers(result, reference)


@pytest.mark.slow
def test_forked_ranks_exit_with_a_ranks_own_status(tmp_path):
    """A bad input stops every rank with 2, and the launcher passes that status on (torchrun
    says 1 for any failed rank); the one-line error is printed once."""
    demo = Path(__file__).parents[1] / "hpc_mca" / "assets" / "demo" / "sft_addition.yaml"
    proc = subprocess.run([*FORKRUN, "--nproc-per-node=2", "train", str(demo),
                           f"training.output_dir={tmp_path / 'run'}", "training.max_steps=-3"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpc-mca train: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "max_steps" in errors[0], proc.stderr[-3000:]


@pytest.mark.slow
def test_torchrun_tp2_dp2_matches_single_process(tmp_path, reference):
    result = run_smoke(tmp_path, "tp2dp2", 4, "--tp", "2")
    assert result["launcher"] == "torchrun"
    assert result["layout"] == {"tp": 2, "pp": 1, "vp": None, "ep": 1, "dp": 2}
    assert_same_numbers(result, reference)


@pytest.mark.slow
def test_distributed_optimizer_dp2_matches_single_process(tmp_path, reference):
    result = run_smoke(tmp_path, "distopt", 2, "--distributed-optimizer")
    assert_same_numbers(result, reference)


@pytest.mark.slow
def test_moe_expert_parallel_trains(tmp_path):
    # Expert weights are drawn from per-EP-rank RNG streams, so EP=2 is not bit-comparable
    # with EP=1; what must hold is that tokens cross the all-to-all both ways and training works.
    result = run_smoke(tmp_path, "ep2", 2, "--experts", "4", "--ep", "2")
    assert result["layout"]["ep"] == 2
    first, second = result["steps"]
    assert second["loss"] < first["loss"] and first["grad_norm"] > 0


@pytest.mark.slow
def test_torchrun_pp2_vp2_runs_the_interleaved_schedule(tmp_path):
    # Pipeline init differs from PP=1 (each stage draws only its layers' weights), so this run
    # is compared with itself under plain PP=2 and DP, not with the single process.
    result = run_smoke(tmp_path, "pp2vp2", 2, "--pp", "2", "--vp", "2", "--layers", "4")
    assert result["layout"]["pp"] == 2 and result["layout"]["vp"] == 2
    first, second = result["steps"]
    assert second["loss"] < first["loss"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, nproc, expected",
    [
        (["--tp", "3"], 4, "tensor_parallel_size=3"),
        (["--tp", "2", "--heads", "3", "--hidden", "48"], 2, "num_attention_heads=3"),
    ],
)
def test_bad_layout_fails_fast_on_every_rank(tmp_path, args, nproc, expected):
    # Started directly, not under torchrun (whose agent stops the other workers as soon as
    # one fails): every rank must report the layout error itself, exit 2, and never reach
    # the rendezvous.
    for rank in launch_ranks(nproc, ["smoke", *args], timeout=120):
        errors = [line for line in rank.stderr.splitlines() if line.startswith("hpc-mca smoke: error:")]
        assert rank.returncode == 2 and len(errors) == 1, rank.stderr[-3000:]
        assert expected in errors[0], errors
        assert "init_process_group" not in rank.stderr  # nobody reached the rendezvous
