"""Slurm time limits, and the lead-time signal that has to fit inside one.

The batch script asks for ``--signal=B:USR1@<lead>``: Slurm sends USR1 ``lead`` seconds before
the time limit (it checks limits every 30 s, so up to ~60 s earlier), and the ranks save and
stop at the next step. A lead as long as the limit makes every allocation stop right after it
started. The rule here:

* a lead given by the user must be at most half the time limit, and the lead plus Slurm's
  30 s check interval must leave at least a quarter of the limit to train (the second rule
  only binds under 2 minutes: ``--time 1 --signal-lead 30`` would get its signal at the start
  of every allocation and requeue once per step); else one line naming both and the largest
  lead that fits;
* without one, the lead is 120 s, scaled down to a quarter of the limit for limits under
  8 minutes (a 2-minute job gets 30 s, a 1-minute job 15 s);
* without a time limit (none given, or ``UNLIMITED``) the lead is the given one or 120 s.

:func:`startup_warning` says when a lead that fits still leaves less time before its signal
than the run's last allocation took to reach its first step (``startup_s`` in progress.json):
such a job may requeue without training a step.
"""

from __future__ import annotations

import math
import os
import re

from .errors import OpsError
from .progress import read_progress

DEFAULT_LEAD_S = 120
"""The lead-time signal's distance from the time limit when the user gives none."""
CHECK_INTERVAL_S = 30
"""How often Slurm checks time limits: the lead-time signal may come this much earlier."""

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
    default = max(1, min(DEFAULT_LEAD_S, limit // 4))
    if lead_s is None:
        return default
    half, window = limit // 2, limit - CHECK_INTERVAL_S - limit // 4
    fits = min(half, window)
    if lead_s > fits:
        rule = ("at most half the limit" if half <= window else
                f"the lead plus Slurm's {CHECK_INTERVAL_S} s check interval must leave a quarter "
                "of the limit to train")
        valid = f"--signal-lead 1..{fits} ({rule})" if fits >= 1 else f"a --time over {_min_limit()} s"
        raise OpsError(f"--signal-lead {lead_s} s does not fit --time {time_limit} ({limit} s): "
                       f"the job would stop to save right after it started; valid: {valid}, "
                       f"or leave it out (then {default} s)")
    return lead_s


def _min_limit() -> int:
    """The shortest limit that any lead fits (1 s of lead, 30 s of check, a quarter to train)."""
    limit = 2
    while min(limit // 2, limit - CHECK_INTERVAL_S - limit // 4) < 1:
        limit += 1
    return limit - 1


def training_window(lead_s: int, time_limit: str | None) -> int | None:
    """Seconds an allocation surely trains before its lead-time signal: the limit less the
    lead and Slurm's check interval (None without a limit)."""
    limit = parse_time_limit(time_limit)
    return None if limit is None else max(0, limit - lead_s - CHECK_INTERVAL_S)


def startup_warning(lead_s: int, time_limit: str | None, startup_s: float | None) -> str | None:
    """One line when ``lead_s`` leaves an allocation less time before its signal than the
    last one took to start (``startup_s``: from the rank's start to its first step's end);
    None when it fits or nothing is known."""
    window = training_window(lead_s, time_limit)
    if window is None or startup_s is None or window >= startup_s:
        return None
    most = window - math.ceil(startup_s) + lead_s
    valid = f"--signal-lead 1..{most} or a longer --time" if most >= 1 else "a longer --time"
    return (f"warning: --signal-lead {lead_s} s with --time {time_limit} leaves {window} s before "
            f"the lead-time signal (Slurm checks every {CHECK_INTERVAL_S} s), less than the "
            f"{startup_s:.0f} s the run's last start took to its first step: the job may requeue "
            f"without training a step; valid: {valid}")


_DIRECTIVES = re.compile(r"^#SBATCH --(time|signal)=(?:B:USR1@)?(\S+)$", re.M)


def continuation_warning(run_dir: str | os.PathLike[str], script: str) -> str | None:
    """:func:`startup_warning` for a batch ``script`` about to continue the run in ``run_dir``
    (its ``--time`` and lead-time ``--signal`` lines against the run's last start-up)."""
    found = dict(_DIRECTIVES.findall(script))
    progress = read_progress(run_dir)
    if "signal" not in found or not found["signal"].isdigit() or progress is None:
        return None
    return startup_warning(int(found["signal"]), found.get("time"), progress.startup_s)
