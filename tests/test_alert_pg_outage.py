"""Alert deliveries while the Postgres state store goes away and comes back (a real Postgres, stopped).

Replica A claims the 50 % threshold of a $100 budget at $55 and mails it; the mail server
accepts the mail just as Postgres stops, so the delivery cannot be recorded, nor the lease
renewed. Replica B evaluates as soon as Postgres is back. The mail went out once: it must be
recorded once Postgres is back (not forgotten, which mailed it again once the lease ran out),
and B, evaluating meanwhile, must leave it alone. Exactly one mail, the claim ``sent``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import uuid

import psycopg
from aiosmtpd.controller import Controller

from tokenward.pricing.settings import BudgetSettings
from tokenward.reports.alerts import Notifier
from tokenward.reports.budget_check import evaluate_and_notify
from tokenward.reports.ledger import open_ledger
from tokenward.reports.ledger.spend import DuckSpend

from .test_alerts import Inbox, cost_row, free_port, seed, settings_for
from .test_pg_ledger import pg

BUDGET = BudgetSettings(name="team", limit_usd=100, period="total", thresholds=[50], notify=["lead@example.com"])
AT = dt.datetime(2026, 11, 10, 10, tzinfo=dt.UTC)


class HaltingInbox(Inbox):
    """Keeps the first mail, stops Postgres, then answers 250: delivered while the state store is away."""

    def __init__(self, cluster) -> None:
        super().__init__()
        self.cluster = cluster
        self.halted = threading.Event()

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's hook name
        reply = await super().handle_DATA(server, session, envelope)
        if not self.halted.is_set():
            await asyncio.get_running_loop().run_in_executor(None, self.cluster.halt)
            self.halted.set()
        return reply


class Noticed(logging.Handler):
    """Sets ``event`` when a log record's message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.event = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


def _check(url: str, tmp_path, spend_path, port: int) -> list:
    ledger = pg(tmp_path, url)
    conn = open_ledger(spend_path, read_only=True)
    try:
        settings = settings_for(port)
        budget = BUDGET.to_budget()
        return asyncio.run(
            evaluate_and_notify(DuckSpend(conn), ledger.state, [budget], settings, Notifier(settings), AT)
        )
    finally:
        conn.close()


def test_a_delivery_made_while_postgres_is_down_is_recorded_when_it_is_back_and_mailed_once(tmp_path, pg_cluster):
    url = pg_cluster.create_database(f"t_{uuid.uuid4().hex[:12]}")
    with psycopg.connect(url, autocommit=True) as conn:  # as in production: a commit survives the server's stop
        conn.execute(f"ALTER DATABASE {url.rsplit('/', 1)[1]} SET synchronous_commit = on")
    spend_path = tmp_path / "spend.duckdb"
    seed(spend_path, [cost_row("a", "2026-11-10T09:00:00+00:00", "55.00")])  # 55 %: the 50 % threshold
    inbox = HaltingInbox(pg_cluster)
    server = Controller(inbox, hostname="127.0.0.1", port=free_port())
    server.start()
    watcher = Noticed("cannot record")
    logging.getLogger("tokenward").addHandler(watcher)
    other: dict[str, object] = {}

    def back_then_b() -> None:  # once A has failed to record: Postgres back, and replica B evaluates at once
        watcher.event.wait(60)
        if inbox.halted.is_set():
            pg_cluster.resume()
            other["resumed"] = True
            other["b"] = _check(url, tmp_path / "b", spend_path, server.port)

    b_thread = threading.Thread(target=back_then_b, daemon=True)
    b_thread.start()
    try:
        sent = _check(url, tmp_path / "a", spend_path, server.port)
        b_thread.join(60)
        assert inbox.halted.is_set() and watcher.event.is_set()
        assert [(a.kind, a.thresholds, [(d.target, d.ok) for d in ds]) for a, ds in sent] == [
            ("threshold", (50,), [("lead@example.com", True)])
        ]
        assert other["b"] == []  # B left A's claim alone: leased to A, then sent
        state = pg(tmp_path / "c", url).state
        assert [(c.key.threshold, c.status) for c in state.claims(kind="threshold")] == [(50, "sent")]
        # a third evaluation later (a restart, another replica): nothing is mailed again
        assert _check(url, tmp_path / "d", spend_path, server.port) == []
        assert [m["Subject"] for m in inbox.messages] == ["[tokenward] budget team: 55.00% of $100.00 (crossed 50%)"]
    finally:
        logging.getLogger("tokenward").removeHandler(watcher)
        watcher.event.set()  # the helper thread waits no longer
        b_thread.join(60)
        if inbox.halted.is_set() and not other.get("resumed"):
            pg_cluster.resume()  # leave the session's cluster running for the tests after this one
        server.stop()
