"""Alerts on time: before the money runs out, once, over a real SMTP server (aiosmtpd)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from decimal import Decimal

from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.guard import BooksSpend, BudgetGuard
from tokenward.reports.alerts import Notifier
from tokenward.reports.budget_check import evaluate_and_notify
from tokenward.reports.ledger import DuckLedger

from .test_alerts import cost_row, run_check, seed, settings_for, smtp  # noqa: F401 - smtp: the fixture

PARIS_NOVEMBER = dt.datetime.fromisoformat("2026-11-01T00:00:00+01:00")  # a 30-day month: 720 hours


def test_a_steady_agent_that_would_run_out_on_day_3_hears_of_it_on_day_2_once(tmp_path, smtp):  # noqa: F811
    """$2 an hour, around the clock, against $100 a month: the limit is reached after 50 hours.

    A tenth of the month is 72 hours, so a forecast that waits for it comes after the money ran
    out. With thresholds [100] only, the forecast is the one warning before the limit.
    """
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    budget = BudgetSettings(
        name="agent-monthly",
        limit_usd=100,
        scope={"team": "research"},
        period="month",
        timezone="Europe/Paris",
        thresholds=[100],
        notify=["lead@example.com"],
    ).to_budget()
    step = dt.timedelta(hours=1)
    seed(path, [
        cost_row(f"r{k}", (PARIS_NOVEMBER + k * step + step / 2).isoformat(), "2.00") for k in range(60)
    ])
    sent = []
    for hour in range(1, 61):  # the proxy evaluates every minute; every hour is enough here
        now = PARIS_NOVEMBER + hour * step
        sent += [(hour, alert.kind, deliveries[0].ok) for alert, deliveries in run_check(
            path, [budget], settings_for(port), now.isoformat()
        )]
    # hour 25: $50 spent in 25 h, $1,440 projected for the month; the limit is reached at hour 50
    assert sent == [(25, "forecast", True), (50, "threshold", True)]
    forecast, limit = inbox.wait_for(2)
    assert forecast["Subject"] == (
        "[tokenward] budget agent-monthly: 50.00% of $100.00 "
        "(projected to reach $1,440.00 by 2026-12-01T00:00:00+01:00)"
    )
    text = forecast.get_body(("plain",)).get_content()
    assert "Limit reached at this rate: 2026-11-03T02:00:00+01:00" in text  # 25 h later, as it happened
    assert limit["Subject"] == "[tokenward] budget agent-monthly: 100.00% of $100.00 (crossed 100%)"


# Europe/Paris leaves summer time on 2026-10-25: that day has 25 hours (22:00 UTC to 23:00 UTC next day)
DST_DAY = BudgetSettings(
    name="daily",
    limit_usd=10,
    scope={"team": "research"},
    period="day",
    timezone="Europe/Paris",
    notify=["lead@example.com"],
).to_budget()


def test_a_threshold_crossed_in_the_last_seconds_of_a_25_hour_day_is_mailed_after_midnight(tmp_path, smtp):  # noqa: F811
    """The check after the crossing runs in the new day: the ended day's crossing must still go out, once."""
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("a", "2026-10-25T01:30:00+02:00", "4.00")])  # summer time, 24.5 h before midnight
    assert run_check(path, [DST_DAY], settings_for(port), "2026-10-25T23:59:00+01:00") == []  # 40 %
    seed(path, [cost_row("b", "2026-10-25T23:59:30+01:00", "7.00")])  # 110 % of the 25-hour day
    sent = run_check(path, [DST_DAY], settings_for(port), "2026-10-26T00:00:20+01:00")
    assert [(a.kind, a.thresholds, a.period_start.isoformat()) for a, _ in sent] == [
        ("threshold", (50, 80, 100), "2026-10-24T22:00:00+00:00")
    ]
    assert run_check(path, [DST_DAY], settings_for(port), "2026-10-26T00:01:20+01:00") == []
    # the new day starts at 0: its own 50 % is mailed for it (and, at $6 in 31 minutes, its forecast)
    seed(path, [cost_row("c", "2026-10-26T00:30:00+01:00", "6.00")])
    again = run_check(path, [DST_DAY], settings_for(port), "2026-10-26T00:31:00+01:00")
    assert [(a.kind, a.thresholds, a.period_start.isoformat()) for a, _ in again] == [
        ("threshold", (50,), "2026-10-25T23:00:00+00:00"),
        ("forecast", (0,), "2026-10-25T23:00:00+00:00"),
    ]
    ended, *later = inbox.wait_for(3)  # the new day's two alerts go out together, in either order
    (new,) = [m for m in later if "crossed" in m["Subject"]]
    assert ended["Subject"] == (
        "[tokenward] budget daily: 110.00% of $10.00 (crossed 50%, 80%, 100% before the reset at "
        "2026-10-26T00:00:00+01:00)"
    )
    assert new["Subject"] == "[tokenward] budget daily: 60.00% of $10.00 (crossed 50%)"


def test_the_proxys_books_still_know_the_day_that_just_ended(tmp_path, smtp):  # noqa: F811
    """The proxy's own checks read its books: a request of the ended day settled after midnight counts there."""
    inbox, port = smtp
    before = dt.datetime.fromisoformat("2026-10-25T23:59:00+01:00")
    guard = BudgetGuard([DST_DAY], before)
    guard.observe(cost_row("a", "2026-10-25T01:30:00+02:00", "4.00"))
    # started at 23:59:50, still streaming at midnight: it belongs to the 25-hour day
    after = dt.datetime.fromisoformat("2026-10-26T00:00:20+01:00")
    guard.observe(cost_row("b", "2026-10-25T23:59:50+01:00", "7.00"))
    state = DuckLedger(tmp_path / "l.duckdb").state
    sent = asyncio.run(
        evaluate_and_notify(BooksSpend(guard, after, {}), state, [DST_DAY], settings_for(port), Notifier(
            settings_for(port)
        ), after)
    )
    assert [(a.kind, a.thresholds, a.payload["spent_usd"]) for a, _ in sent] == [
        ("threshold", (50, 80, 100), "11")
    ]
    (mail,) = inbox.wait_for(1)
    assert "before the reset at 2026-10-26T00:00:00+01:00" in mail["Subject"]


def test_a_limit_raised_after_its_50_percent_mail_mails_50_percent_of_the_new_limit(tmp_path, smtp):  # noqa: F811
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    budget = BudgetSettings(
        name="team", limit_usd=100, scope={"team": "research"}, period="total", notify=["lead@example.com"]
    ).to_budget()
    seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "55.00")])
    assert [a.thresholds for a, _ in run_check(path, [budget], settings_for(port), "2026-11-10T10:00:00+00:00")] == [
        (50,)
    ]
    raised = dataclasses.replace(budget, limit_usd=Decimal(200))  # the config edited, the proxy restarted
    assert run_check(path, [raised], settings_for(port), "2026-11-10T11:00:00+00:00") == []  # 27.5 % of $200
    seed(path, [cost_row("b", "2026-11-10T12:00:00+00:00", "50.00")])  # $105: 52.5 % of the new limit
    sent = run_check(path, [raised], settings_for(port), "2026-11-10T12:01:00+00:00")
    assert [(a.thresholds, a.payload["limit_usd"]) for a, _ in sent] == [((50,), "200")]
    assert run_check(path, [raised], settings_for(port), "2026-11-10T12:02:00+00:00") == []
    assert [m["Subject"] for m in inbox.wait_for(2)] == [
        "[tokenward] budget team: 55.00% of $100.00 (crossed 50%)",
        "[tokenward] budget team: 52.50% of $200.00 (crossed 50%)",
    ]
    # the same limit again, as the config file is read at a restart: nothing is re-armed or resent
    assert run_check(path, [raised], settings_for(port), "2026-11-10T13:00:00+00:00") == []
    assert len(inbox.wait_for(3, timeout=0.5)) == 2
