"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[None]:
    """The local Slurm cluster (bin/local-slurm), started once per session when it is down.
    Jobs the session leaves queued or running are cancelled at its end."""
    import slurm_cluster as slurm

    try:
        slurm.ensure_cluster()
    except slurm.ClusterNeedsRoot as exc:
        pytest.skip(str(exc))
    before = slurm.live_job_ids()
    yield
    slurm.cancel_jobs(slurm.live_job_ids() - before)


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``slurm`` ends with none of its jobs queued or running: whatever it
    submitted (after its module's fixtures were set up) and left behind is cancelled, and the
    cancel is waited for, so no job of one test runs into the next."""
    if request.node.get_closest_marker("slurm") is None:
        yield
        return
    import slurm_cluster as slurm

    before = slurm.live_job_ids()
    yield
    left = slurm.cancel_jobs(slurm.live_job_ids() - before)
    if left:
        print(f"\ncancelled job(s) {', '.join(left)} left behind by {request.node.name}")
