"""Velocity alerts: the spend rate of the last minutes against an absolute rate and the trailing baseline.

One alert per episode, re-armed once the rate is back under the rule, through the same claims
(exactly once across restarts and processes) and real SMTP (aiosmtpd).
"""

from __future__ import annotations

import datetime as dt
import time
from decimal import Decimal

import pytest

from tokenward.pricing.settings import BudgetSettings, VelocitySettings
from tokenward.pricing.velocity import Velocity, velocity_status, velocity_windows
from tokenward.proxy.velocity_books import VelocityBooks
from tokenward.reports.ledger import DuckLedger, open_ledger
from tokenward.reports.ledger.spend import DuckSpend

from .agentkit import post, prompt, record, serving
from .test_alerts import cost_row, run_check, seed, settings_for, smtp  # noqa: F401 - smtp is a fixture

UTC = dt.UTC
D = Decimal


def test_the_rules_compare_exactly():
    absolute = Velocity(window_minutes=15, max_usd_per_hour=D(10))
    assert not velocity_status(absolute, D("2.50"), D(0)).firing  # $2.50 in 15 min is $10/h: not above
    over = velocity_status(absolute, D("2.51"), D(0))
    assert over.firing and over.over_max and over.rate == D("10.04")
    relative = Velocity(window_minutes=15, baseline_factor=D(3), baseline_hours=D(24), min_usd_per_hour=D(2))
    # baseline $24 in 24 h = $1/h; 3x that is $3/h = $0.75 per 15 min
    assert not velocity_status(relative, D("0.75"), D(24)).firing
    assert velocity_status(relative, D("0.76"), D(24)).over_baseline
    # below min_usd_per_hour ($2/h = $0.50 per 15 min) the relative rule stays quiet however quiet the past
    assert not velocity_status(relative, D("0.49"), D(0)).firing and velocity_status(relative, D("0.5"), D(0)).firing
    assert velocity_windows(relative, dt.datetime(2026, 11, 12, 10, 0, 30, tzinfo=UTC)) == (
        dt.datetime(2026, 11, 12, 9, 46, tzinfo=UTC),
        dt.datetime(2026, 11, 11, 9, 46, tzinfo=UTC),
    )
    for bad in ({}, {"window_minutes": 0, "max_usd_per_hour": D(1)}, {"baseline_factor": D(1)}):
        with pytest.raises(ValueError):
            Velocity(**bad)


BURN = BudgetSettings(
    name="agents",
    limit_usd=100,
    scope={"team": "research"},
    period="month",
    notify=["lead@example.com"],
    velocity=VelocitySettings(window_minutes=10, max_usd_per_hour=6, baseline_factor=4, baseline_hours=2),
).to_budget()


def test_one_alert_per_episode_re_armed_when_the_rate_falls_back(tmp_path, smtp):  # noqa: F811
    inbox, port = smtp
    settings = settings_for(port)
    db = tmp_path / "l.duckdb"
    # baseline: $0.40 at 08:30 ($0.20/h over 2 h); burst: $0.50 at 09:55, $3/h over 10 min: 15x the baseline
    seed(
        db, [cost_row("base", "2026-11-12T08:30:00+00:00", "0.40"), cost_row("b1", "2026-11-12T09:55:00+00:00", "0.50")]
    )
    sent = run_check(db, [BURN], settings, "2026-11-12T10:00:30+00:00")
    assert [(a.kind, a.payload["rate_usd_per_hour"]) for a, _ in sent] == [("velocity", "3.000000")]
    (mail,) = inbox.wait_for(1)
    assert mail["Subject"] == (
        "[tokenward] budget agents: spending $3/h over the last 10 min (15.0x the 2 h baseline of $0.2/h)"
    )
    assert "Rule: at most: $6.00/h" in mail.get_body(("plain",)).get_content()
    # still in the window at 10:03 (window from 09:54): the same episode, nothing new
    assert run_check(db, [BURN], settings, "2026-11-12T10:03:00+00:00") == []
    # 10:06: the window starts at 09:57, nothing in it: the episode ends (re-armed, nothing sent)
    assert run_check(db, [BURN], settings, "2026-11-12T10:06:00+00:00") == []
    # a second burst: $1.20 at 10:08 is $7.2/h, over $6/h and 16x the baseline ($0.90 in 08:00-10:00)
    seed(db, [cost_row("b2", "2026-11-12T10:08:00+00:00", "1.20")])
    sent = run_check(db, [BURN], settings, "2026-11-12T10:09:00+00:00")
    assert [a.kind for a, _ in sent] == ["velocity"]
    assert inbox.wait_for(2)[1]["Subject"] == (
        "[tokenward] budget agents: spending $7.2/h over the last 10 min (over $6/h; 16.0x the 2 h baseline of $0.45/h)"
    )
    # another process (a fresh state store on the same file) evaluating a moment later sends nothing
    assert run_check(db, [BURN], settings, "2026-11-12T10:09:30+00:00") == []
    claims = DuckLedger(db).state.claims()
    assert [(c.key.kind, c.key.period_start.timestamp(), c.status) for c in claims] == [
        ("velocity", 0.0, "sent"),
        ("velocity_end", 0.0, "sent"),
        ("velocity", 1.0, "sent"),
    ]
    assert len(inbox.wait_for(3, timeout=1.0)) == 2


def test_the_proxys_minute_books_read_what_the_ledger_query_reads(tmp_path):
    db = tmp_path / "l.duckdb"
    rows = [
        cost_row(f"r{i}", f"2026-11-12T09:{m:02d}:{s:02d}+00:00", cost)
        for i, (m, s, cost) in enumerate(
            [(0, 0, "0.10"), (0, 59, "0.20"), (9, 30, "0.05"), (30, 1, "0.40"), (59, 59, "1")]
        )
    ]
    other = cost_row("other-team", "2026-11-12T09:30:00+00:00", "9")
    rows.append({**other, "team": "ops"})
    seed(db, rows[:3])
    books = VelocityBooks([BURN, BudgetSettings(name="plain", limit_usd=1).to_budget()])
    conn = open_ledger(db, read_only=True)
    try:
        books.load(DuckSpend(conn), dt.datetime(2026, 11, 12, 10, 0, tzinfo=UTC), unflushed=rows[3:])
    finally:
        conn.close()
    seed(db, rows[3:])
    snapshot = books.snapshot(dt.datetime(2026, 11, 12, 10, 0, tzinfo=UTC))
    conn = open_ledger(db, read_only=True)
    try:
        ledger = DuckSpend(conn)
        for start, end, expected in (
            ("09:00", "10:00", "1.75"),
            ("09:01", "10:00", "1.45"),
            ("09:00", "09:01", "0.30"),
            ("09:10", "09:59", "0.40"),
            ("09:59", "10:00", "1"),
        ):
            window = (
                dt.datetime.fromisoformat(f"2026-11-12T{start}:00+00:00"),
                dt.datetime.fromisoformat(f"2026-11-12T{end}:00+00:00"),
            )
            assert snapshot.spend_in(BURN, *window) == ledger.spend_in(BURN, *window) == D(expected)
    finally:
        conn.close()
    with pytest.raises(LookupError):
        snapshot.spend_in(BudgetSettings(name="plain", limit_usd=1).to_budget(), *window)


def test_the_proxy_alerts_once_from_its_books_and_after_a_restart(tmp_path, simulator, smtp, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SIM_UPSTREAM_KEY", "sk-upstream")
    inbox, port = smtp
    record(simulator, "velocity", 1007, 1000)  # $0.0125175
    # 2-minute window: $0.0125175 in it is $0.375525/h, over $0.30/h
    rule = VelocitySettings(window_minutes=2, max_usd_per_hour="0.30")
    budget = BudgetSettings(name="burn", limit_usd=100, period="month", notify=["lead@example.com"], velocity=rule)
    alerts = settings_for(port, evaluate_every_s=1)
    ledger = tmp_path / "l.duckdb"
    with serving(ledger, simulator, budgets=[budget], alerts=alerts) as proxy:
        assert post(proxy.url, prompt(1000, 1000), "velocity").status_code == 200
        (mail,) = inbox.wait_for(1)
        assert mail["Subject"] == "[tokenward] budget burn: spending $0.375525/h over the last 2 min (over $0.3/h)"
        time.sleep(2.5)  # two more checks: the same episode
        proxy.rows(1)
    # a restart reads the minute books back from the ledger: still the same episode, still no second mail
    with serving(ledger, simulator, budgets=[budget], alerts=alerts) as proxy:
        books = proxy.app.state.velocity
        assert books.snapshot(dt.datetime.now(UTC)).spend_in(
            budget.to_budget(), dt.datetime.now(UTC) - dt.timedelta(minutes=5), dt.datetime.now(UTC)
        ) == D("0.0125175")
        time.sleep(2.5)
    assert len(inbox.wait_for(2, timeout=0.5)) == 1
