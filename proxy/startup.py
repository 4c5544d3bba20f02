"""What the proxy does once before serving: one proxy per DuckDB ledger, old state moved, books opened.

* :func:`single_proxy_lock`: with blocking budgets, the budget books live in one proxy's memory,
  so a second proxy on the same DuckDB ledger would enforce every limit a second time; it
  refuses to start (field case: two proxies overshot a hard budget by 90 %).
* :func:`import_legacy_state`: keys and alert claims an earlier version kept in the DuckDB
  file move to the state store once.
* :func:`load_unpriced`: the models earlier runs recorded without a price, so that the admins'
  alert about each survives a restart (the proxy's checks read this process's figures);
* :func:`load_books`: the budget books start from the ledger plus every row still in the
  write-ahead log (what a crash left: rows, and the reservation of each request that was at the
  upstream), so a hard limit holds across kill -9 and restart.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import fcntl
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import IO, TYPE_CHECKING, Any

from tokenward.proxy.config import Config
from tokenward.proxy.guard import BudgetGuard
from tokenward.reports.ledger import DuckLedger, Ledger, LedgerBusy, LedgerError, WriteAheadLog
from tokenward.reports.ledger.mover import MoverDied

if TYPE_CHECKING:
    from tokenward.reports.ledger.spend import DuckSpend

__all__ = [
    "LOCAL_REFRESH_S",
    "StartupError",
    "import_legacy_state",
    "load_books",
    "load_unpriced",
    "needs_single_proxy",
    "refresh_local_books",
    "single_proxy_lock",
]

LOCAL_REFRESH_S = 10.0
"""How often (s) each replica on a shared ledger reads every replica's spend for the budgets it counts in memory."""

log = logging.getLogger("tokenward.proxy")


class StartupError(RuntimeError):
    """The proxy must not start (the message says why and what to do)."""


def needs_single_proxy(config: Config) -> bool:
    """Whether ``config`` keeps hard-limit books in this process (blocking budgets on a DuckDB ledger).

    Per-value budgets (``per``) count. Run budgets do not make a second proxy refuse to start:
    a proxy that cannot hold the lock serves no runs instead (:func:`runs_allowed`). A Postgres
    ledger (``ledger.url``) never does: its replicas share the books there.
    """
    if config.ledger.url:
        return False
    return any(budget.blocking for budget in [*config.budget_list(), *config.budget_templates()])


def runs_allowed(config: Config) -> bool:
    """Whether some caller may set run budgets (``auth.runs`` or a key's ``runs`` not ``forbidden``)."""
    policies = [config.auth.runs, *(key.runs for key in config.virtual_keys if key.runs is not None)]
    return any(policy.mode != "forbidden" for policy in policies)


def single_proxy_lock(ledger: DuckLedger) -> IO[str]:
    """Hold ``<ledger>.proxy.lock`` for as long as the returned file stays open.

    Raises:
        StartupError: another proxy holds it.
    """
    path = ledger.path + ".proxy.lock"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # as the ledger's own log does
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the proxy's lifetime
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise StartupError(
            f"another tokenward proxy ({holder}) serves the ledger {ledger.path} with blocking budgets. "
            "Their books are kept in that process, so a second proxy would enforce every hard limit again "
            "(and overshoot it): run one proxy per DuckDB ledger, or give all replicas a shared Postgres "
            "ledger (ledger.url)."
        ) from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def import_legacy_state(ledger: Ledger) -> None:
    """Move keys and alert claims from an earlier version's DuckDB tables into the state store (once)."""
    if not isinstance(ledger, DuckLedger):
        return  # a Postgres ledger never had them
    try:
        copied = ledger.import_legacy()  # in the mover child when the proxy serves
    except LedgerError as exc:
        log.debug("earlier state not imported this time: %s", exc)
        return
    if copied.total:  # before: "moved 5 keys, alert claims and deliveries" for 1 key, 1 claim, 3 deliveries
        log.info("moved %s from the ledger file into the state store %s", copied, ledger.state.path)


Loader = Callable[[Any, dt.datetime, list[dict[str, Any]]], None]
"""``loader(spend, now, unflushed)``: more books to open from the ledger (a ``SpendSource``) at start."""


def load_books(
    ledger: Ledger, guard: BudgetGuard, wal: WriteAheadLog, wait_s: float = 30.0, loaders: Sequence[Loader] = ()
) -> None:
    """Open the budget books from the ledger (read-only) plus the rows not yet moved into it.

    ``loaders`` open more books in the same session, before the guard's (runs, per-user budgets,
    velocity books). A shared ledger (Postgres): this process's figures from the ledger, and the
    shared books of blocking budgets (those the loaders opened too) reconciled from it (rows in
    the period plus settlements not yet in it).

    Raises:
        LedgerError: the ledger could not be read within ``wait_s`` seconds (another process kept
            writing it): serving without the books would let hard limits be overshot.
    """
    if ledger.shared:
        from tokenward.reports.ledger.pg_books import reconcile

        now = guard.clock()  # the database server's clock: every replica opens the same periods
        ledger.read_spend(partial(_load, guard, now, [], loaders))
        reconcile(ledger.pool, guard.book_windows(now))  # type: ignore[attr-defined]
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            unflushed = ledger.unflushed_rows(wal)
            now = dt.datetime.now(dt.UTC)
            ledger.read_spend(partial(_load_duck, guard, now, unflushed, loaders))
            if unflushed:
                log.info("budget books count %d rows not yet in the ledger", len(unflushed))
            return
        except (LedgerBusy, MoverDied) as exc:
            if isinstance(exc, MoverDied):
                log.error("%s; reading the budget books again", exc)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def load_unpriced(ledger: Ledger, recorder: Any) -> None:
    """Seed ``recorder.unpriced_seen`` from the ledger and the log (blocking; DuckDB ledgers only).

    The proxy's alert checks read unpriced models from this process's figures
    (:class:`~tokenward.proxy.guard.BooksSpend`): without this, a model first seen less than an
    evaluation before a restart (a kill, a deploy) was never alerted. A ledger that cannot be read
    now is logged and skipped (the alert then waits for the model's next request).
    """
    if ledger.shared:  # the checks read the shared ledger itself
        return
    try:
        logged = ledger.unflushed_rows(recorder.wal)
        found, unflushed = ledger.read_spend(
            lambda spend: (
                [(status, model) for status in _UNPRICED for model in spend.unpriced_models(status)],
                not_in_ledger(spend, logged),  # a move may have landed since the log was read
            )
        )
    except LedgerError as exc:
        log.warning("models recorded without a price before this start not read: %s", exc)
        return
    recorder.seed_unpriced(found, unflushed)


_UNPRICED = ("unpriced", "usage_invalid")


async def refresh_local_books(ledger: Ledger, guard: BudgetGuard) -> None:
    """Set the books of budgets that do not block to every replica's rows in a shared ledger.

    Those books are kept in each replica's memory (only blocking budgets need the shared store's
    round trips), so without this each replica's budget headers, ``GET /v1/tokenward/budget`` and
    threshold checks would count only its own traffic. Rows this replica has not moved yet show
    at the next pass (within a flush interval).
    """
    now = guard.clock()
    try:
        figures = await asyncio.to_thread(ledger.read_spend, partial(guard.read_local, now=now))
    except LedgerError as exc:
        log.warning("cannot read the ledger to refresh the budgets counted in memory: %s", exc)
        return
    guard.apply_local(figures)


def _load(
    guard: BudgetGuard, now: dt.datetime, unflushed: list[dict[str, Any]], loaders: Sequence[Loader], spend: Any
) -> None:
    for loader in loaders:
        loader(spend, now, unflushed)
    guard.load(spend, now, unflushed)


def _load_duck(
    guard: BudgetGuard, now: dt.datetime, unflushed: list[dict[str, Any]], loaders: Sequence[Loader], spend: Any
) -> None:
    _load(guard, now, not_in_ledger(spend, unflushed), loaders, spend)


def not_in_ledger(spend: DuckSpend, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (read from the log) but those the ledger holds by now, as ``spend``'s connection sees it.

    The log is read before the ledger's session opens, and the recorder's move (running since
    :meth:`Recorder.start`) can land in between: the rows it moved are then in the ledger too,
    and were counted twice. Within the read-only session nothing moves (this process's moves
    wait for the session, another process cannot open the file to write), so what the session
    sees in the ledger is counted from there and the rest from the log: each row once.
    """
    if not rows:
        return rows
    held = spend.present([str(row.get("request_id")) for row in rows])
    return [row for row in rows if row.get("request_id") not in held] if held else rows
