"""Alerts and the calendar: a budget's time zone edited mid-period, over a real SMTP server (aiosmtpd)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import msgspec
import pytest

from tokenward.pricing.settings import BudgetSettings
from tokenward.reports.alerts import Notifier, WebhookSettings
from tokenward.reports.ledger.state import AlertKey

from .test_alert_delivery_races import engine_state
from .test_alerts import cost_row, run_check, seed, settings_for, smtp, webhook_inbox  # noqa: F401 - smtp: fixture

MONTH_UTC = BudgetSettings(
    name="team-month",
    limit_usd=100,
    scope={"team": "research"},
    period="month",
    timezone="UTC",
    thresholds=[50, 80],
    notify=["lead@example.com"],
)


def test_a_time_zone_edited_mid_month_does_not_mail_the_months_thresholds_again(tmp_path, smtp):  # noqa: F811
    """November in UTC, then (config edited, proxy restarted) November in Paris: the same month.

    Before, a claim was found by its period's start only: Paris's November starts an hour before
    UTC's (2026-10-31T23:00Z), so the 50 % mailed on the 20th was mailed again at the restart,
    and the ended-month check after the reset mailed November's thresholds once more.
    """
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    # $55 on the 18th; at 10:00Z on the 20th 466 of 720 hours have gone: $84.98 forecast, under the limit
    seed(path, [cost_row("a", "2026-11-18T09:00:00+00:00", "55.00")])
    utc = MONTH_UTC.to_budget()
    sent = run_check(path, [utc], settings_for(port), "2026-11-20T10:00:00+00:00")
    assert [(a.thresholds, a.period_start.isoformat()) for a, _ in sent] == [((50,), "2026-11-01T00:00:00+00:00")]
    paris = msgspec.structs.replace(MONTH_UTC, timezone="Europe/Paris").to_budget()
    assert run_check(path, [paris], settings_for(port), "2026-11-20T11:00:00+00:00") == []
    # 80 % is new in November, whichever zone: mailed once, for Paris's November ($85 in 659 of 720
    # hours: $92.87 forecast, under the limit)
    seed(path, [cost_row("b", "2026-11-28T09:00:00+00:00", "30.00")])
    sent = run_check(path, [paris], settings_for(port), "2026-11-28T10:00:00+00:00")
    assert [(a.thresholds, a.period_start.isoformat()) for a, _ in sent] == [((80,), "2026-10-31T23:00:00+00:00")]
    # after Paris's midnight, the ended month's check finds nothing it has not mailed
    assert run_check(path, [paris], settings_for(port), "2026-11-30T23:00:30+00:00") == []
    # December is a new month: its 50 % is mailed (the first hour of Paris's December is not UTC's
    # November), and its forecast: $60 in 20 minutes of 744 hours is $133,920 by the end
    seed(path, [cost_row("c", "2026-11-30T23:10:00+00:00", "60.00")])
    sent = run_check(path, [paris], settings_for(port), "2026-11-30T23:20:00+00:00")
    assert [(a.kind, a.thresholds, a.period_start.isoformat()) for a, _ in sent] == [
        ("threshold", (50,), "2026-11-30T23:00:00+00:00"),
        ("forecast", (0,), "2026-11-30T23:00:00+00:00"),
    ]
    assert sorted(m["Subject"] for m in inbox.wait_for(4)) == [
        "[tokenward] budget team-month: 55.00% of $100.00 (crossed 50%)",
        "[tokenward] budget team-month: 60.00% of $100.00 (crossed 50%)",
        "[tokenward] budget team-month: 60.00% of $100.00 (projected to reach $133,920.00 by 2027-01-01T00:00:00+01:00)",
        "[tokenward] budget team-month: 85.00% of $100.00 (crossed 80%)",
    ]
    assert len(inbox.wait_for(5, timeout=0.5)) == 4


@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
def test_claims_of_one_budget_by_period_start_in_each_state_store(engine, tmp_path, request):
    """What the time-zone check reads: one budget's claims whose period starts in ``[since, until)``."""
    state = engine_state(engine, tmp_path, request)
    at = dt.datetime(2026, 11, 10, 10, tzinfo=dt.UTC)
    utc, paris = dt.datetime(2026, 11, 1, tzinfo=dt.UTC), dt.datetime(2026, 10, 31, 23, tzinfo=dt.UTC)
    keys = [AlertKey("a", utc, "threshold", 50), AlertKey("a", paris, "threshold", 80), AlertKey("b", utc, "threshold", 50)]
    for key in keys:
        state.claim([key], {"payload": {}}, at)
    found = state.claims(budget="a", starting=(paris, utc))
    assert [c.key for c in found] == [keys[1]]  # the end is left out, and other budgets
    assert [c.key for c in state.claims(budget="a", starting=(paris, utc + dt.timedelta(seconds=1)))] == keys[:2]
    assert [c.key for c in state.claims(budget="b")] == [keys[2]]


def test_mail_and_webhook_give_spend_and_limit_to_the_micro_dollar(tmp_path, smtp):  # noqa: F811
    """$0.10 + $0.20 + $6.0000042 against $12.345: every figure exact, none rounded to cents, no float artefacts.

    Before, amounts from $1 up were shown in cents and smaller ones to 6 places: the limit read
    $12.34 (half-even), and a spend of $0.0000084 read $0.000008.
    """
    inbox, port = smtp
    posted, hooks = webhook_inbox()
    path = tmp_path / "l.duckdb"
    seed(
        path,
        [
            cost_row("a", "2026-11-10T09:00:00+00:00", "0.1"),
            cost_row("b", "2026-11-10T09:01:00+00:00", "0.2"),
            cost_row("c", "2026-11-10T09:02:00+00:00", "6.0000042", model="gpt-4o-mini"),
        ],
    )
    budget = BudgetSettings(
        name="exact", limit_usd="12.345", period="total", thresholds=[50, 100], notify=["lead@example.com", "ops"]
    ).to_budget()
    settings = settings_for(port, webhooks=[WebhookSettings(name="ops", url="https://hooks.example/x")])
    sent = run_check(path, [budget], settings, "2026-11-10T10:00:00+00:00", notifier=Notifier(settings, transport=hooks))
    assert [a.thresholds for a, _ in sent] == [(50,)]
    (mail,) = inbox.wait_for(1)
    # 6.3000042 / 12.345 = 51.0332... %
    assert mail["Subject"] == "[tokenward] budget exact: 51.03% of $12.345 (crossed 50%)"
    text = mail.get_body(("plain",)).get_content().splitlines()
    for line in (
        "Spent: $6.3000042 (51.03%)",
        "Limit: $12.345",
        "Remaining: $6.0449958",
        "  gpt-4o-mini: $6.0000042",
        "  gpt-4o: $0.30",
    ):
        assert line in text, (line, text)
    [message] = posted
    figures = message["tokenward"]
    assert (figures["spent_usd"], figures["limit_usd"], figures["percent"]) == ("6.3000042", "12.345", "51.03")
    assert Decimal(figures["spent_usd"]) == Decimal("0.1") + Decimal("0.2") + Decimal("6.0000042")
    assert "$6.3000042" in message["text"] and "$12.345" in message["text"]


def test_a_week_that_starts_on_sunday_in_new_york_across_the_end_of_summer_time(tmp_path, smtp):  # noqa: F811
    """``week_start: sunday``: the week of 2026-11-01 (the day New York leaves summer time) is 169 hours.

    Before, a week always started on Monday (ISO): Saturday's $40 and Sunday's $55 were one week's
    $95, and a US team's Sunday-to-Saturday budget could not be written.
    """
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    seed(
        path,
        [
            cost_row("sat", "2026-10-31T23:30:00-04:00", "40.00"),  # the week before (from Sunday 25 October)
            cost_row("sun", "2026-11-01T00:30:00-04:00", "55.00"),
        ],
    )
    budget = BudgetSettings(
        name="us-week",
        limit_usd=100,
        scope={"team": "research"},
        period="week",
        timezone="America/New_York",
        week_start="sunday",
        thresholds=[50],
        notify=["lead@example.com"],
    ).to_budget()
    start, end = budget.period.window(dt.datetime.fromisoformat("2026-11-07T23:59:59-05:00"))
    assert (start.isoformat(), end.isoformat()) == ("2026-11-01T04:00:00+00:00", "2026-11-08T05:00:00+00:00")
    assert end - start == dt.timedelta(hours=169)
    # Sunday 07:00 EST (12:00Z): 8 of 169 hours gone, $55 spent: $1,161.88 projected (55 x 169 / 8)
    sent = run_check(path, [budget], settings_for(port), "2026-11-01T07:00:00-05:00")
    assert [(a.kind, a.payload["spent_usd"], a.period_start.isoformat()) for a, _ in sent] == [
        ("threshold", "55", "2026-11-01T04:00:00+00:00"),
        ("forecast", "55", "2026-11-01T04:00:00+00:00"),
    ]
    mails = {m["Subject"]: m for m in inbox.wait_for(2)}
    mail = mails["[tokenward] budget us-week: 55.00% of $100.00 (crossed 50%)"]
    text = mail.get_body(("plain",)).get_content()
    assert "Period: week from Sunday (America/New_York), since 2026-11-01T00:00:00-04:00" in text
    assert "Resets: 2026-11-08T00:00:00-05:00" in text and "Forecast for the period: $1,161.88" in text
    with pytest.raises(msgspec.ValidationError, match="week_start"):
        msgspec.convert({"name": "x", "limit_usd": 1, "period": "week", "week_start": "sun"}, BudgetSettings)
