"""Budget books in Postgres, shared by every replica: :class:`PgBooks` and :func:`reconcile`.

The :class:`~tokenward.reports.ledger.books.BookStore` of a Postgres ledger (see the design note
of :mod:`~tokenward.reports.ledger.books`): reserve, settle and release are one round trip each
(``tw_reserve``/``tw_settle`` in :mod:`~tokenward.reports.ledger.pg_migrations`), leases release
the holds of a replica that stopped, and :func:`reconcile` sets ``spent`` from the ledger.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import psycopg

from tokenward.pricing.budgets import Budget
from tokenward.reports.ledger.books import Ask, BookKey, BooksUnavailable, Hold, Refused
from tokenward.reports.ledger.errors import LedgerError
from tokenward.reports.ledger.pg_pool import AsyncPool, ConnectionLost, SyncPool
from tokenward.reports.ledger.pg_spend import pg_scope_clause
from tokenward.reports.ledger.schema import SPEND_EXPRESSION

__all__ = ["PgBooks", "reconcile"]

log = logging.getLogger("tokenward.books")

_RESERVE = (
    "SELECT hold_id, refused, remaining, held, spent, holding FROM tw_reserve(%s, %s, %s::timestamptz[], "
    "%s::numeric[], %s::numeric[], %s)"
)
_RESERVE_FOR = (
    "SELECT hold_id, refused, remaining, held, spent, holding FROM tw_reserve_for(%s, %s, %s, %s, "
    "%s::timestamptz[], %s::numeric[], %s::numeric[], %s)"
)
_SEED = (
    "INSERT INTO budget_books (book, period_start, limit_usd, spent) SELECT * FROM unnest(%s::text[], "
    "%s::timestamptz[], %s::numeric[], %s::numeric[]) ORDER BY 1, 2 ON CONFLICT DO NOTHING"
)
_RUN_START = (
    "INSERT INTO budget_runs VALUES (%s, %s) ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name RETURNING started_at"
)
_SETTLE = "SELECT tw_settle(%s, %s, %s, %s, %s::timestamptz[], %s::numeric[])"
_RELEASE_NAMED = (
    "SELECT tw_settle(hold_id, NULL, now(), '{}'::text[], '{}'::timestamptz[], '{}'::numeric[]) "
    "FROM budget_holds WHERE replica = %s AND request_id = %s"
)
_RENEW = (
    "INSERT INTO budget_replicas VALUES (%s, now() + %s * interval '1 second') "
    "ON CONFLICT (replica) DO UPDATE SET lease_until = EXCLUDED.lease_until"
)


class PgBooks:
    """:class:`BookStore` in the Postgres ledger, shared by every replica.

    Call :meth:`start` on the event loop before the first reservation and :meth:`stop` at
    shutdown (which settles what is queued and gives this replica's holds back at once).

    Args:
        url: the ledger's database.
        replica: this process's name (its write-ahead log writer id).
        lease_s: seconds after which the holds of a replica that stopped renewing are released.
        pool_size: connections for reservations and settlements.
    """

    shared = True

    def __init__(self, url: str, replica: str, lease_s: float = 15.0, pool_size: int = 4) -> None:
        self.replica = replica
        self.lease_s = lease_s
        self._pool = AsyncPool(url, pool_size)
        self._view: dict[BookKey, list[Decimal]] = {}
        self._queued: list[tuple[Any, ...]] = []  # settlements that could not be sent yet
        # requests whose reservation failed after it was sent: it may have committed (the reply lost)
        self._unsure: list[str] = []
        self._seeds: dict[BookKey, Decimal] = {}  # spent of books to make if the database has none
        self._tasks: set[asyncio.Task[None]] = set()
        self._beat: asyncio.Task[None] | None = None
        self.available = True
        """Whether the last call reached the database."""
        self.run_horizon_s = 7 * 86400.0
        """Runs whose first request is older than this are forgotten (at least every ``max_ttl``)."""

    # -- local view --------------------------------------------------------------------------

    def _entry(self, key: BookKey) -> list[Decimal]:
        entry = self._view.get(key)
        if entry is None:
            entry = self._view[key] = [Decimal(0), Decimal(0)]
        return entry

    def spent(self, key: BookKey) -> Decimal:
        """See :meth:`BookStore.spent` (as last seen, plus this process's spend since)."""
        entry = self._view.get(key)
        return entry[0] if entry else Decimal(0)

    def held(self, key: BookKey) -> Decimal:
        """See :meth:`BookStore.held` (as last seen)."""
        entry = self._view.get(key)
        return entry[1] if entry else Decimal(0)

    def add(self, key: BookKey, amount: Decimal) -> None:
        """See :meth:`BookStore.add` (the local view only: the database counts at settlement)."""
        self._entry(key)[0] += amount

    def set_spent(self, key: BookKey, amount: Decimal) -> None:
        """See :meth:`BookStore.set_spent`: the local view, and a book the database does not have yet.

        The database's figure wins where it has the book; where it has none (a per-user budget new
        to every replica, over rows already in the ledger), the next reservation makes it with
        ``amount`` spent, so it does not start from 0 until the next reconciliation.
        """
        self._entry(key)[0] = amount
        if amount > 0:
            self._seeds[key] = amount

    def forget(self, key: BookKey) -> None:
        """See :meth:`BookStore.forget` (the local view only: the database keeps the book)."""
        self._view.pop(key, None)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Take this replica's lease and start renewing it every ``lease_s / 3`` seconds.

        Raises:
            BooksUnavailable: the database cannot be reached.
        """
        await self._renew()
        self._beat = asyncio.create_task(self._heartbeat(), name="tokenward-books-lease")

    async def stop(self) -> None:
        """Send queued settlements, then end the lease (this replica's holds are released now)."""
        if self._beat is not None:
            self._beat.cancel()
            await asyncio.gather(self._beat, return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        try:
            await self._send_queued()
            async with self._pool.connection() as conn:
                await conn.execute(
                    "UPDATE budget_replicas SET lease_until = now() - interval '1 second' WHERE replica = %s",
                    [self.replica],
                )
                await conn.execute("SELECT tw_expire()")
        except (psycopg.Error, LedgerError, OSError) as exc:
            log.warning("budget holds of this replica are left to expire with its lease: %s", exc)
        await self._pool.close()

    async def _renew(self) -> None:
        try:
            async with self._pool.connection() as conn:
                await conn.execute(_RENEW, [self.replica, self.lease_s])
                await conn.execute(
                    "DELETE FROM budget_runs WHERE started_at < now() - %s * interval '1 second'", [self.run_horizon_s]
                )
                released = (await (await conn.execute("SELECT tw_expire()")).fetchone() or [0])[0]
                rows = await (
                    await conn.execute(
                        "SELECT book, period_start, spent, held FROM budget_books WHERE book = ANY (%s)",
                        [sorted({key[0] for key in self._view})],
                    )
                ).fetchall()
        except (psycopg.Error, OSError) as exc:
            self._down(exc)
            raise BooksUnavailable(f"budget books unavailable: {exc}") from exc
        except LedgerError as exc:
            self._down(exc)
            raise BooksUnavailable(str(exc)) from exc
        self._up()
        if released:
            log.warning("released the budget holds of %d book(s) of replicas whose lease ended", released)
        for book, start, spent, held in rows:
            entry = self._view.get((book, start))
            if entry is not None:
                entry[0], entry[1] = spent, held

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self._renew()
                await self._send_queued()
            except BooksUnavailable:
                pass  # logged once by _down; requests in scope of blocking budgets are refused meanwhile
            except Exception as exc:  # the lease must keep being renewed, whatever one pass met
                self._down(exc)

    def _down(self, exc: BaseException) -> None:
        if self.available:
            log.error("cannot reach the budget books (%s): blocking budgets refuse requests until it is back", exc)
        self.available = False

    def _up(self) -> None:
        if not self.available:
            log.warning("budget books reachable again")
        self.available = True

    async def run_started(self, name: str, now: dt.datetime) -> dt.datetime:
        """When run ``name`` had its first request on any replica (``now`` if this is it); one round trip.

        Raises:
            BooksUnavailable: the database cannot be reached.
        """
        try:
            async with self._pool.connection() as conn:
                row = await (await conn.execute(_RUN_START, [name, now])).fetchone()
        except (psycopg.Error, LedgerError, OSError) as exc:
            self._down(exc)
            raise BooksUnavailable(f"budget books unavailable: {exc}") from exc
        self._up()
        assert row is not None
        started: dt.datetime = row[0]
        return started

    # -- reservations ------------------------------------------------------------------------

    async def reserve(
        self,
        asks: Sequence[Ask],
        *,
        all_left: bool = False,
        request_id: str | None = None,
        started: dt.datetime | None = None,
    ) -> Hold:
        """See :meth:`BookStore.reserve`: one call of ``tw_reserve`` (renewing the lease first if it ended).

        With ``request_id`` (and the request's start), the hold is named after its request
        (``tw_reserve_for``): should this replica die, the hold keeps counting as that request's
        spend until its row arrives, instead of being given back. A named reservation whose
        connection broke (a restart of the server, a silent drop: :func:`_broken`) is sent again
        on new connections for up to :data:`RECONNECT_S` seconds, its hold (if that call made
        one) given back first, so it holds once.
        """
        named = [request_id, started] if request_id is not None else []
        params = [
            *named,
            self.replica,
            [a.key[0] for a in asks],
            [a.key[1] for a in asks],
            [a.limit for a in asks],
            [a.amount for a in asks],
            all_left,
        ]
        seeds = [a for a in asks if a.key in self._seeds]
        seed = [[a.key[0] for a in seeds], [a.key[1] for a in seeds], [a.limit for a in seeds]]
        seed.append([self._seeds[a.key] for a in seeds])
        renewed = lost = False
        give_up: float | None = None  # once a connection broke: until when the reservation is sent again
        while True:
            try:
                async with self._pool.connection() as conn:
                    if lost:  # the lost call may have committed its hold before the path died: give it back
                        await conn.execute(_RELEASE_NAMED, [self.replica, request_id])
                    if seeds:
                        await conn.execute(_SEED, seed)
                    row = await (await conn.execute(_RESERVE_FOR if named else _RESERVE, params)).fetchone()
                break
            except psycopg.Error as exc:
                if getattr(exc, "sqlstate", None) == "TW001" and not renewed:
                    renewed = True
                    await self._renew()  # the lease ended (a stall): take it again, then retry once
                    continue
                if request_id is not None and _broken(exc) and _again(give_up):
                    # a silent network drop (its session ended by us) or a server that ended the session
                    # (a restart): nothing more of that call can commit; on a fresh connection, its hold
                    # (if it made one) is released, then made again
                    if give_up is None:
                        give_up = time.monotonic() + RECONNECT_S
                        log.warning("budget reservation for %s: %s; sent again on a new connection", request_id, exc)
                    lost = True
                    continue
                if request_id is not None:  # the hold may be in the database all the same: given back later
                    self._unsure.append(request_id)
                self._down(exc)
                raise BooksUnavailable(f"budget books unavailable: {exc}") from exc
            except (LedgerError, OSError) as exc:
                if give_up is not None and _again(give_up):  # the server restarting: not accepting yet
                    await asyncio.sleep(0.25)
                    continue
                if lost:  # the call that broke may have left its hold: given back once the database is back
                    self._unsure.append(str(request_id))
                self._down(exc)
                raise BooksUnavailable(str(exc)) from exc
        self._up()
        for ask in seeds:
            self._seeds.pop(ask.key, None)
        assert row is not None
        hold_id, refused, remaining, held, spent, holding = row
        for ask, spent_usd, held_usd in zip(asks, spent or (), holding or (), strict=False):
            entry = self._entry(ask.key)
            entry[0], entry[1] = spent_usd, held_usd
        if refused is not None:
            raise Refused(int(refused) - 1, Decimal(remaining))
        return Hold([(ask.key, Decimal(amount)) for ask, amount in zip(asks, held, strict=True)], int(hold_id))

    def settle(
        self, hold: Hold | None, spends: Sequence[tuple[BookKey, Decimal]], request_id: str | None, started: dt.datetime
    ) -> None:
        """See :meth:`BookStore.settle`: one call of ``tw_settle``, in a task (queued while the database is down)."""
        if hold is not None:
            for key, amount in hold.amounts:
                entry = self._entry(key)
                entry[1] = max(entry[1] - amount, Decimal(0))
        hold_id = hold.id if hold is not None else None
        if hold is not None:
            hold.amounts = []
        if hold_id is None and not spends:
            return
        params = (
            hold_id,
            request_id,
            started,
            [k[0] for k, _ in spends],
            [k[1] for k, _ in spends],
            [amount for _, amount in spends],
        )
        task = asyncio.ensure_future(self._settle(params))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle(self, params: tuple[Any, ...]) -> None:
        try:
            async with self._pool.connection() as conn:
                await conn.execute(_SETTLE, list(params))
        except (psycopg.Error, LedgerError, OSError) as exc:
            # sent again later; if it had committed after all, the hold is gone and tw_settle replaces
            # the figure counted for the request instead of adding it again (m012_settle_once)
            self._down(exc)
            self._queued.append(params)

    async def _send_queued(self) -> None:
        """Give back the holds of reservations whose reply was lost, then send the queued settlements.

        A reservation that failed once its call was sent may have committed (the database went
        away between the commit and the reply): its request was refused (503) and never ran, but
        without this its hold would stay held for as long as this replica lives, then count as
        spend when it stops. Holds are named after their request, so each is found and released.
        """
        while self._unsure:
            async with self._pool.connection() as conn:
                await conn.execute(_RELEASE_NAMED, [self.replica, self._unsure[0]])
            self._unsure.pop(0)
        while self._queued:
            params = self._queued[0]
            async with self._pool.connection() as conn:
                await conn.execute(_SETTLE, list(params))
            self._queued.pop(0)

    @property
    def queued(self) -> int:
        """Settlements waiting for the database."""
        return len(self._queued)


RECONNECT_S = 5.0
"""Seconds a reservation whose connection broke (a restart of the server, a silent drop) is tried again for."""


def _broken(exc: psycopg.Error) -> bool:
    """Whether ``exc`` ended the session (the server shut down or vanished), rather than refusing the statement."""
    if isinstance(exc, ConnectionLost):
        return True
    state = getattr(exc, "sqlstate", None)
    return isinstance(exc, psycopg.OperationalError) and (state is None or state[:2] in ("08", "57"))


def _again(give_up: float | None) -> bool:
    return give_up is None or time.monotonic() < give_up


SETTLE_ONCE_DAYS = 2
"""Days a request id settled without a hold is remembered, so that the same settlement sent again counts once."""


def reconcile(pool: SyncPool, windows: Sequence[tuple[Budget, BookKey, dt.datetime, dt.datetime]]) -> int:
    """Set each book's ``spent`` from the ledger, and ``held`` from the open holds (blocking; a worker thread).

    ``windows``: ``(budget, book key, start, end)`` per book, where ``[start, end)`` is the
    window whose rows count (a calendar period, or a rolling budget's last hours). ``spent``
    becomes the rows in scope and window (by ``SPEND_EXPRESSION``) plus the settlements of
    requests not in the ledger yet; settlements whose rows have arrived are dropped. One book per
    transaction, its row locked first, so no settlement is counted twice or missed. Request ids
    settled without a hold are forgotten after :data:`SETTLE_ONCE_DAYS` days (m013).

    Returns:
        The number of books reconciled.

    Raises:
        LedgerError: the database cannot be reached.
    """
    done = 0
    if not windows:
        return done
    try:
        with pool.connection() as conn:
            conn.execute(
                "DELETE FROM budget_settle_once WHERE settled_at < now() - make_interval(days => %s)",
                [SETTLE_ONCE_DAYS],
            )
            for budget, (book, period_start), start, end in windows:
                where, params = pg_scope_clause(budget)
                with conn.transaction():
                    conn.execute(
                        "INSERT INTO budget_books (book, period_start, limit_usd) VALUES (%s, %s, %s) "
                        "ON CONFLICT DO NOTHING",
                        [book, period_start, budget.limit_usd],
                    )
                    conn.execute(
                        "SELECT 1 FROM budget_books WHERE book = %s AND period_start = %s FOR UPDATE",
                        [book, period_start],
                    )
                    conn.execute(
                        "DELETE FROM budget_settled s USING requests r WHERE s.book = %s AND s.period_start = %s "
                        "AND r.request_id = s.request_id",
                        [book, period_start],
                    )
                    conn.execute(
                        f"UPDATE budget_books SET spent = (SELECT coalesce(sum({SPEND_EXPRESSION}), 0) FROM requests "
                        f"WHERE started_at >= %s AND started_at < %s AND {where}) + (SELECT coalesce(sum(amount), 0) "
                        "FROM budget_settled WHERE book = %s AND period_start = %s AND started_at >= %s), "
                        "held = (SELECT coalesce(sum(x.amount), 0) FROM budget_holds h, "
                        "unnest(h.books, h.starts, h.amounts) AS x(book, start, amount) "
                        "WHERE x.book = %s AND x.start = %s), limit_usd = %s, reconciled_at = now() "
                        "WHERE book = %s AND period_start = %s",
                        [
                            start,
                            end,
                            *params,
                            book,
                            period_start,
                            start,
                            book,
                            period_start,
                            budget.limit_usd,
                            book,
                            period_start,
                        ],
                    )
                done += 1
    except psycopg.Error as exc:
        raise LedgerError(f"cannot reconcile the budget books: {exc}") from exc
    return done
