"""The wall clock every replica of a Postgres ledger shares: the database server's, read through an offset.

Design note. A budget's period (the day, the month) and a request's row are placed by the
instant the request started. Each replica reading its own clock puts a request into the period
its host believes in: a replica whose clock runs 5 minutes ahead opens tomorrow's books at
23:55 and admits requests against a fresh limit while the others are still filling today's; one
running behind counts today's spend into yesterday's books. Asking the database for the time on
every request would cost a round trip; instead each replica measures the offset between its own
clock and the server's ``clock_timestamp()`` (at start, then every :data:`SYNC_EVERY_S` seconds)
and reads ``time.time() + offset``. The error is at most half a round trip (sub-millisecond on
a LAN), plus what the host clock drifts or steps between two measurements. A DuckDB ledger has
one process and one host: its clock's offset stays 0.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

__all__ = ["MAX_ROUND_TRIP_S", "SYNC_EVERY_S", "ServerClock"]

log = logging.getLogger("tokenward.clock")

SYNC_EVERY_S = 10.0
"""Seconds between two measurements of the offset to the database server's clock."""

MAX_ROUND_TRIP_S = 0.5
"""A measurement whose round trip took longer is dropped (its error could be half of it)."""


class ServerClock:
    """Epoch seconds (UTC) as the ledger's database server reads them: this host's clock plus an offset.

    Call it for ``time.time()``; :meth:`now` for an aware ``datetime``. :meth:`sync` measures the
    offset (blocking: a worker thread). Until the first measurement the offset is 0.
    """

    def __init__(self) -> None:
        self.offset_s = 0.0
        """Seconds to add to this host's clock to read the server's (positive: this host is behind)."""
        self.synced = False
        """Whether an offset was measured."""

    def __call__(self) -> float:
        """Epoch seconds on the server's clock."""
        return time.time() + self.offset_s

    def now(self) -> dt.datetime:
        """The server's time, as an aware UTC ``datetime``."""
        return dt.datetime.fromtimestamp(self(), dt.UTC)

    def measure(self, before: float, server: float, after: float) -> bool:
        """Take the offset from one reading ``server`` (epoch s) made between local instants ``before`` and ``after``.

        Returns false (offset unchanged) when the round trip took more than :data:`MAX_ROUND_TRIP_S`.
        """
        if after - before > MAX_ROUND_TRIP_S:
            return False
        offset = server - (before + after) / 2
        if abs(offset) > 1.0 and (abs(offset - self.offset_s) > 1.0 or not self.synced):
            log.warning("this host's clock is %+.3f s off the database's: budget periods follow the database", -offset)
        self.offset_s, self.synced = offset, True
        return True

    def sync(self, pool: Any) -> bool:
        """Measure the offset on a connection of ``pool`` (a ``SyncPool``); false if the database is away or slow.

        Never raises: a replica that cannot reach the database keeps its last offset.
        """
        try:
            with pool.connection() as conn:
                before = time.time()
                row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
                after = time.time()
        except Exception as exc:  # the database away: keep the last offset, try again at the next pass
            log.debug("clock offset not measured: %s", exc)
            return False
        return row is not None and self.measure(before, float(row[0]), after)
