"""Shared pytest fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """The local Slurm cluster (bin/local-slurm), started once per session when it is down."""
    import slurm_cluster as slurm

    try:
        slurm.ensure_cluster()
    except slurm.ClusterNeedsRoot as exc:
        pytest.skip(str(exc))
