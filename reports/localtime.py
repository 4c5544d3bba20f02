"""Local wall-clock time of ``started_at`` as SQL, without a time zone lookup per row.

DuckDB's ``timezone()`` asks ICU for every row (about 1 s per 10 million rows on one core). A
zone's UTC offset changes only at its transitions (DST, law changes), so for a range of rows the
offset is a step function: this module finds the transitions inside the range with ``zoneinfo``
and writes them as one ``CASE`` on the epoch microseconds, which DuckDB evaluates about ten
times faster. The result equals ``timezone(tz, started_at)``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from zoneinfo import ZoneInfo

__all__ = ["local_hour_start_sql", "local_timestamp_sql", "offsets"]

_US = 1_000_000


def offsets(tz: str, lo: dt.datetime, hi: dt.datetime) -> list[tuple[int | None, int]]:
    """The UTC offsets (seconds) of ``tz`` over ``[lo, hi]``: ``(from epoch second, offset)`` steps.

    The first step has ``None`` as its start (it also covers anything before ``lo``).

    Raises:
        zoneinfo.ZoneInfoNotFoundError: unknown zone.
    """
    zone = ZoneInfo(tz)

    def offset(at: dt.datetime) -> int:
        delta = at.astimezone(zone).utcoffset()
        return int(delta.total_seconds()) if delta is not None else 0

    steps: list[tuple[int | None, int]] = [(None, offset(lo))]
    day = dt.timedelta(days=1)
    at = lo
    while at < hi:
        nxt = min(at + day, hi)
        if offset(nxt) != steps[-1][1]:
            low, high = int(at.timestamp()), int(nxt.timestamp())  # offset(low) old, offset(high) new
            while high - low > 1:
                middle = (low + high) // 2
                if offset(dt.datetime.fromtimestamp(middle, dt.UTC)) == steps[-1][1]:
                    low = middle
                else:
                    high = middle
            steps.append((high, offset(nxt)))
        at = nxt
    return steps


def _by_offset(steps: list[tuple[int | None, int]], value: Callable[[int], str]) -> str:
    """A SQL expression worth ``value(offset)`` for the offset in force at each row's start."""
    if len(steps) == 1:
        return value(steps[0][1])
    cases = " ".join(
        f"WHEN epoch_us(started_at) < {start * _US} THEN {value(previous[1])}"
        for previous, (start, _) in zip(steps, steps[1:], strict=False)
        if start is not None
    )
    return f"CASE {cases} ELSE {value(steps[-1][1])} END"


def local_timestamp_sql(tz: str, lo: dt.datetime | None, hi: dt.datetime | None) -> str:
    """SQL for ``started_at`` as a local ``TIMESTAMP`` in ``tz``, exact for rows in ``[lo, hi]``."""
    now = dt.datetime.now(dt.UTC)
    steps = offsets(tz, lo or now, hi or now)
    return f"make_timestamp(epoch_us(started_at) + {_by_offset(steps, lambda off: str(off * _US))})"


def local_hour_start_sql(tz: str, lo: dt.datetime | None, hi: dt.datetime | None) -> str:
    """SQL for the epoch microseconds at which a row's local hour began.

    Grouping by it keeps apart the two 2 a.m. hours of the night summer time ends, and sorts in
    time; reports show it as local time with its offset.
    """
    now = dt.datetime.now(dt.UTC)
    steps = offsets(tz, lo or now, hi or now)
    offset = _by_offset(steps, lambda off: str(off * _US))
    return f"(epoch_us(started_at) - ((epoch_us(started_at) + {offset}) % {3600 * _US}))"
