"""Alerts across a restart: a crossing the proxy had no time to mail before it stopped still goes out, once."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from decimal import Decimal

from tokenward.pricing.budgets import Budget
from tokenward.proxy.guard import BooksSpend, BudgetGuard, BudgetRefusal
from tokenward.reports.alerts import Notifier
from tokenward.reports.budget_check import evaluate_and_notify
from tokenward.reports.ledger import DuckLedger, WriteAheadLog
from tokenward.reports.ledger.spend import DuckSpend
from tokenward.reports.ledger.wal import encode_row

from .test_alert_timing import DST_DAY
from .test_alerts import cost_row, seed, settings_for, smtp  # noqa: F401 - smtp: the fixture


def _restarted_books(ledger: DuckLedger, now: dt.datetime, budget: Budget = DST_DAY) -> BudgetGuard:
    """The books a proxy started at ``now`` opens: the ledger plus what its log still holds (as ``load_books``)."""
    guard = BudgetGuard([budget], now)
    unflushed = ledger.unflushed_rows(None)
    ledger.session(lambda conn: guard.load(DuckSpend(conn), now, unflushed), read_only=True)
    return guard


def _check(ledger: DuckLedger, guard: BudgetGuard, now: dt.datetime, port: int, budget: Budget = DST_DAY):
    settings = settings_for(port)
    return asyncio.run(
        evaluate_and_notify(BooksSpend(guard, now, {}), ledger.state, [budget], settings, Notifier(settings), now)
    )


def _killed_writer(ledger: DuckLedger, row: dict, in_flight: dict | None) -> None:
    """A proxy's log as SIGKILL leaves it: one finished row not yet moved, one request at the upstream."""

    async def write() -> None:
        wal = WriteAheadLog(ledger.spool_dir)
        wal.open(asyncio.get_running_loop())
        if in_flight is not None:
            await wal.forward(in_flight["request_id"], in_flight)
        await wal.commit([row["request_id"]], encode_row(row))
        wal.close()  # its lock released, as the kernel does for a killed process; its files stay

    asyncio.run(write())


def test_a_crossing_just_before_midnight_is_mailed_by_the_proxy_restarted_after_it(tmp_path, smtp):  # noqa: F811
    """The proxy was killed between crossings at 23:59:50 and their check; it is back at 00:00:20.

    The 25-hour day of 2026-10-25 in Paris (limit $10): $4 at 01:30 in the ledger; $3 at 23:59:50
    still in the log; a request of 23:59:55 at the upstream at the kill, holding $4 (its
    ``usage_unknown`` row counts that). $11, 110 %: 50, 80 and 100 % crossed in the day that just
    ended. The restarted proxy's books must know that day (its first hour is when the ended day's
    crossings are looked for), or the three thresholds are never mailed.
    """
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("a", "2026-10-25T01:30:00+02:00", "4.00")])
    ledger = DuckLedger(path)
    late = cost_row("b", "2026-10-25T23:59:50+01:00", "3.00")
    at_upstream = {
        "request_id": "c",
        "started_at": dt.datetime.fromisoformat("2026-10-25T23:59:55+01:00").timestamp(),
        "principal": "agent",
        "method": "POST",
        "path": "/v1/chat/completions",
        "endpoint": "chat_completions",
        "team": "research",
        "outcome": "interrupted",
        "price_status": "usage_unknown",
        "reserved_usd": Decimal("4.00"),
        "requested_model": "gpt-4o",
    }
    _killed_writer(ledger, late, at_upstream)
    after = dt.datetime.fromisoformat("2026-10-26T00:00:20+01:00")
    guard = _restarted_books(ledger, after)
    sent = _check(ledger, guard, after, port)
    assert [(a.kind, a.thresholds, Decimal(a.payload["spent_usd"])) for a, _ in sent] == [
        ("threshold", (50, 80, 100), Decimal("11"))
    ]
    (mail,) = inbox.wait_for(1)
    assert mail["Subject"] == (
        "[tokenward] budget daily: 110.00% of $10.00 (crossed 50%, 80%, 100% before the reset at "
        "2026-10-26T00:00:00+01:00)"
    )
    # the new day's books start at 0
    assert guard.tightest({"team": "research"}, after) == (DST_DAY, Decimal(10))
    # the log moved in, a second restart a minute later: claimed already, nothing is mailed twice
    assert ledger.flush() == 2
    later = after + dt.timedelta(minutes=1)
    assert _check(ledger, _restarted_books(ledger, later), later, port) == []


CAP = dataclasses.replace(DST_DAY, name="cap", action="block")


def test_a_refusal_still_in_the_log_at_a_restart_is_mailed_as_refusing(tmp_path, smtp):  # noqa: F811
    """Killed right after refusing a request, restarted while a reader held the file (the log not moved in).

    The refusal's row is only in the log: the restarted books must count it, or the ``refusing``
    alert (the budget's recipients hear that requests are being refused) is never sent.
    """
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    now = dt.datetime.fromisoformat("2026-10-25T12:00:00+01:00")
    seed(path, [cost_row("a", "2026-10-25T09:00:00+01:00", "9.999")])  # 99.99 %: 50, 80 % crossed
    refusal = BudgetRefusal(CAP, Decimal("0.001"), Decimal("0.02"), now + dt.timedelta(hours=13))
    refused = cost_row("r", "2026-10-25T11:59:00+01:00", "0", outcome="rejected", http_status=429, error=str(refusal))
    ledger = DuckLedger(path)
    _killed_writer(ledger, refused, None)
    guard = _restarted_books(ledger, now, CAP)
    sent = _check(ledger, guard, now, port, CAP)
    # $9.999 by noon: 50 and 80 % crossed, and on course past $10 (the forecast), besides the refusal
    assert sorted((a.kind, a.thresholds) for a, _ in sent) == [
        ("forecast", (0,)),
        ("refusing", (0,)),
        ("threshold", (50, 80)),
    ]
    assert len(inbox.wait_for(3)) == 3
