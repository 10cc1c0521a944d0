"""Each CPU-compat patch is necessary: the Megatron call it answers fails without it."""

import json
from pathlib import Path

import pytest
from trainer_fixtures import run_ranks

from hpc_mca.runtime import cpu_compat

PROBE = Path(__file__).with_name("compat_probe.py")

# patch -> the probes that must fail when only that patch is left out
NEEDED_BY = {
    "devices": {"probe_causal_mask", "probe_ddp_overlap", "probe_backward_allocates", "probe_cp_rope",
                "probe_yarn_rope"},
    "rng": {"probe_tracker_fork", "probe_checkpoint_without_output"},  # it saves RNG states
    "streams": {"probe_ddp_overlap"},
    "alltoall": {"probe_alltoall"},
    "checkpoint_te": {"probe_checkpoint_without_output"},
    "yarn_init": {"probe_yarn_rope"},
}


def run_probe(*skip: str) -> dict[str, str]:
    """The probes in a process of their own (patches cannot be uninstalled), forked from the
    warm launcher as a rank is: Megatron-Core is imported before the patches go in, as in
    every training (the patches are installed at run time, tests/warm_launcher.py)."""
    proc = run_ranks(1, [str(PROBE), *skip], timeout=180)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return json.loads(lines[-1])


def test_patch_table_matches_tests():
    assert {p.name for p in cpu_compat.PATCHES} == set(NEEDED_BY)


@pytest.mark.skipif(not cpu_compat.needed(), reason="CUDA present: the compat layer stays inactive")
def test_all_probes_pass_with_every_patch():
    results = run_probe()
    assert results.pop("installed") == [p.name for p in cpu_compat.PATCHES]
    assert set(results.values()) == {"OK"}, results


@pytest.mark.skipif(not cpu_compat.needed(), reason="CUDA present: the compat layer stays inactive")
@pytest.mark.parametrize("patch", sorted(NEEDED_BY))
def test_each_patch_is_necessary(patch):
    results = run_probe(patch)
    assert patch not in results.pop("installed")
    failing = {name for name, outcome in results.items() if outcome != "OK"}
    assert failing == NEEDED_BY[patch], results


def test_unknown_patch_name_is_rejected():
    with pytest.raises(ValueError, match="unknown cpu_compat patch"):
        cpu_compat.activate(skip=["no-such-patch"])
