"""Sequence packing: which samples share a row, and how much of the rows is real tokens.

:func:`best_fit_decreasing` places samples, longest first, into the open row with the least
room that still fits them (a new row when none does); a sample is never split across rows.
Pure Python (no torch), so benchmarks and planners can call :func:`measure_packing`.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import SupportsInt

from .errors import DataError


def pack_alignment(context_parallel_size: int, given: int | None = None) -> int:
    """Slots a packed sample's span is a multiple of: ``given`` (``data.pack_alignment``), else
    2·CP under context parallelism (each span is cut into 2·CP chunks), else 1."""
    cp = context_parallel_size
    return given or (2 * cp if cp > 1 else 1)


def aligned(length: int, align: int) -> int:
    """``length`` rounded up to a multiple of ``align`` (context parallelism needs 2·CP)."""
    return -(-length // align) * align


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of sample indices whose lengths sum to at most ``capacity`` each.

    Deterministic: ties in length keep index order. Open rows are kept per remaining room in
    a sorted list of distinct rooms, so a placement costs O(log capacity) lookups plus a short
    list update, whatever the number of samples.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    rooms: list[int] = []  # distinct remaining rooms of open rows, ascending
    by_room: dict[int, list[int]] = {}
    for index in order:
        need = int(lengths[index])
        if not 1 <= need <= capacity:
            raise DataError(f"sample {index} has {need} tokens; a packed row holds 1.."
                            f"{capacity} (data.seq_length)")
        at = bisect_left(rooms, need)
        if at == len(rooms):
            row, room = len(rows), capacity - need
            rows.append([index])
        else:
            room = rooms[at]
            row = by_room[room].pop()
            if not by_room[room]:
                del by_room[room], rooms[at]
            rows[row].append(index)
            room -= need
        if room > 0:
            if room not in by_room:
                insort(rooms, room)
                by_room[room] = []
            by_room[room].append(row)
    return rows


@dataclass(frozen=True)
class PackingReport:
    """How well samples fill rows of ``seq_length`` slots."""

    num_samples: int
    """Samples packed."""
    num_rows: int
    """Rows they need when packed."""
    real_tokens: int
    """Tokens that are data (alignment padding excluded)."""
    seq_length: int
    """Slots per row."""

    @property
    def efficiency(self) -> float:
        """Packed: real tokens / slots of the packed rows."""
        return self.real_tokens / max(1, self.num_rows * self.seq_length)

    @property
    def padding_efficiency(self) -> float:
        """Padded (one sample per row): real tokens / slots."""
        return self.real_tokens / max(1, self.num_samples * self.seq_length)

    def describe(self) -> str:
        return (f"{self.num_samples} samples, {self.real_tokens} tokens: packed into "
                f"{self.num_rows} rows of {self.seq_length} = {self.efficiency:.4f} real/slots, "
                f"padded {self.padding_efficiency:.4f}")


def pack(lengths: Collection[SupportsInt], seq_length: int, align: int = 1) -> list[list[int]]:
    """Packed rows for samples of ``lengths``, each taking ``aligned(length, align)`` slots."""
    return best_fit_decreasing([aligned(int(n), align) for n in lengths], seq_length)


def measure_packing(lengths: Collection[SupportsInt], seq_length: int, align: int = 1,
                    rows: list[list[int]] | None = None) -> PackingReport:
    """Efficiency of packing ``lengths`` (or of the given ``rows``) into ``seq_length`` rows."""
    rows = pack(lengths, seq_length, align) if rows is None else rows
    return PackingReport(num_samples=len(lengths), num_rows=len(rows),
                         real_tokens=int(sum(int(n) for n in lengths)), seq_length=seq_length)
