"""Slurm time limits, and the lead-time signal that has to fit inside one.

The batch script asks for ``--signal=B:USR1@<lead>``: Slurm sends USR1 ``lead`` seconds before
the time limit (it checks limits every 30 s, so up to ~60 s earlier), and the ranks save and
stop at the next step. A lead as long as the limit makes every allocation stop right after it
started. The rule here:

* a lead given by the user must be at most half the time limit (else one line naming both and
  the largest lead that fits);
* without one, the lead is 120 s, scaled down to a quarter of the limit for limits under
  8 minutes (a 2-minute job gets 30 s, a 1-minute job 15 s);
* without a time limit (none given, or ``UNLIMITED``) the lead is the given one or 120 s.
"""

from __future__ import annotations

import re

from .errors import OpsError

DEFAULT_LEAD_S = 120
"""The lead-time signal's distance from the time limit when the user gives none."""

_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def parse_time_limit(text: str | None) -> int | None:
    """Seconds in a Slurm ``--time`` value; None for no limit (None, '', UNLIMITED)."""
    if text is None or not str(text).strip():
        return None
    value = str(text).strip()
    if value.upper() in ("UNLIMITED", "INFINITE"):
        return None
    match = _TIME.fullmatch(value)
    if match is None:
        raise OpsError(f"--time {value!r} is not a Slurm time limit; valid: {_FORMATS}")
    days, first, second, third = match.groups()
    numbers = [int(n) for n in (first, second, third) if n is not None]
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = (numbers + [0, 0])[:3]
        total = ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    elif len(numbers) == 1:  # MM
        total = numbers[0] * 60
    elif len(numbers) == 2:  # MM:SS
        total = numbers[0] * 60 + numbers[1]
    else:  # HH:MM:SS
        total = (numbers[0] * 60 + numbers[1]) * 60 + numbers[2]
    if total < 1:
        raise OpsError(f"--time {value!r} is no time at all; valid: a positive limit in "
                       f"{_FORMATS}")
    return total


def signal_lead(lead_s: int | None, time_limit: str | None) -> int:
    """The lead (seconds) to submit with, for a lead the user gave (or None) and the job's
    time limit; OpsError (one line) when a given lead does not fit the limit."""
    limit = parse_time_limit(time_limit)
    if lead_s is not None and (isinstance(lead_s, bool) or not isinstance(lead_s, int)
                               or lead_s < 1):
        raise OpsError(f"--signal-lead {lead_s!r} must be a positive number of seconds")
    if limit is None:
        return lead_s if lead_s is not None else DEFAULT_LEAD_S
    fits = max(1, limit // 2)
    if lead_s is None:
        return max(1, min(DEFAULT_LEAD_S, limit // 4))
    if lead_s > fits:
        raise OpsError(f"--signal-lead {lead_s} s does not fit --time {time_limit} ({limit} s): "
                       f"the job would stop to save right after it started; valid: "
                       f"--signal-lead 1..{fits} (at most half the limit), or leave it out "
                       f"(then {max(1, min(DEFAULT_LEAD_S, limit // 4))} s)")
    return lead_s
