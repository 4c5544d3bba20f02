"""From a request to its one ledger row, durable before the client hears the end of the reply.

Three moments of an exchange reach the recorder, all on the event loop:

* :meth:`Recorder.admit` when the request arrives: the write-ahead log notes it in flight (if
  the process dies now, the request's row says ``interrupted``, not billed);
* :meth:`Recorder.forwarding`, awaited just before the request leaves for the upstream: from
  now on the fallback row says ``usage_unknown`` and keeps the budget reservation as spend;
* :meth:`Recorder.commit`, awaited before the last bytes of the reply go to the client: the
  usage is priced (``tokenward.pricing.cost``), the row built and appended to the log, and the
  budget books settled. :meth:`Recorder.finish` does the same without waiting, for exchanges
  whose client is gone.

Token estimation (tokenizer work) runs in a worker thread first. Every ``flush_interval_s`` (less
often while moves are costly, see :data:`FLUSH_SHARE`; at once when :data:`FLUSH_ROWS` rows wait)
a task moves the log's closed segments into the ledger (:meth:`DuckLedger.flush`) in a worker
thread. :meth:`Recorder.stop` records what is still open, then flushes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from decimal import Decimal
from functools import partial
from typing import Any

from tokenward.pricing.catalog import PriceCatalog
from tokenward.pricing.quote import PriceStatus, Quote, quote
from tokenward.pricing.usage import TOKEN_FIELDS, Usage, UsageSource
from tokenward.proxy import access_log
from tokenward.proxy.exchange import Exchange, Outcome
from tokenward.proxy.guard import BudgetGuard
from tokenward.proxy.live import LiveFeed
from tokenward.proxy.metrics import Metrics
from tokenward.reports.ledger import DuckLedger, Ledger, LedgerBusy, LedgerError, WriteAheadLog
from tokenward.reports.ledger.wal import encode_row

__all__ = [
    "FLUSH_ROWS",
    "FLUSH_SHARE",
    "MOVER_SILENT_S",
    "PriceStatus",
    "Recorder",
    "build_row",
    "build_rows",
    "fallback_row",
]

log = logging.getLogger("tokenward.recorder")

_NO_USAGE = Usage(source=UsageSource.NONE)

FLUSH_SHARE = 0.01
"""The share of the time moves of the log into the ledger may take: after a move that took ``d``
seconds the next waits ``d / FLUSH_SHARE`` seconds if that is longer than ``flush_interval_s``.

A move costs ~25 ms of CPU whatever its size (DuckDB's connect and the checkpoint at close; the
migration check runs on the first move only) plus ~10 us per row: at one a second it took 3 to 5 %
of a core from a busy proxy, 40 to 70 us per request at 600 requests/s and ~250 us per streamed
request at 115 streams/s. Rows are durable in the write-ahead log before their reply ends, and
budgets and live figures count them at once, so a later move only delays what readers of the file
(reports, the dashboard's history) see: by up to half of :attr:`Recorder.stale_after_s` (5 s by
default) under load, while a quiet proxy still moves its rows within ``flush_interval_s``."""

MOVER_SILENT_S = 1.5
"""Seconds a mover child working on a move may go unheard (it speaks every 0.5 s) before ``/healthz`` says so."""

FLUSH_ROWS = 20_000
"""Rows waiting in the log that start a move at once, so that a busy proxy's log (and the lag of
reports behind it) stays bounded. A move's fixed cost (~25 ms: DuckDB's connect and the
checkpoint at close) is spread over up to this many rows (it was 2,000: ~15 us per row at 1,800
requests/s). Memory grows with the rows of one move far less than it did: each segment of the log
(:data:`~tokenward.reports.ledger.wal.SEGMENT_BYTES`) is its own ``INSERT``, so ``read_json``
holds one segment at a time; what remains is DuckDB's new row groups until the checkpoint, +16 to
+23 MB for 9,000 rows (``bench/PROFILE.md`` section 7)."""


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
    the reply named none) at the upstream's catalog provider, unless a ``price_as`` pin (the
    upstream's, or ``pricing.price_as`` for the requested model) names the model to price as.
    ``model`` and ``usage`` replace the exchange's own (for part rows; pins do not apply to
    parts, which name their own model). ``violations`` lists, in order, counts refused as
    invalid, repair rules applied, and invariants still broken (see ``pricing.quote.PriceStatus``).
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
        own = model is None
        sent = ex.sent_model or ex.requested_model  # a rerouted request is priced as the model sent
        q = quote(
            catalog,
            usage,
            model=served or sent,
            provider=ex.provider,
            at=dt.datetime.fromtimestamp(ex.started_at, dt.UTC),
            service_tier=ex.service_tier,
            fallback=ex.price_fallback,
            requested=sent if own else None,
            price_as=ex.price_as if own else None,
        )
        status = q.status
        if own and ex.unseen_tool and status in (PriceStatus.PRICED, PriceStatus.REPAIRED):
            # the provider may have billed a tool the reply does not show: the cost is a lower bound
            status = PriceStatus.PARTIALLY_PRICED
            note = f"the request offered {ex.unseen_tool} and the reply does not say whether it ran: not billed"
            q = replace(q, status=status, lines=[*(q.lines or []), {"note": note}])
    cost_usd: Decimal | None = q.cost_usd if q is not None else (Decimal(0) if status == "not_billed" else None)
    violations = [*usage.invalid, *usage.repairs, *usage.violations()] if metered is not None else []
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
        "reserved_usd": ex.reserved_usd,
        "org": ex.org,
        "pool": ex.pool,
        "run_id": ex.run_id,
        "sent_model": ex.sent_model,
        "degraded": ex.degraded,
    }
    for name in TOKEN_FIELDS:
        row[name] = getattr(usage, name)
    row["image_variant"] = usage.image_variant
    return row


def fallback_row(ex: Exchange, *, forwarded: bool) -> dict[str, Any]:
    """The row ``ex`` gets if this process dies before it ends (what an admission record holds).

    Before forwarding: ``interrupted`` and ``not_billed`` (the upstream never saw it); after:
    ``usage_unknown`` (it may have been billed), keeping the budget reservation as spend.
    """
    row: dict[str, Any] = {
        "request_id": ex.request_id,
        "client_request_id": ex.client_request_id,
        "started_at": ex.started_at,
        "principal": ex.principal,
        "key_id": ex.key_id,
        "team": ex.team,
        "project": ex.project,
        "org": ex.org,
        "pool": ex.pool,
        "method": ex.method,
        "path": ex.path,
        "endpoint": ex.endpoint,
        "outcome": str(Outcome.INTERRUPTED),
        "usage_source": str(UsageSource.NONE),
    }
    if not forwarded:
        row.update(price_status=PriceStatus.NOT_BILLED, cost_usd=Decimal(0), error=_STOPPED_BEFORE)
        return row
    row.update(
        upstream=ex.upstream,
        provider=ex.provider,
        requested_model=ex.requested_model,
        stream=ex.stream,
        end_user=ex.end_user,
        tags=list(ex.tags) or None,
        session_id=ex.session_id,
        run_id=ex.run_id,
        sent_model=ex.sent_model,
        degraded=ex.degraded,
        reserved_usd=ex.reserved_usd,
        price_status=(
            PriceStatus.NOT_METERED if ex.endpoint == "passthrough" else PriceStatus.USAGE_UNKNOWN
        ),
        error=_STOPPED_DURING,
    )
    return row


_STOPPED_BEFORE = "tokenward stopped before forwarding the request"
_STOPPED_DURING = "tokenward stopped while the request was at the upstream; the provider may have billed it"


def _log_unpriced(row: dict[str, Any]) -> None:
    log.warning(
        "first request for unpriced model %r (provider %r, request %s): recorded without a cost; add a price",
        row["served_model"] or row["requested_model"],
        row["provider"],
        row["request_id"],
    )


class Recorder:
    """Writes one row per exchange ahead of the reply's end, and moves the log into the ledger.

    Args:
        catalog: prices for :func:`build_row`.
        ledger: the ledger (its log directory and file).
        flush_interval_s: seconds between moves of the log into the ledger file.
        metrics: counters updated per row (a new set when omitted).
        on_unpriced: called with the first unpriced row of each (provider, model) this process
            sees (alerts hook in here); by default a warning is logged.
        guard: budgets to settle each exchange's reservation with and count its cost against.
        fsync: ``fsync`` the log at every batch (power-loss durability; costs latency).
    """

    def __init__(
        self,
        catalog: PriceCatalog,
        ledger: Ledger | str,
        flush_interval_s: float = 1.0,
        metrics: Metrics | None = None,
        on_unpriced: Callable[[dict[str, Any]], None] | None = None,
        guard: BudgetGuard | None = None,
        *,
        fsync: bool = False,
    ) -> None:
        self.catalog = catalog
        self.ledger: Ledger = DuckLedger(ledger) if isinstance(ledger, str) else ledger
        self.metrics = metrics or Metrics()
        self.on_unpriced = on_unpriced or _log_unpriced
        self.guard = guard
        self.wal = WriteAheadLog(self.ledger.spool_dir, fsync=fsync)
        self.flush_interval_s = flush_interval_s
        self.unpriced_seen: dict[tuple[str | None, str | None, str], dict[str, Any]] = {}
        """First row and count of each (provider, model, status) recorded without a price this process
        (status ``unpriced``: no price; ``usage_invalid``: the usage the provider reported was invalid)."""
        self._open: dict[str, Exchange] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()  # stop() or FLUSH_ROWS rows waiting: move now
        self.rows_recorded = 0
        self.last_flush: float | None = None
        """``time.time()`` of the last successful move of the log into the ledger."""
        self.flush_error: str | None = None
        """Why the last move failed (``None`` after a success)."""
        self._written_at = time.monotonic()  # the last move that left nothing behind (health)
        self.stale_after_s = max(5 * flush_interval_s, 10.0)
        self._write_problem: str | None = None
        self._logged_rows = 0  # rows appended to the log since the last move that left nothing behind
        self._moving = 0  # of those, the rows a move under way takes
        self.live = LiveFeed(guard.budgets if guard is not None else ())  # what live views read

    # -- the three moments ---------------------------------------------------------------------

    def admit(self, ex: Exchange) -> None:
        """Note that ``ex`` arrived (not awaited: written at the end of this turn of the loop, unless superseded)."""
        self._open[ex.request_id] = ex
        self.wal.admit(ex.request_id, partial(fallback_row, ex, forwarded=False))  # made only if written

    async def forwarding(self, ex: Exchange) -> None:
        """Make ``ex``'s in-flight record durable before it leaves for the upstream (await it)."""
        self._open[ex.request_id] = ex
        try:
            await self.wal.forward(ex.request_id, fallback_row(ex, forwarded=True))
        except OSError:
            pass  # logged by the log's writer; the request goes on (the row stays queued)

    async def commit(self, ex: Exchange, estimate: Callable[[], Usage | None] | None = None) -> None:
        """Price ``ex``, append its rows and wait until they are written (once per exchange).

        Args:
            ex: the ended exchange.
            estimate: when given, computes the usage in a worker thread first (the upstream
                reported none).
        """
        if ex.recorded:
            return
        ex.recorded = True
        if estimate is not None:
            # shielded: a cancelled caller (a client gone, a shutdown) must not cost the row
            await asyncio.shield(self._spawn(ex, estimate))
            return
        await self._append(ex)  # the rows are appended before the first await: never lost to a cancel

    def finish(self, ex: Exchange, estimate: Callable[[], Usage | None] | None = None) -> None:
        """:meth:`commit` without waiting for it (nobody waits for this exchange's reply)."""
        if ex.recorded:
            return
        ex.recorded = True
        self._spawn(ex, estimate)

    def _spawn(self, ex: Exchange, estimate: Callable[[], Usage | None] | None) -> asyncio.Future[None]:
        task = asyncio.ensure_future(self._estimated(ex, estimate))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _estimated(self, ex: Exchange, estimate: Callable[[], Usage | None] | None) -> None:
        if estimate is not None:
            try:
                ex.usage = await asyncio.get_running_loop().run_in_executor(None, estimate)
            except Exception as exc:  # nothing is known of what the provider billed: never a $0 not_billed row
                log.error("token estimate failed for %s: %s", ex.request_id, exc)
                ex.maybe_billed = True
                note = f"the usage could not be estimated: {type(exc).__name__}: {exc}"[:500]
                ex.error = f"{ex.error}; {note}" if ex.error else note
        await self._append(ex)

    async def _append(self, ex: Exchange) -> None:
        data, ids = self._rows(ex)
        self._open.pop(ex.request_id, None)
        try:
            await self.wal.commit(ids, data)
        except OSError:
            pass  # logged by the log's writer; the rows stay queued and are written again

    def _rows(self, ex: Exchange) -> tuple[bytes, list[str]]:
        """Build ``ex``'s rows, settle the books, count them; the encoded lines and the request ids ended."""
        try:
            rows = build_rows(ex, self.catalog)
        except Exception:  # never lose the row over a pricing bug
            log.exception("pricing failed for %s; recording it unpriced", ex.request_id)
            rows = build_rows(ex, PriceCatalog())
        costs = [row["cost_usd"] for row in rows]
        ex.cost_usd = sum(costs, Decimal(0)) if None not in costs else None  # the request and its parts
        lines = []
        for row in rows:
            try:
                lines.append(encode_row(row))
            except (TypeError, ValueError, OverflowError) as exc:  # a value JSON cannot hold
                log.error("row %s cannot be encoded (%s); its raw usage is dropped", row["request_id"], exc)
                row["raw_usage"] = None
                row["violations"] = f"{row.get('violations') or ''}; row not encodable: {exc}".strip("; ")
                lines.append(encode_row(row))
            self._observe(row)
        if self.guard is not None:  # the reservation given back and the rows counted, in one step
            try:
                self.guard.settle(ex.reservation, rows)
            except Exception:
                log.exception("budget books failed for request %s", ex.request_id)
            ex.reservation = None
        self.rows_recorded += len(rows)
        self._logged_rows += len(rows)
        # rows a move under way takes do not count; and no early move while a reader holds the file
        if self._logged_rows - self._moving >= FLUSH_ROWS and self._write_problem is None:
            self._wake.set()
        access_log.record(rows)
        self.live.add(rows)
        return b"".join(lines), [ex.request_id]

    def _observe(self, row: dict[str, Any]) -> None:
        """Metrics and the unpriced-model hook: none of them may stop a row."""
        try:
            self.metrics.observe(row)
        except Exception:
            log.exception("metrics failed for row %s", row["request_id"])
        if row["price_status"] in (PriceStatus.UNPRICED, PriceStatus.USAGE_INVALID):
            key = (row["provider"], row["served_model"] or row["requested_model"], row["price_status"])
            seen = self.unpriced_seen.get(key)
            if seen is not None:
                seen["count"] += 1
                return
            self.unpriced_seen[key] = {"row": row, "count": 1}
            try:
                self.on_unpriced(row)
            except Exception:
                log.exception("unpriced-model hook failed")

    def seed_unpriced(
        self, found: list[tuple[str, tuple[Any, Any, dt.datetime, int, str]]], unflushed: list[dict[str, Any]]
    ) -> None:
        """At start: what earlier runs recorded without a price, so their admin alerts survive a restart.

        ``found``: ``(price status, (provider, model, first seen, count, a request id))`` per model
        in the ledger (``SpendSource.unpriced_models``); ``unflushed``: rows still in the log, counted
        on top. Models this process has seen already keep their figures.
        """
        seeded: dict[tuple[str | None, str | None, str], dict[str, Any]] = {}
        for status, (provider, model, first, count, request_id) in found:
            row = {"request_id": request_id, "started_at": first.timestamp(), "provider": provider}
            seeded[(provider, model, status)] = {"row": row, "count": count}
        for row in unflushed:
            if row.get("price_status") not in (PriceStatus.UNPRICED, PriceStatus.USAGE_INVALID):
                continue
            key = (row.get("provider"), row.get("served_model") or row.get("requested_model"), row["price_status"])
            seen = seeded.setdefault(key, {"row": row, "count": 0})
            seen["count"] += 1
            if row.get("started_at", 0) < seen["row"].get("started_at", 0):
                seen["row"] = row
        for key, seen in seeded.items():
            self.unpriced_seen.setdefault(key, seen)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the log, move what an earlier run left into the ledger, and start the periodic move.

        Raises:
            LedgerError: the ledger cannot be created or opened (a read-only directory, say): the
                proxy must not serve traffic it cannot record.
            OSError: likewise, from the file system.
        """
        await asyncio.to_thread(self._open_check)
        self.wal.open(asyncio.get_running_loop())
        await self.flush(quiet=True)
        self._task = asyncio.create_task(self._run(), name="tokenward-ledger-writer")

    def _open_check(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                self.ledger.migrate()
                return
            except LedgerBusy:
                if time.monotonic() > deadline:
                    return  # held by a reader: rows will wait in the log
                time.sleep(0.1)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        pause = self.flush_interval_s
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._wake.wait(), pause)
            except TimeoutError:
                pass
            self._wake.clear()
            if self._stopping.is_set():
                return  # stop() takes over
            started = loop.time()
            moved = await self.flush(quiet=True)
            took = loop.time() - started  # a move of nothing opens no DuckDB session: ~1 ms
            # never so long apart that /healthz would call the ledger stale
            pause = min(
                max(self.flush_interval_s, took / FLUSH_SHARE - took if moved else 0.0),
                max(self.flush_interval_s, self.stale_after_s / 2),
            )

    async def flush(self, *, quiet: bool = False) -> int:
        """Move the log's closed segments (and what dead writers left) into the ledger; rows moved.

        With ``quiet``, a busy or failing ledger is logged rather than raised (rows wait in the log).

        Raises:
            LedgerError: the ledger cannot be written (not with ``quiet``).
        """
        pending = self._moving = self._logged_rows
        try:
            moved = await asyncio.to_thread(self.ledger.flush, self.wal)
        except LedgerBusy as exc:
            self._moving = 0
            self.flush_error, self._write_problem = str(exc), "ledger_busy"
            log.debug("ledger busy (a reader holds it); rows wait in the log until the next flush")
            if not quiet:
                raise
            return 0
        except (LedgerError, OSError) as exc:
            self._moving = 0
            hung = type(exc).__name__ == "MoverHung"  # the mover's module loads only with a DuckDB ledger
            if hung:
                log.error("%s; rows wait in %s", exc, self.ledger.spool_dir)
            elif self.flush_error is None:
                log.exception("cannot write the ledger; rows wait in %s", self.ledger.spool_dir)
            self.flush_error, self._write_problem = str(exc), "mover_hung" if hung else "ledger_error"
            if not quiet:
                raise
            return 0
        self._moving = 0
        if self.flush_error is not None and self._write_problem in ("ledger_error", "mover_hung"):
            # only after a failure that was logged: a reader holding the file (busy) is routine
            log.warning("ledger rows are being written again")
        self.flush_error = None
        self.last_flush = time.time()
        if self.wal.failing is None:
            self._written_at, self._write_problem = time.monotonic(), None
            self._logged_rows -= pending
        else:
            self._write_problem = "log_write_failed"
        return moved

    def open_exchanges(self) -> list[Exchange]:
        """Exchanges admitted and not yet recorded."""
        return list(self._open.values())

    def health(self) -> dict[str, Any]:
        """The ledger writer's state, for ``/healthz`` (lists the log directory; no ledger access).

        Returns:
            ``writable``: the write-ahead log is writable and a move into the ledger left nothing
            behind within :attr:`stale_after_s` seconds (five flush intervals, at least 10 s: a
            report briefly holding the file is no failure); ``last_write_age_s``: seconds since
            then; ``problem``: why the last try failed (``ledger_busy``, ``ledger_error``,
            ``log_write_failed``) or ``None``; ``queued_rows``: rows waiting for the log's writer
            (a full disk); ``in_flight``: requests admitted and not yet ended;
            ``spool_files``/``spool_rows``: log segments waiting for the ledger (this process's
            and dead writers') and the rows this process appended to them; ``mover`` (a DuckDB
            ledger): ``restarts``, the children that died or hung in a call and were replaced,
            the last such ``incident`` with its ``incident_age_s`` (``None`` before any), and
            ``silent_s``, how long the child working on a move has not been heard from (``problem``
            is ``mover_not_answering`` past :data:`MOVER_SILENT_S`; it is killed at 5 s, and
            ``mover_hung`` then stays until a new child has moved the rows).
        """
        age = time.monotonic() - self._written_at
        failing = self.wal.failing is not None
        return {
            "writable": age <= self.stale_after_s and not failing,
            "last_write_age_s": round(age, 3),
            "stale_after_s": self.stale_after_s,
            "problem": "log_write_failed" if failing else self._mover_silent() or self._write_problem,
            "queued_rows": self.wal.queued,
            "in_flight": self.wal.in_flight,
            "spool_files": self.ledger.waiting_segments(self.wal),
            "spool_rows": self._logged_rows,
            **self._mover_health(),
        }

    def _mover_silent(self) -> str | None:
        mover = getattr(self.ledger, "mover", None)
        silent = mover.silent_s if mover is not None else None
        return "mover_not_answering" if silent is not None and silent > MOVER_SILENT_S else None

    def _mover_health(self) -> dict[str, Any]:
        mover = getattr(self.ledger, "mover", None)
        if mover is None:
            return {}
        last = mover.incidents[-1] if mover.incidents else None
        return {
            "mover": {
                "restarts": mover.restarts,
                "silent_s": None if mover.silent_s is None else round(mover.silent_s, 1),
                "incident": last[1] if last else None,
                "incident_age_s": round(time.time() - last[0], 1) if last else None,
            }
        }

    async def stop(self, wait_busy_s: float = 5.0) -> None:
        """Record what is still open (``interrupted``), then move everything into the ledger.

        A busy ledger is retried for ``wait_busy_s`` seconds; rows that still cannot go in stay in
        the log, and the next start moves them.
        """
        self._stopping.set()
        self._wake.set()
        if self._task is not None:
            await self._task
        for ex in list(self._open.values()):
            if not ex.recorded:
                ex.end(Outcome.INTERRUPTED, error="tokenward shut down while the request was in flight")
                ex.maybe_billed = ex.maybe_billed or ex.upstream is not None
                self.finish(ex)
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        deadline = asyncio.get_running_loop().time() + wait_busy_s
        while True:
            try:
                await self.flush()
                break
            except LedgerBusy:
                if asyncio.get_running_loop().time() >= deadline:
                    log.warning("ledger still busy at shutdown; rows stay in %s", self.ledger.spool_dir)
                    break
                await asyncio.sleep(0.1)
            except (LedgerError, OSError):
                break
        await asyncio.to_thread(self.wal.close)
        if self.flush_error is None:
            await self.flush(quiet=True)  # what was appended after the last rotation
