"""Alerts on time: before the money runs out, once, over a real SMTP server (aiosmtpd)."""

from __future__ import annotations

import datetime as dt

from tokenward.pricing.settings import BudgetSettings

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
