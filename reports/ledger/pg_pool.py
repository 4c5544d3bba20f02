"""Connections to a Postgres ledger: a few kept open and lent out, for threads and for the event loop.

psycopg 3 serves both sides of tokenward with one driver: the CLI and the proxy's worker threads
(flushes, state store, budget checks) use :class:`SyncPool`, the proxy's event loop (budget
reservations) :class:`AsyncPool`. Every connection is in autocommit mode with the session time
zone UTC; a connection that failed is closed rather than returned.

A connection whose network path died without a word (a NAT or firewall that forgot it, a
partition: no FIN, no RST) would otherwise leave a statement waiting for its reply forever.
Two things find it. TCP keepalives and ``tcp_user_timeout`` let the kernel give up on a path
that stopped acknowledging (:data:`TCP_OPTIONS`). And every wait for the server is watched
(:class:`WatchedConnection`, :class:`WatchedAsyncConnection`): once nothing has moved on the
socket for :data:`STALL_S` seconds, a second connection asks the server what the session is
doing (``pg_stat_activity``). Working (running the statement, waiting for a lock) is left to
finish; waiting for the client, or gone, means the path is dead: the session is ended
(``pg_terminate_backend``, waited for, so whatever it had not committed never will be) and the
wait raises :class:`ConnectionLost`. The idle connections of the pool are closed with it (they
came the same way), so a retry gets a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
import select
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

from tokenward.reports.ledger.errors import LedgerError

__all__ = [
    "STALL_S",
    "TCP_OPTIONS",
    "AsyncPool",
    "ConnectionLost",
    "SyncPool",
    "WatchedAsyncConnection",
    "WatchedConnection",
    "alive",
    "connect_watched",
    "redact",
]

log = logging.getLogger("tokenward.ledger")

# the server's keepalives too: a session whose client vanished ends, with its locks, within ~20 s
_OPTIONS = (
    "-c TimeZone=UTC -c application_name=tokenward -c tcp_keepalives_idle=10 -c tcp_keepalives_interval=3 "
    "-c tcp_keepalives_count=3 -c tcp_user_timeout=20000"
)

TCP_OPTIONS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 3,
    "keepalives_count": 3,
    "tcp_user_timeout": 20000,
}
"""libpq's TCP settings: an idle connection whose peer stopped answering is dropped within ~20 s."""

STALL_S = 3.0
"""Seconds without a byte moving on a connection the client waits on before the server is asked why."""

_PROBE = (
    "SELECT state, wait_event FROM pg_stat_activity WHERE pid = %s"
)


class ConnectionLost(psycopg.OperationalError):
    """A connection stopped answering without closing (a silent network drop); its server session is ended.

    Whatever the statement in flight had not committed never will; what it had committed stays
    (the reply was lost on the way back).
    """


def _lost(url: str, pid: int) -> bool:
    """Whether session ``pid`` waits for its client (or is gone): then end it and wait until it has (blocking)."""
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=5, options=_OPTIONS, **TCP_OPTIONS) as probe:
            row = probe.execute(_PROBE, [pid]).fetchone()
            if row is not None and row[1] not in ("ClientRead", "ClientWrite"):
                return False  # at work: a long statement or a lock wait, not a dead path
            probe.execute("SELECT pg_terminate_backend(%s)", [pid])
            deadline = time.monotonic() + 5.0
            while probe.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
    except psycopg.Error as exc:  # the server cannot be reached at all: the connection is as good as lost
        log.warning("cannot ask the ledger database about a stalled connection: %s", exc)
    return True


_Wait = Generator[Any, Any, Any]


def _watched(gen: _Wait, stall_s: float, stalled: Callable[[], bool | None]) -> _Wait:
    """``gen`` (a psycopg wait generator), raising :class:`ConnectionLost` once ``stalled()`` says so.

    psycopg sends ``Ready.NONE`` every interval while nothing is ready; ``stalled`` is asked after
    each ``stall_s`` seconds without a ready socket (true: lost; false or ``None``: wait on).
    """
    try:
        state = next(gen)
    except StopIteration as done:  # nothing to wait for
        return done.value
    quiet_since = time.monotonic()
    while True:
        ready = yield state
        now = time.monotonic()
        if ready:
            quiet_since = now
        elif now - quiet_since >= stall_s:
            verdict = stalled()
            if verdict:
                quiet = now - quiet_since
                raise ConnectionLost(f"no reply from the ledger database for {quiet:.0f} s: connection lost")
            if verdict is False:
                quiet_since = now
        try:
            state = gen.send(ready)
        except StopIteration as done:
            return done.value


class WatchedConnection(psycopg.Connection[Any]):
    """A connection whose waits for the server end in :class:`ConnectionLost` when its path is dead."""

    probe_url = ""
    stall_s = STALL_S

    def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        """Psycopg's wait, watched (see the module's note)."""
        if not self.probe_url:
            return super().wait(gen, interval, timeout)
        pid = self.pgconn.backend_pid
        return super().wait(_watched(gen, self.stall_s, lambda: _lost(self.probe_url, pid)), interval, timeout)


def connect_watched(url: str, connect_timeout_s: float = 5.0) -> WatchedConnection:
    """A :class:`WatchedConnection` to ``url`` in autocommit mode, session time zone UTC, with keepalives.

    Raises:
        psycopg.Error: it could not be made.
    """
    conn = WatchedConnection.connect(
        url, autocommit=True, connect_timeout=max(1, int(connect_timeout_s)), options=_OPTIONS, **TCP_OPTIONS
    )
    conn.probe_url = url
    return conn


class WatchedAsyncConnection(psycopg.AsyncConnection[Any]):
    """:class:`WatchedConnection` for the event loop (the server is asked from a worker thread)."""

    probe_url = ""
    stall_s = STALL_S

    async def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        """Psycopg's wait, watched (see the module's note)."""
        if not self.probe_url:
            return await super().wait(gen, interval, timeout)
        pid, url = self.pgconn.backend_pid, self.probe_url
        asked: list[asyncio.Future[bool]] = []

        def stalled() -> bool | None:
            if not asked:
                asked.append(asyncio.ensure_future(asyncio.to_thread(_lost, url, pid)))
                return None
            if not asked[0].done():
                return None
            verdict = asked.pop().result()
            return verdict

        try:
            return await super().wait(_watched(gen, self.stall_s, stalled), interval, timeout)
        finally:
            for pending in asked:
                pending.cancel()


def redact(url: str) -> str:
    """``url`` without its password (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


class SyncPool:
    """Up to ``size`` idle connections to ``url``, lent one at a time to a thread.

    Args:
        url: a libpq connection URL (``postgresql://user:password@host:port/database``).
        size: idle connections kept.
        connect_timeout_s: seconds before a connection attempt fails.
    """

    def __init__(self, url: str, size: int = 4, connect_timeout_s: float = 5.0) -> None:
        self.url = url
        self._size = size
        self._timeout = connect_timeout_s
        self._idle: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._idle)  # idle connections close with the pool (or at exit)

    def _open(self) -> psycopg.Connection[Any]:
        try:
            return connect_watched(self.url, self._timeout)
        except psycopg.Error as exc:
            raise LedgerError(f"cannot connect to the ledger {redact(self.url)}: {exc}") from exc

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """Lend a connection (opened if none is idle); a failed one is closed, not kept.

        Raises:
            LedgerError: no connection could be made.
        """
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is not None and not alive(conn):  # the server restarted since: a new one, not an error
            conn.close()
            conn = None
        if conn is None:
            conn = self._open()
        ok = False
        try:
            yield conn
            ok = not conn.closed and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        except ConnectionLost:
            self.close()  # the idle ones came the same way: the next caller opens a fresh one
            raise
        finally:
            if ok:
                with self._lock:
                    if len(self._idle) < self._size:
                        self._idle.append(conn)
                        conn = None
            if conn is not None:
                conn.close()

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            _close_all(self._idle)


def alive(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether an idle connection is still usable, without a round trip (checked before it is lent).

    Reads what the server sent meanwhile (libpq's ``PQconsumeInput``, which never blocks) for as
    long as the socket is readable: a server that restarted or dropped the connection has sent
    its goodbye and closed the socket, so a read fails and the connection is known dead before a
    statement fails on it. Without
    this each pooled connection failed once after a Postgres restart (a reservation's 503, a
    budget check's error).
    """
    if conn.closed:
        return False
    pgconn = conn.pgconn
    try:
        for _ in range(4):  # the server's goodbye (a FATAL message), then the end of the stream
            pgconn.consume_input()
            if not select.select([pgconn.socket], [], [], 0)[0]:
                break
    except (psycopg.OperationalError, OSError, ValueError):
        return False
    return pgconn.status == psycopg.pq.ConnStatus.OK


def _close_all(connections: list[psycopg.Connection[Any]]) -> None:
    for conn in connections:
        conn.close()
    connections.clear()


class AsyncPool:
    """Up to ``size`` connections to ``url`` for the event loop; callers beyond that wait their turn.

    Args:
        url: a libpq connection URL.
        size: connections open at most.
        connect_timeout_s: seconds before a connection attempt fails.
    """

    def __init__(self, url: str, size: int = 4, connect_timeout_s: float = 5.0) -> None:
        self.url = url
        self._timeout = connect_timeout_s
        self._free: list[psycopg.AsyncConnection[Any]] = []
        self._slots = asyncio.Semaphore(size)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """Lend a connection; a failed one is closed, not kept.

        Raises:
            LedgerError: no connection could be made.
        """
        async with self._slots:
            conn = self._free.pop() if self._free else None
            if conn is not None and not alive(conn):  # the server restarted since: a new one, not an error
                await conn.close()
                conn = None
            if conn is None:
                try:
                    conn = await WatchedAsyncConnection.connect(
                        self.url,
                        autocommit=True,
                        connect_timeout=max(1, int(self._timeout)),
                        options=_OPTIONS,
                        **TCP_OPTIONS,
                    )
                except psycopg.Error as exc:
                    raise LedgerError(f"cannot connect to the ledger {redact(self.url)}: {exc}") from exc
                conn.probe_url = self.url
            ok = False
            try:
                yield conn
                ok = not conn.closed and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            except ConnectionLost:
                await self.close()  # the idle ones came the same way: the next caller opens a fresh one
                raise
            finally:
                if ok:
                    self._free.append(conn)
                else:
                    await conn.close()

    async def close(self) -> None:
        """Close every connection not lent out."""
        free, self._free = self._free, []
        for conn in free:
            await conn.close()
