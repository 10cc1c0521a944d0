"""Shared pytest fixtures."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The user's job index (hpc_mca/slurm/index.py) of this test session, not of the machine's
# user: every hpc-mca command and job the tests start inherit it (tests that clean HPC_MCA_*
# out of the environment keep XDG_* variables).
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="hpc-mca-test-state-")
os.environ.pop("HPC_MCA_STATE_DIR", None)


def _test_dirs(factory: pytest.TempPathFactory) -> tuple[Path, ...]:
    """Where this session's jobs work: pytest's temporary directories and the checkout (jobs
    of anyone else on the cluster are never touched)."""
    return (factory.getbasetemp(), REPO)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The local Slurm cluster (bin/local-slurm), started once per session when it is down.
    Jobs of this session left queued or running are cancelled at its end."""
    import slurm_cluster as slurm

    try:
        slurm.ensure_cluster()
    except slurm.ClusterNeedsRoot as exc:
        pytest.skip(str(exc))
    dirs = _test_dirs(tmp_path_factory)
    before = slurm.live_job_ids(dirs)
    yield
    slurm.cancel_jobs(slurm.live_job_ids(dirs) - before)


@pytest.fixture(autouse=True)
def _environment_left_as_found() -> Iterator[None]:
    """Each test leaves ``os.environ`` as it found it. Library code a test runs in this process
    may write there: Megatron-Core's LanguageModule sets NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and
    NVTE_UNFUSED_ATTN whenever it builds a model. Left behind, they reach every later launch's
    environment, which then differs from the warm launcher's server (tests/warm_launcher.py),
    so each launch was started fresh: 397 of 481 in a full main lane, paying ~7 s of imports
    a rank each time, which made that lane ~1.7 times as long."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request: pytest.FixtureRequest,
                              tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A test marked ``slurm`` ends with none of its jobs queued or running: whatever it
    submitted (after its module's fixtures were set up) and left behind is cancelled, and the
    cancel is waited for, so no job of one test runs into the next."""
    if request.node.get_closest_marker("slurm") is None:
        yield
        return
    import slurm_cluster as slurm

    dirs = _test_dirs(tmp_path_factory)
    before = slurm.live_job_ids(dirs)
    yield
    left = slurm.cancel_jobs(slurm.live_job_ids(dirs) - before)
    if left:
        print(f"\ncancelled job(s) {', '.join(left)} left behind by {request.node.name}")


def _selects_gpu_tests(config: pytest.Config) -> bool:
    expression = (config.getoption("markexpr") or "").replace(" ", "")
    return "gpu" in expression and "notgpu" not in expression


def pytest_configure(config: pytest.Config) -> None:
    """Unless the run asks for GPU tests (``-m gpu``), CUDA is hidden from this session and
    everything it starts: the CPU suite then runs the same on a GPU machine (its multi-rank
    tests start gloo ranks on one host, and two NCCL ranks cannot share one GPU). The warm
    launcher's server will start with the rank environment as it is now, before any test
    sets a variable of its own."""
    if not _selects_gpu_tests(config):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if "OMP_NUM_THREADS" not in os.environ:
        # One intra-op thread for the tests' own tensors too, as for the ranks they start
        # (trainer_fixtures.rank_env); os.environ is left alone: Slurm jobs take theirs from
        # their allocation.
        import torch

        torch.set_num_threads(1)
    import trainer_fixtures
    import warm_launcher

    warm_launcher.base_env = trainer_fixtures.rank_env()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``time_limits`` run last (in their files' order): their jobs must get
    through start-up inside one-minute allocations, and by then bin/test's other lane has
    usually stopped loading the CPUs. Tests marked ``gpu`` are skipped, with the reason shown,
    where CUDA is not usable."""
    items.sort(key=lambda item: item.get_closest_marker("time_limits") is not None)
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    reason = ("gpu: needs CUDA (none on this machine)" if _selects_gpu_tests(config)
              else "gpu: run `pytest -m gpu` on a GPU machine")
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_tests:
        item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many trainer launches the warm launcher served (tests/warm_launcher.py), and why
    any were started fresh."""
    import sys

    warm = sys.modules.get("warm_launcher")
    if warm is None or not (warm.forked or warm.fresh):
        return
    line = f"warm launcher: {warm.forked} launches forked from the preloaded server"
    if warm.fresh:
        line += "; started fresh (environment differs in " + "; ".join(
            f"{keys}: {count}" for keys, count in sorted(warm.fresh.items())) + ")"
    terminalreporter.write_line(line)
