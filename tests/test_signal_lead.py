"""The lead-time signal against the time limit (pure: no Slurm, no torch)."""

from __future__ import annotations

import pytest

from hpc_mca.slurm.errors import OpsError
from hpc_mca.slurm.timelimit import parse_time_limit, signal_lead


@pytest.mark.parametrize("text, seconds", [
    ("1", 60), ("90", 5400), ("2:30", 150), ("01:00:00", 3600), ("1-0", 86400),
    ("1-02", 93600), ("1-02:03", 93780), ("1-02:03:04", 93784), (" 5 ", 300),
    (None, None), ("", None), ("UNLIMITED", None), ("infinite", None),
])
def test_slurm_time_formats(text, seconds):
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", ["abc", "1:2:3:4", "-5", "1h", "0", "00:00"])
def test_bad_time_limits_are_one_line(text):
    with pytest.raises(OpsError, match=r"--time .* valid: .*MM") as err:
        parse_time_limit(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("given, limit, lead", [
    (None, "1", 15), (None, "2", 30), (None, "7", 105), (None, "8", 120), (None, "2-00:00:00", 120),
    (None, None, 120), (None, "UNLIMITED", 120), (15, "1", 15), (300, "02:00:00", 300),
    (500, None, 500),
])
def test_lead_default_scales_and_a_given_one_is_kept(given, limit, lead):
    assert signal_lead(given, limit) == lead


def test_a_lead_over_half_the_limit_is_refused_naming_what_fits():
    with pytest.raises(OpsError) as err:
        signal_lead(120, "2")
    assert str(err.value) == (
        "--signal-lead 120 s does not fit --time 2 (120 s): the job would stop to save right "
        "after it started; valid: --signal-lead 1..60 (at most half the limit), or leave it "
        "out (then 30 s)")
    for bad in (0, -3, True, 1.5):
        with pytest.raises(OpsError, match="must be a positive number of seconds"):
            signal_lead(bad, "10")
