"""Connections to a Postgres ledger: a few kept open and lent out, for threads and for the event loop.

psycopg 3 serves both sides of tokenward with one driver: the CLI and the proxy's worker threads
(flushes, state store, budget checks) use :class:`SyncPool`, the proxy's event loop (budget
reservations) :class:`AsyncPool`. Every connection is in autocommit mode with the session time
zone UTC; a connection that failed is closed rather than returned.
"""

from __future__ import annotations

import asyncio
import select
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

from tokenward.reports.ledger.errors import LedgerError

__all__ = ["AsyncPool", "SyncPool", "alive", "redact"]

_OPTIONS = "-c TimeZone=UTC -c application_name=tokenward"


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
            return psycopg.connect(
                self.url, autocommit=True, connect_timeout=max(1, int(self._timeout)), options=_OPTIONS
            )
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
                    conn = await psycopg.AsyncConnection.connect(
                        self.url, autocommit=True, connect_timeout=max(1, int(self._timeout)), options=_OPTIONS
                    )
                except psycopg.Error as exc:
                    raise LedgerError(f"cannot connect to the ledger {redact(self.url)}: {exc}") from exc
            ok = False
            try:
                yield conn
                ok = not conn.closed and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
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
