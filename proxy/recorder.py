"""From a finished exchange to a ledger row, off the request path.

:meth:`Recorder.finish` is called exactly once per exchange, on the event loop, and does only
cheap work: price the usage (``tokenward.pricing.cost``), build the row dict, queue it. Token
estimation (tokenizer work) is sent to a worker thread first. A writer task wakes every
``flush_interval_s`` seconds and hands the queued rows to a worker thread, which spools them and
bulk-inserts them into DuckDB (:class:`tokenward.reports.ledger.Spool`). :meth:`Recorder.stop`
waits for estimates in flight and flushes everything on graceful shutdown.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from tokenward.pricing.catalog import PriceCatalog
from tokenward.pricing.quote import PriceStatus, Quote, quote
from tokenward.pricing.usage import TOKEN_FIELDS, Usage, UsageSource
from tokenward.proxy.exchange import Exchange
from tokenward.proxy.guard import BudgetGuard
from tokenward.proxy.live import LiveFeed
from tokenward.proxy.metrics import Metrics
from tokenward.reports.ledger import LedgerBusy, LedgerError, Spool, open_ledger

__all__ = ["PriceStatus", "Recorder", "build_row", "build_rows"]

log = logging.getLogger("tokenward.recorder")

_NO_USAGE = Usage(source=UsageSource.NONE)


def build_rows(ex: Exchange, catalog: PriceCatalog) -> list[dict[str, Any]]:
    """The ledger rows for a finished exchange: its own row, then one row per other-model part.

    Part rows (``row_kind = part``) carry the part's model, tokens and cost, and link to the
    request by ``parent_request_id``; their ids are the request id plus ``-p1``, ``-p2``, ...
    """
    rows = [build_row(ex, catalog)]
    for index, (model, usage) in enumerate(ex.parts, start=1):
        part = build_row(ex, catalog, model=model, usage=usage)
        part.update(
            request_id=f"{ex.request_id}-p{index}",
            row_kind="part",
            parent_request_id=ex.request_id,
            requested_model=None,
            raw_usage=None,
            provider_cost_usd=None,
            client_request_id=None,
        )
        rows.append(part)
    return rows


def build_row(
    ex: Exchange, catalog: PriceCatalog, *, model: str | None = None, usage: Usage | None = None
) -> dict[str, Any]:
    """The ledger row for a finished exchange (keys as in ``reports.ledger.ROW_COLUMNS``).

    Prices the usage with the entry resolved for the served model (the requested model when
    the reply named none) at the upstream's catalog provider. ``model`` and ``usage`` replace
    the exchange's own (for part rows).
    """
    served = model or ex.served_model
    metered = usage or ex.usage
    usage = metered or _NO_USAGE
    q: Quote | None = None
    if ex.endpoint == "passthrough":
        status = PriceStatus.NOT_METERED
    elif metered is None and ex.usage_deferred:
        status = PriceStatus.DEFERRED
    elif metered is None and ex.maybe_billed:
        status = PriceStatus.USAGE_UNKNOWN
    elif metered is None:
        status = PriceStatus.NOT_BILLED
    else:
        q = quote(
            catalog,
            usage,
            model=served or ex.requested_model,
            provider=ex.provider,
            at=dt.datetime.fromtimestamp(ex.started_at, dt.UTC),
            service_tier=ex.service_tier,
            fallback=ex.price_fallback,
        )
        status = q.status
    cost_usd: Decimal | None = q.cost_usd if q is not None else (Decimal(0) if status == "not_billed" else None)
    violations = usage.violations() if metered is not None else []
    if violations:
        log.warning("request %s: usage breaks invariants: %s", ex.request_id, "; ".join(violations))
    ended_perf = ex.ended_perf if ex.ended_perf is not None else ex.started_perf
    row: dict[str, Any] = {
        "request_id": ex.request_id,
        "client_request_id": ex.client_request_id,
        "started_at": ex.started_at,
        "ended_at": ex.started_at + (ended_perf - ex.started_perf),
        "principal": ex.principal,
        "method": ex.method,
        "path": ex.path,
        "endpoint": ex.endpoint,
        "upstream": ex.upstream,
        "provider": ex.provider,
        "requested_model": ex.requested_model,
        "served_model": served,
        "http_status": ex.http_status,
        "outcome": str(ex.outcome or "proxy_error"),
        "stream": ex.stream,
        "usage_source": str(usage.source),
        "cost_usd": cost_usd,
        "price_status": status,
        "price_entry_id": q.entry_id if q else None,
        "price_resolved_by": q.resolved_by if q else None,
        "cost_lines": q.lines if q else None,
        "output_cost_usd": q.output_cost_usd if q else None,
        "cache_savings_usd": q.cache_savings_usd if q else None,
        "provider_cost_usd": ex.provider_cost,
        "service_tier": ex.service_tier,
        "latency_ms": ex.latency_ms,
        "ttfb_ms": ex.ttfb_ms,
        "error": ex.error,
        "violations": "; ".join(violations) or None,
        "raw_usage": ex.raw_usage,
        "row_kind": ex.row_kind,
        "parent_request_id": ex.parent_request_id,
        "key_id": ex.key_id,
        "team": ex.team,
        "project": ex.project,
        "end_user": ex.end_user,
        "tags": list(ex.tags) or None,
        "session_id": ex.session_id,
    }
    for name in TOKEN_FIELDS:
        row[name] = getattr(usage, name)
    return row


def _log_unpriced(row: dict[str, Any]) -> None:
    log.warning(
        "first request for unpriced model %r (provider %r, request %s): recorded without a cost; add a price",
        row["served_model"] or row["requested_model"],
        row["provider"],
        row["request_id"],
    )


class Recorder:
    """Queues one row per finished exchange and writes them to the ledger in batches.

    Args:
        catalog: prices for :func:`build_row`.
        ledger_path: the DuckDB file.
        flush_interval_s: seconds between writes (rows wait in memory at most this long).
        metrics: counters updated per row (a new set when omitted).
        on_unpriced: called with the first unpriced row of each (provider, model) this process
            sees (alerts hook in here); by default a warning is logged.
        guard: budgets to settle each exchange's reservation with and count its cost against.
    """

    def __init__(
        self,
        catalog: PriceCatalog,
        ledger_path: str,
        flush_interval_s: float = 1.0,
        metrics: Metrics | None = None,
        on_unpriced: Callable[[dict[str, Any]], None] | None = None,
        guard: BudgetGuard | None = None,
    ) -> None:
        self.catalog = catalog
        self.metrics = metrics or Metrics()
        self.on_unpriced = on_unpriced or _log_unpriced
        self.guard = guard
        self._unpriced_seen: set[tuple[str | None, str | None]] = set()
        self.spool = Spool(ledger_path)
        self.flush_interval_s = flush_interval_s
        self._rows: list[dict[str, Any]] = []
        self._estimates: set[asyncio.Future[Any]] = set()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.rows_recorded = 0
        self.live = LiveFeed(guard.budgets if guard is not None else ())  # what live views read

    def finish(self, ex: Exchange, estimate: Callable[[], Usage] | None = None) -> None:
        """Record ``ex`` (once; later calls are ignored). Call on the event loop.

        Args:
            ex: the ended exchange.
            estimate: when given, computes the usage in a worker thread before the row is queued
                (the upstream reported none).
        """
        if ex.recorded:
            return
        ex.recorded = True
        if estimate is None:
            self._queue(ex)
            return
        future = asyncio.get_running_loop().run_in_executor(None, estimate)
        self._estimates.add(future)
        future.add_done_callback(lambda done: self._estimated(ex, done))

    def _estimated(self, ex: Exchange, future: asyncio.Future[Usage]) -> None:
        self._estimates.discard(future)
        if future.cancelled() or future.exception() is not None:
            log.error(
                "token estimate failed for %s: %s",
                ex.request_id,
                future.exception() if not future.cancelled() else "cancelled",
            )
        else:
            ex.usage = future.result()
        self._queue(ex)

    def _queue(self, ex: Exchange) -> None:
        try:
            rows = build_rows(ex, self.catalog)
        except Exception:  # never lose the row over a pricing bug
            log.exception("pricing failed for %s; recording it unpriced", ex.request_id)
            rows = build_rows(ex, PriceCatalog())
        if self.guard is not None:
            self.guard.release(ex.reservation)
            ex.reservation = None
        for row in rows:
            self.metrics.observe(row)
            if self.guard is not None:
                self.guard.observe(row)
            if row["price_status"] == PriceStatus.UNPRICED:
                key = (row["provider"], row["served_model"] or row["requested_model"])
                if key not in self._unpriced_seen:
                    self._unpriced_seen.add(key)
                    try:
                        self.on_unpriced(row)
                    except Exception:
                        log.exception("unpriced-model hook failed")
        self._rows.extend(rows)
        self.live.add(rows)
        self.rows_recorded += len(rows)
        self.metrics.pending.set(len(self._rows))

    async def start(self) -> None:
        """Open (create, migrate) the ledger, ingest rows a previous run left spooled, start the writer.

        Raises:
            LedgerError: the ledger cannot be created or opened (a read-only directory, say): the
                proxy must not serve traffic it cannot record.
            OSError: likewise, from the file system.
        """
        await asyncio.to_thread(self._open_check)
        await asyncio.to_thread(self._ingest, True)
        self._task = asyncio.create_task(self._run(), name="tokenward-ledger-writer")

    def _open_check(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                open_ledger(self.spool.ledger_path).close()
                self.spool.directory.mkdir(parents=True, exist_ok=True)
                return
            except LedgerBusy:
                if time.monotonic() > deadline:
                    return  # held by a reader: rows will wait in the spool
                time.sleep(0.1)

    async def _run(self) -> None:
        failing = False
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), self.flush_interval_s)
            except TimeoutError:
                pass
            if self._stopping.is_set():
                return  # stop() takes over: it flushes what is left
            try:
                await self.flush()
            except Exception:  # the writer must survive a full disk or a lost directory
                if not failing:
                    log.exception("cannot write ledger rows; %d kept in memory, retrying", len(self._rows))
                failing = True
            else:
                if failing:
                    log.warning("ledger rows are being written again")
                failing = False

    async def flush(self) -> None:
        """Write queued rows to the spool and try to move the spool into the ledger.

        Raises:
            OSError: the spool could not be written; the rows stay queued for the next try.
        """
        rows, self._rows = self._rows, []
        try:
            await asyncio.to_thread(self._write, rows)
        except Exception:
            self._rows[:0] = rows
            raise
        finally:
            self.metrics.pending.set(len(self._rows))

    def _write(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.spool.write(rows)
        self._ingest(False)

    def _ingest(self, recover: bool) -> None:
        try:
            self.spool.ingest(recover=recover)
        except LedgerBusy:
            log.debug("ledger busy (a reader holds it); rows stay spooled until the next flush")
        except LedgerError:
            log.exception("cannot write the ledger; rows stay spooled in %s", self.spool.directory)

    async def stop(self, wait_busy_s: float = 5.0) -> None:
        """Stop the writer and write every row.

        A flush under way finishes first; estimates in flight are awaited; a busy ledger is retried
        for ``wait_busy_s`` seconds (rows that still cannot go in stay spooled for the next start).
        """
        self._stopping.set()
        if self._task is not None:
            await self._task
        if self._estimates:
            await asyncio.gather(*self._estimates, return_exceptions=True)
        rows, self._rows = self._rows, []
        if rows:
            await asyncio.to_thread(self.spool.write, rows)
        deadline = asyncio.get_running_loop().time() + wait_busy_s
        while True:
            try:
                await asyncio.to_thread(self.spool.ingest)
                return
            except LedgerBusy:
                if asyncio.get_running_loop().time() >= deadline:
                    log.warning("ledger still busy at shutdown; rows stay spooled in %s", self.spool.directory)
                    return
                await asyncio.sleep(0.1)
            except LedgerError:
                log.exception("cannot write the ledger at shutdown; rows stay spooled in %s", self.spool.directory)
                return
