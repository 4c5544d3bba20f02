"""The budget books a DuckDB proxy opens at start count each row once, whatever moves the log meanwhile.

``load_books`` reads the rows still in the write-ahead log, then the ledger. The recorder's
periodic move is already running by then (and a reader may have kept the start's own move
from happening), so a move can land between the two reads: the rows it moved are then in the
ledger and in what was read from the log. :class:`MovingLedger` makes that interleaving
certain: its move runs right after the log was read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import os
import signal
from decimal import Decimal

import pytest

from tokenward.pricing.budgets import Period
from tokenward.proxy.guard import BudgetGuard
from tokenward.proxy.startup import load_books
from tokenward.reports.ledger import DuckLedger, WriteAheadLog
from tokenward.reports.ledger.wal import encode_row

from .test_alert_restart import _killed_writer
from .test_alert_timing import DST_DAY
from .test_alerts import cost_row, seed

# $10 in total (load_books opens the books at the current time: no period boundary to fall on), team research
CAP = dataclasses.replace(DST_DAY, name="cap", action="block", period=Period("total"))
NOW = dt.datetime.now(dt.UTC)


class MovingLedger(DuckLedger):
    """A DuckDB ledger whose log is moved into the file just after someone read what it holds."""

    moved = 0

    def unflushed_rows(self, wal=None):
        rows = super().unflushed_rows(wal)
        self.moved += self.flush(wal)  # the recorder's move, landing between the two reads
        return rows


def _at_upstream(request_id: str, reserved: str) -> dict:
    """A request that was at the upstream when its proxy died: its row counts what it held."""
    return {
        "request_id": request_id,
        "started_at": dt.datetime.fromisoformat("2026-10-25T11:00:00+01:00").timestamp(),
        "principal": "agent",
        "method": "POST",
        "path": "/v1/chat/completions",
        "endpoint": "chat_completions",
        "team": "research",
        "outcome": "interrupted",
        "price_status": "usage_unknown",
        "reserved_usd": Decimal(reserved),
        "requested_model": "gpt-4o",
    }


def test_a_move_between_reading_the_log_and_the_ledger_counts_a_dead_writers_rows_once(tmp_path):
    """$4 in the ledger; a killed proxy's log holds a $3 row and a request at the upstream holding $2.

    Spent: 4 + 3 + 2 = $9 of $10, $1 left. Before, the move after the log was read put the $3 and
    the $2 in the ledger too: the books said $14 spent (0 left), refusing everything all day.
    """
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("a", "2026-10-25T09:00:00+01:00", "4.00")])
    ledger = MovingLedger(path)
    _killed_writer(ledger, cost_row("b", "2026-10-25T10:00:00+01:00", "3.00"), _at_upstream("c", "2.00"))
    guard = BudgetGuard([CAP], NOW)
    load_books(ledger, guard, None)
    assert ledger.moved == 2  # b, and c's usage_unknown row: the move did run in between
    assert guard.tightest({"team": "research"}, NOW) == (CAP, Decimal("1.00"))


def test_a_move_between_reading_the_log_and_the_ledger_counts_the_own_logs_rows_once(tmp_path):
    """The proxy's own closed log segment ($3 and $2.50) is moved between the reads: $4 + $5.50 = $9.50, $0.50 left."""
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("a", "2026-10-25T09:00:00+01:00", "4.00")])
    ledger = MovingLedger(path)
    rows = [cost_row("b", "2026-10-25T10:00:00+01:00", "3.00"), cost_row("d", "2026-10-25T10:30:00+01:00", "2.50")]

    async def logged() -> WriteAheadLog:
        wal = WriteAheadLog(ledger.spool_dir)
        wal.open(asyncio.get_running_loop())
        await wal.commit([r["request_id"] for r in rows], b"".join(encode_row(r) for r in rows))
        wal.rotate()
        return wal

    wal = asyncio.run(logged())
    try:
        guard = BudgetGuard([CAP], NOW)
        load_books(ledger, guard, wal)
        assert ledger.moved == 2
        assert guard.tightest({"team": "research"}, NOW) == (CAP, Decimal("0.50"))
    finally:
        wal.close()


@pytest.mark.parametrize("moving", [False, True])
def test_the_books_are_the_same_whether_or_not_the_move_ran_in_between(tmp_path, moving):
    """Threshold state follows the one count: $9 of $10 is 90 %, so 50 and 80 % are crossed, 100 % is not."""
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("a", "2026-10-25T09:00:00+01:00", "4.00")])
    ledger = (MovingLedger if moving else DuckLedger)(path)
    _killed_writer(ledger, cost_row("b", "2026-10-25T10:00:00+01:00", "3.00"), _at_upstream("c", "2.00"))
    guard = BudgetGuard([CAP], NOW)
    load_books(ledger, guard, None)
    (standing,) = guard.standing({"team": "research"}, NOW)
    assert Decimal(standing["spent_usd"]) == Decimal("9.00")


def test_a_move_between_the_reads_counts_unpriced_rows_once_for_the_admins_alert(tmp_path):
    """One row of an unpriced model in the ledger, two in a killed proxy's log: the alert says 3 requests, not 5."""
    from tokenward.proxy.recorder import Recorder
    from tokenward.proxy.startup import load_unpriced

    from .test_ledger import make_row

    def unpriced(request_id: str) -> dict:
        started = dt.datetime.fromisoformat("2026-10-25T10:00:00+01:00").timestamp()
        return make_row(
            request_id,
            started_at=started,
            ended_at=started + 1,
            provider="openai",
            served_model="mystery-1",
            price_status="unpriced",
            cost_usd=None,
        )

    path = tmp_path / "l.duckdb"
    seed(path, [unpriced("u1")])
    ledger = MovingLedger(path)
    _killed_writer(ledger, unpriced("u2"), None)
    _killed_writer(ledger, unpriced("u3"), None)
    recorder = Recorder(None, ledger)  # type: ignore[arg-type] - no pricing needed to seed what was seen
    load_unpriced(ledger, recorder)
    assert ledger.moved == 2
    assert {key: seen["count"] for key, seen in recorder.unpriced_seen.items()} == {
        ("openai", "mystery-1", "unpriced"): 3
    }


class KilledMoverLedger(MovingLedger):
    """:class:`MovingLedger` reading through its mover child, which is killed (SIGKILL) as the books are read."""

    kills = reads = 0

    def read_spend(self, work):
        self.reads += 1  # the first read asks which dead writer's rows are in the file; the second opens the books

        def killed_first(spend):
            if self.reads == 2 and not self.kills and self.mover is not None and self.mover.pid:
                self.kills += 1
                pid = self.mover.pid
                os.kill(pid, signal.SIGKILL)
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead (reaped by the mover's next call)
            return work(spend)

        return super().read_spend(killed_first)


@pytest.mark.parametrize("killed", [False, True])
def test_the_books_read_through_the_mover_child_are_the_same(tmp_path, killed, caplog):
    """The first test's $4 + $3 + $2 of $10 read by the mover child ($1 left), and again after the child is killed mid-read."""
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("a", "2026-10-25T09:00:00+01:00", "4.00")])
    ledger = (KilledMoverLedger if killed else MovingLedger)(path)
    ledger.use_mover()
    _killed_writer(ledger, cost_row("b", "2026-10-25T10:00:00+01:00", "3.00"), _at_upstream("c", "2.00"))
    guard = BudgetGuard([CAP], NOW)
    load_books(ledger, guard, None)
    ledger.close()
    assert ledger.moved == 2
    assert guard.tightest({"team": "research"}, NOW) == (CAP, Decimal("1.00"))
    if killed:
        assert ledger.kills == 1
        assert "the ledger's mover process ended" in caplog.text  # logged, then read again by a new child
