"""Shared budget books after a Postgres outage: each request's spend counted once (real Postgres).

While Postgres is down no replica renews its lease; when it is back, the first replica to renew
ends the leases that ran out meanwhile (``tw_expire``), and each named hold of those replicas
becomes its request's spend at its worst case (the replica may have died: the provider bills
it all the same). A replica that did not die then sends the settlements it queued during the
outage (``tw_settle``): the request's real cost. A settlement may also be sent twice: one that
committed just as the database went away reached no one, and is sent again when it is back.

Figures: a $1 budget; a request holds its worst case $0.30 and costs $0.12.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from decimal import Decimal as D

import psycopg

from tokenward.pricing.budgets import Budget, Period
from tokenward.reports.ledger.books import Ask
from tokenward.reports.ledger.pg_books import PgBooks, reconcile

from .test_ledger import make_row
from .test_pg_ledger import pg, rows_of

START = dt.datetime(2026, 11, 2, tzinfo=dt.UTC)
BOOK = ("hard", START)
WORST, REAL = D("0.30"), D("0.12")


def _books(url: str) -> list[tuple]:
    return rows_of(url, "SELECT spent, held FROM budget_books WHERE book = 'hard'")


def _settled(url: str) -> list[tuple]:
    return rows_of(url, "SELECT request_id, amount FROM budget_settled ORDER BY 1")


async def _outage_ends_leases(url: str, survivor: PgBooks, *gone: PgBooks) -> None:
    """What an outage longer than ``lease_s`` leaves: ``gone``'s leases ended, then ``survivor`` renews first."""
    for books in gone:
        assert books._beat is not None
        books._beat.cancel()  # no renewal went through while the database was away
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "UPDATE budget_replicas SET lease_until = now() - interval '1 second' WHERE replica = ANY (%s)",
            [[b.replica for b in gone]],
        )
    await survivor._renew()  # its renewal ends theirs: their named holds become spend at the worst case


async def test_a_settlement_sent_after_its_lease_ended_in_an_outage_replaces_the_worst_case(tmp_path, pg_url):
    """Before: $0.30 (the expired hold, as spend) + $0.12 (the settlement) = $0.42 spent for one $0.12 request."""
    ledger = pg(tmp_path, pg_url)
    a, b = PgBooks(pg_url, "a", lease_s=3), PgBooks(pg_url, "b", lease_s=3)
    await a.start()
    await b.start()
    try:
        hold = await a.reserve([Ask(BOOK, D("1"), WORST)], request_id="req-1", started=START)
        assert _books(pg_url) == [(0, WORST)]
        await _outage_ends_leases(pg_url, b, a)
        assert _books(pg_url) == [(WORST, 0)]  # counted at its worst case while its replica is silent
        assert _settled(pg_url) == [("req-1", WORST)]
        await a._renew()  # the database is back for replica a too: it renews, then settles
        a.settle(hold, [(BOOK, REAL)], "req-1", START)
        await asyncio.gather(*a._tasks)
        assert _books(pg_url) == [(REAL, 0)]  # the real cost replaces the worst case: $0.12, once
        assert _settled(pg_url) == [("req-1", REAL)]
        # the next reconciliation agrees (no row yet: the settlement counts), and once the row is in
        budget = Budget("hard", D("1"), period=Period("day"))
        window = [(budget, BOOK, START, START + dt.timedelta(days=1))]
        assert reconcile(ledger.pool, window) == 1
        assert _books(pg_url) == [(REAL, 0)]
        ledger.write_rows([make_row("req-1", started_at=START.timestamp() + 60, cost_usd=REAL)])
        assert reconcile(ledger.pool, window) == 1
        assert _books(pg_url) == [(REAL, 0)] and _settled(pg_url) == []
    finally:
        await a.stop()
        await b.stop()


async def test_a_settlement_sent_twice_counts_once(tmp_path, pg_url):
    """The first ``tw_settle`` committed as the database went away; the replica queued it and sent it again.

    Before: $0.12 twice, $0.24 spent until the next reconciliation (30 s later).
    """
    pg(tmp_path, pg_url)
    a = PgBooks(pg_url, "a", lease_s=3)
    await a.start()
    try:
        hold = await a.reserve([Ask(BOOK, D("1"), WORST)], request_id="req-2", started=START)
        hold_id = hold.id
        a.settle(hold, [(BOOK, REAL)], "req-2", START)
        await asyncio.gather(*a._tasks)
        a._queued.append((hold_id, "req-2", START, ["hard"], [START], [REAL]))  # its reply was lost: sent again
        await a._send_queued()
        assert _books(pg_url) == [(REAL, 0)]
        assert _settled(pg_url) == [("req-2", REAL)]
    finally:
        await a.stop()


async def test_a_settlement_without_a_hold_sent_twice_counts_once(tmp_path, pg_url):
    """Nothing was held for the request (a blocking budget in scope, no reservation); its settlement is sent twice.

    Before: $0.12 + $0.12 = $0.24 spent for one $0.12 request, until the next reconciliation.
    Another request's settlement still counts: $0.12 + $0.05 = $0.17.
    """
    ledger = pg(tmp_path, pg_url)
    a = PgBooks(pg_url, "a", lease_s=3)
    await a.start()
    try:
        a.settle(None, [(BOOK, REAL)], "req-4", START)
        await asyncio.gather(*a._tasks)
        assert _books(pg_url) == [(REAL, 0)]
        a._queued.append((None, "req-4", START, ["hard"], [START], [REAL]))  # its reply was lost: sent again
        await a._send_queued()
        assert _books(pg_url) == [(REAL, 0)]
        a.settle(None, [(BOOK, D("0.05"))], "req-5", START)
        await asyncio.gather(*a._tasks)
        assert _books(pg_url) == [(D("0.17"), 0)]
        assert _settled(pg_url) == [("req-4", REAL), ("req-5", D("0.05"))]
        # a reconciliation keeps what is remembered for two days: the same settlement still counts once
        budget = Budget("hard", D("1"), period=Period("day"))
        assert reconcile(ledger.pool, [(budget, BOOK, START, START + dt.timedelta(days=1))]) == 1
        a._queued.append((None, "req-4", START, ["hard"], [START], [REAL]))
        await a._send_queued()
        assert _books(pg_url) == [(D("0.17"), 0)]
    finally:
        await a.stop()


async def test_a_settlement_after_the_row_arrived_and_was_reconciled_is_not_counted_again(tmp_path, pg_url):
    """The row reached the ledger and a reconciliation counted it before the queued settlement got through.

    $0.12 from the row; the late settlement of the hold that expired must not add $0.12 more.
    """
    ledger = pg(tmp_path, pg_url)
    a, b = PgBooks(pg_url, "a", lease_s=3), PgBooks(pg_url, "b", lease_s=3)
    await a.start()
    await b.start()
    try:
        hold = await a.reserve([Ask(BOOK, D("1"), WORST)], request_id="req-3", started=START)
        await _outage_ends_leases(pg_url, b, a)
        ledger.write_rows([make_row("req-3", started_at=START.timestamp() + 60, cost_usd=REAL)])
        budget = Budget("hard", D("1"), period=Period("day"))
        assert reconcile(ledger.pool, [(budget, BOOK, START, START + dt.timedelta(days=1))]) == 1
        assert _books(pg_url) == [(REAL, 0)] and _settled(pg_url) == []
        await a._renew()
        a.settle(hold, [(BOOK, REAL)], "req-3", START)
        await asyncio.gather(*a._tasks)
        assert _books(pg_url) == [(REAL, 0)]
    finally:
        await a.stop()
        await b.stop()


class CuttingRelay:
    """A TCP relay to Postgres (in a thread) that can drop the server's next reply and close the connection.

    Armed with :meth:`cut_next_reply`, the answer to the next query is never delivered: the
    server has run (and, in autocommit, committed) it, the client sees the connection drop, as
    when the database host goes away between the commit and the reply.
    """

    def __init__(self, port: int) -> None:
        import threading

        self.target = port
        self.port = 0
        self.cuts = 0
        self._armed = False
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> CuttingRelay:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def cut_next_reply(self) -> None:
        self._armed = True

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, replies: bool) -> None:
            try:
                while data := await src.read(65536):
                    if replies and self._armed:
                        self._armed = False
                        self.cuts += 1
                        break  # the reply is dropped; both sides are closed below
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                for w in (writer, up_writer):
                    w.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))


async def test_a_reservation_whose_reply_was_lost_is_given_back_once_the_database_answers(tmp_path, pg_url):
    """``tw_reserve_for`` committed a $0.30 hold, then the connection dropped before its reply.

    Before: the request got 503 and never ran, and the hold stayed, $0.30 of the $1 held for as
    long as the replica lived (each reconciliation counts open holds), and its stop turned it
    into spend. Then (m011) the hold was released at the next renewal, the request still refused.
    Now the reservation is sent again on a new connection at once, the lost hold given back
    first: the request runs, holding $0.30 once.
    """
    from urllib.parse import urlsplit

    pg(tmp_path, pg_url)
    parts = urlsplit(pg_url)
    with CuttingRelay(parts.port) as relay:
        url = pg_url.replace(f":{parts.port}/", f":{relay.port}/")
        a = PgBooks(url, "a", lease_s=30)  # no renewal of its own during the test
        await a.start()
        try:
            relay.cut_next_reply()
            hold = await a.reserve([Ask(BOOK, D("1"), WORST)], request_id="req-lost", started=START)
            assert relay.cuts == 1
            assert _books(pg_url) == [(0, WORST)]  # held once: the committed hold whose reply was lost is gone
            assert rows_of(pg_url, "SELECT request_id FROM budget_holds") == [("req-lost",)]
            a.settle(hold, [(BOOK, REAL)], "req-lost", START)
            await asyncio.gather(*a._tasks)
            assert _books(pg_url) == [(REAL, 0)]
        finally:
            await a.stop()
        assert _books(pg_url) == [(REAL, 0)]


async def test_pooled_connections_survive_a_postgres_restart(tmp_path, pg_cluster):
    """Postgres restarts while the pools' connections sit idle; the next statement on each is served.

    Before: the first use of each pooled connection failed (``OperationalError``: the server had
    closed it), so the first reservation after a restart was refused (503 ``budget_books_unavailable``)
    and the first state-store read raised ``LedgerError``.
    """
    import uuid

    url = pg_cluster.create_database(f"t_{uuid.uuid4().hex[:12]}")
    ledger = pg(tmp_path, url)
    books = PgBooks(url, "a", lease_s=30)
    await books.start()
    try:
        assert ledger.state.claimed("hard", START) == set()  # a connection of each pool, now idle
        first = await books.reserve([Ask(BOOK, D("1"), WORST)], request_id="req-6", started=START)
        books.settle(first, [(BOOK, REAL)], "req-6", START)
        await asyncio.gather(*books._tasks)
        assert _books(url) == [(REAL, 0)] and books.queued == 0
        pg_cluster.restart()
        assert ledger.state.claimed("hard", START) == set()  # the sync pool: no LedgerError
        hold = await books.reserve([Ask(BOOK, D("1"), WORST)], request_id="req-7", started=START)  # the async pool
        assert hold.amounts == [(BOOK, WORST)]
        assert _books(url) == [(REAL, WORST)]
    finally:
        await books.stop()
