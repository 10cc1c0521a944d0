"""Quoting for the two languages a batch script is written in: bash and ``#SBATCH`` lines.

* :func:`shell_quote` -- any string as one bash word (``shlex.quote``: single quotes, with
  ``'"'"'`` for an embedded quote), so ``$(...)``, backticks, ``;`` and spaces stay literal.
* :func:`directive_quote` -- a value on an ``#SBATCH`` line. sbatch parses those lines itself
  (not bash): it honours single and double quotes, treats a backslash as an escape even inside
  quotes and an unquoted ``#`` as the start of a comment. Values that need it are written in
  double quotes with ``\\`` and ``"`` escaped, which that parser reads back exactly.
* :func:`filename_pattern` -- a literal path inside an ``--output`` pattern, where ``%`` is a
  replacement symbol (``%%`` is a literal percent) and a backslash switches replacement off.
"""

from __future__ import annotations

import re
import shlex

from .errors import OpsError

_PLAIN_DIRECTIVE = re.compile(r"[A-Za-z0-9_.,:/@%+=-]+")


def _check_line(what: str, value: str) -> None:
    if any(ch in value for ch in "\n\r\0"):
        raise OpsError(f"{what}={value!r} contains a newline or NUL; valid: a single line")


def shell_quote(value: str) -> str:
    """``value`` as exactly one bash word; NUL (which no shell string can hold) is refused."""
    if "\0" in value:
        raise OpsError(f"{value!r} contains a NUL byte; valid: text without NUL")
    return shlex.quote(value)


def directive_quote(value: str, what: str = "value") -> str:
    """``value`` as sbatch's ``#SBATCH`` parser will read it back (one line only)."""
    _check_line(what, value)
    if _PLAIN_DIRECTIVE.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def filename_pattern(literal: str, what: str = "path") -> str:
    """A literal path for an ``--output`` pattern (``%`` doubled); backslashes are refused
    because Slurm would then stop replacing ``%x``/``%j`` in the whole pattern."""
    _check_line(what, literal)
    if "\\" in literal:
        raise OpsError(f"{what}={literal!r} contains a backslash, which switches off Slurm's "
                       "%x/%j replacement in log paths; valid: a path without backslashes")
    return literal.replace("%", "%%")
