"""The live feed (memory), the budget views built on it, and the dashboard's ledger queries.

Every expected figure is worked out by hand in the comments next to it.
"""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal

from tokenward.pricing.budgets import Budget, Period
from tokenward.proxy.dashboard import budget_views
from tokenward.proxy.guard import BudgetGuard
from tokenward.proxy.live import RECENT_COLUMNS, LiveFeed
from tokenward.reports.dashboard_queries import history, range_start, sent_alerts
from tokenward.reports.ledger import DuckLedger, open_ledger, write_rows
from tokenward.reports.ledger.state import AlertKey, DeliveryRecord

from .test_ledger import make_row

UTC = dt.UTC


def row(request_id: str, cost: str | None, **extra) -> dict:
    return make_row(request_id, cost_usd=None if cost is None else Decimal(cost), **extra)


def test_rates_use_the_window_or_the_feed_age_and_count_requests_not_parts():
    feed = LiveFeed(now=1000.0)
    feed.add([row("a", "0.10", input_tokens=100, output_tokens=10)], now=1000.5)
    # one exchange with a part on another model: its cost counts, the part is no second request
    feed.add([row("b", "0.20"), row("b-p1", "0.05", row_kind="part")], now=1030.0)
    feed.add([row("c", "0.40")], now=1095.0)
    rates = feed.rates(now=1100.0)
    # last 10 s: only c (1095) -> 1 request / 10 s
    assert rates["requests_per_s"] == Decimal("0.10")
    # the feed is 100 s old: 5-minute burn = all 0.75 over 100 s, per minute: 0.75 * 60 / 100 = 0.45
    assert rates["burn_usd_per_min"] == Decimal("0.450000")
    # hourly: 0.75 * 3600 / 100 = 27
    assert rates["burn_usd_per_hour"] == Decimal("27.000000")
    assert rates["last_hour"]["requests"] == 3 and rates["last_hour"]["cost_usd"] == Decimal("0.75")
    assert (rates["last_hour"]["input_tokens"], rates["last_hour"]["output_tokens"]) == (100, 10)
    # a young feed is not extrapolated from its first second: at least 60 s
    young = LiveFeed(now=0.0)
    young.add([row("x", "0.06")], now=1.0)
    assert young.rates(now=1.0)["burn_usd_per_min"] == Decimal("0.060000")


def test_old_seconds_leave_and_memory_stays_bounded():
    feed = LiveFeed(now=0.0, recent=3, horizon_s=3600)
    for i in range(5):
        feed.add([row(f"r{i}", "1")], now=10.0 + i)
    assert [r["request_id"] for r in feed.recent()] == ["r4", "r3", "r2", "r1", "r0"][:3]
    assert set(feed.recent()[0]) == set(RECENT_COLUMNS)
    feed.add([row("late", "2")], now=5000.0)
    # buckets at or before 5000 - 3600 = 1400 are dropped: only the new one is left
    assert len(feed._seconds) == 1
    assert feed.totals(3600, now=5000.0)["cost_usd"] == Decimal(2)
    # an hour later with no traffic the last hour is empty, even though the bucket is still kept
    assert feed.totals(3600, now=8700.0)["cost_usd"] == Decimal(0)
    assert feed.rows_seen == 6


def test_per_minute_series_has_every_minute_with_zeros():
    feed = LiveFeed(now=0.0)
    feed.add([row("a", "0.5")], now=600.0)  # minute starting at 600
    feed.add([row("b", "0.25")], now=659.0)  # same minute
    feed.add([row("c", "1")], now=720.0)  # minute 720
    series = feed.per_minute(3, now=725.0)  # minutes 600, 660, 720
    assert series == [
        {"t": 600, "requests": 2, "cost_usd": Decimal("0.75")},
        {"t": 660, "requests": 0, "cost_usd": Decimal(0)},
        {"t": 720, "requests": 1, "cost_usd": Decimal("1")},
    ]


NOW = dt.datetime(2026, 12, 1, 10, 0, tzinfo=UTC)


def test_budget_views_forecast_and_runs_out_at():
    budgets = [
        Budget("day-1", Decimal("1.00"), period=Period("day")),
        Budget("day-50", Decimal("50"), period=Period("day")),
        Budget("month-100", Decimal("100"), period=Period("month"), action="block"),
        Budget("spent-out", Decimal("0.40"), period=Period("day")),
        Budget("rolling-3", Decimal("3"), period=Period("rolling", rolling_hours=1)),
        Budget("rolling-2", Decimal("2"), period=Period("rolling", rolling_hours=1)),
        Budget("total-1", Decimal("1"), period=Period("total")),
        Budget("other-team", Decimal("1"), scope=(("team", "other"),), period=Period("day")),
    ]
    guard = BudgetGuard(budgets, NOW)
    start = NOW.timestamp()
    feed = LiveFeed(budgets, now=start - 600)
    spend = row("r", "0.40", started_at=start - 100, ended_at=start - 99, team="research")
    guard.observe(spend)
    feed.add([spend], now=start - 99)
    views = {v["budget"]: v for v in budget_views(guard, feed, NOW)}
    # the feed is 600 s old: burn in scope = 0.40 * 3600 / 600 = $2.40 per hour
    assert views["day-1"]["burn_usd_per_hour"] == Decimal("2.400000")
    # 0.60 left / 2.40 per hour = 15 minutes
    assert views["day-1"]["runs_out_at"] == NOW + dt.timedelta(minutes=15)
    assert views["day-1"]["percent"] == Decimal("40.00") and views["day-1"]["remaining_usd"] == Decimal("0.60")
    # forecast: 0.40 over the 10 h gone of a 24 h day -> 0.40 * 24 / 10 = 0.96
    assert views["day-1"]["forecast_usd"] == Decimal("0.960000")
    assert views["day-1"]["resets_at"] == dt.datetime(2026, 12, 2, tzinfo=UTC)
    # 49.60 / 2.40 = 20 h 40 min: after midnight, so not before the reset
    assert views["day-50"]["runs_out_at"] is None
    # 99.60 / 2.40 = 41.5 h -> 2026-12-03 03:30, inside December
    assert views["month-100"]["runs_out_at"] == dt.datetime(2026, 12, 3, 3, 30, tzinfo=UTC)
    assert views["month-100"]["action"] == "block" and views["month-100"]["thresholds"] == [50, 80, 100]
    assert views["spent-out"]["runs_out_at"] is None and views["spent-out"]["percent"] == Decimal("100.00")
    # rolling hour: at $2.40/h the window holds $2.40 at most: under $3 never runs out, over $2 it does
    assert views["rolling-3"]["runs_out_at"] is None and views["rolling-3"]["resets_at"] is None
    # 1.60 / 2.40 h = 40 min
    assert views["rolling-2"]["runs_out_at"] == NOW + dt.timedelta(minutes=40)
    assert views["total-1"]["runs_out_at"] == NOW + dt.timedelta(minutes=15)
    assert views["total-1"]["forecast_usd"] is None and views["total-1"]["period_start"] is None
    # nothing spent in its scope: no burn, no end
    assert views["other-team"]["burn_usd_per_hour"] == Decimal(0) and views["other-team"]["runs_out_at"] is None
    assert views["other-team"]["scope"] == "team=other"
    assert budget_views(None, feed, NOW) == []


def seed(path, rows):
    write_rows(path, rows)


def at(text: str) -> float:
    return dt.datetime.fromisoformat(text).timestamp()


def test_history_in_a_half_hour_zone(tmp_path):
    path = tmp_path / "ledger.duckdb"
    common = {"principal": "a", "team": "x"}
    seed(
        path,
        [
            row(
                "r1",
                "0.30",
                started_at=at("2026-12-01T09:45:00+00:00"),
                ended_at=at("2026-12-01T09:45:01+00:00"),
                served_model="gpt-4o",
                cache_savings_usd=Decimal("0.01"),
                input_tokens=1000,
                cached_input_tokens=400,
                **common,
            ),
            row(
                "r2",
                "0.50",
                started_at=at("2026-12-01T08:00:00+00:00"),
                ended_at=at("2026-12-01T08:00:01+00:00"),
                served_model="claude-sonnet-4-5",
                principal="b",
                team="y",
                input_tokens=1000,
            ),
            row(
                "r3",
                "1.00",
                started_at=at("2026-11-30T18:00:00+00:00"),
                ended_at=at("2026-11-30T18:00:01+00:00"),
                served_model="gpt-4o",
                **common,
            ),
            row(
                "r4",
                None,
                price_status="unpriced",
                started_at=at("2026-12-01T09:50:00+00:00"),
                ended_at=at("2026-12-01T09:50:01+00:00"),
                served_model="mystery",
                **common,
            ),
            row(
                "r5",
                "5",
                started_at=at("2026-12-01T10:30:00+00:00"),
                ended_at=at("2026-12-01T10:30:01+00:00"),
                served_model="gpt-4o",
                **common,
            ),  # after "now": not counted yet
        ],
    )
    state = DuckLedger(path).state
    start = dt.datetime(2026, 12, 1, tzinfo=UTC)
    crossed = [AlertKey("team-x", start, "threshold", t) for t in (50, 80)]
    state.claim(crossed, {"subject": "[tokenward] budget team-x: 80% of $1.00"}, dt.datetime(2026, 12, 1, 10, tzinfo=UTC))
    forecast_key = AlertKey("team-x", start, "forecast", 0)
    state.claim([forecast_key], {}, dt.datetime(2026, 12, 1, 10, 10, tzinfo=UTC))
    for key in crossed:
        state.set_status(key, "sent")
    state.set_status(forecast_key, "pending", "smtp down")
    delivered = dt.datetime(2026, 12, 1, 10, 0, 1, tzinfo=UTC)
    for key in crossed:
        state.record_delivery(DeliveryRecord(key, "email", "ops@example.com", True, 1, None, delivered))
    failed = dt.datetime(2026, 12, 1, 10, 10, 1, tzinfo=UTC)
    state.record_delivery(DeliveryRecord(forecast_key, "email", "ops@example.com", False, 3, "smtp down", failed))
    conn = open_ledger(path)
    now = dt.datetime(2026, 12, 1, 10, 20, tzinfo=UTC)  # 15:50 in Kolkata (UTC+05:30)
    try:
        figures = history(conn, now, "Asia/Kolkata", "24h", state=state)
    finally:
        conn.close()
    # local day from 2026-11-30T18:30Z: r1, r2, r4 (r3 at 18:00Z is 23:30 the day before)
    today = figures["today"]
    assert (today["cost_usd"], today["requests"], today["unpriced_requests"]) == (Decimal("0.80"), 3, 1)
    # cached 400 of 2000 input tokens
    assert today["cache_savings_usd"] == Decimal("0.01") and today["cache_hit_rate"] == Decimal("0.2000")
    # local hour 15:00 = 09:30Z: r1 and r4
    assert (figures["this_hour"]["cost_usd"], figures["this_hour"]["requests"]) == (Decimal("0.30"), 2)
    # last 24 h from 2026-11-30T10:20Z: r1 to r4 -> 1.80
    assert figures["range"]["cost_usd"] == Decimal("1.80") and figures["range"]["requests"] == 4
    assert [(g["name"], g["cost_usd"]) for g in figures["by_model"]] == [
        ("gpt-4o", Decimal("1.30")),
        ("claude-sonnet-4-5", Decimal("0.50")),
        ("mystery", None),
    ]
    assert [(g["name"], g["cost_usd"]) for g in figures["by_key"]] == [("a", Decimal("1.30")), ("b", Decimal("0.50"))]
    assert [(g["name"], g["cost_usd"]) for g in figures["by_team"]] == [("x", Decimal("1.30")), ("y", Decimal("0.50"))]
    hourly = figures["hourly"]
    assert len(hourly) == 24 and hourly[-1]["t"] == at("2026-12-01T09:30:00+00:00")
    assert hourly[0]["t"] == at("2026-11-30T10:30:00+00:00")
    costs = {h["t"]: h["cost_usd"] for h in hourly if h["cost_usd"]}
    assert costs == {
        at("2026-11-30T17:30:00+00:00"): Decimal("1.00"),  # r3
        at("2026-12-01T07:30:00+00:00"): Decimal("0.50"),  # r2
        at("2026-12-01T09:30:00+00:00"): Decimal("0.30"),  # r1 (r4 unpriced)
    }
    daily = figures["daily"]
    assert len(daily) == 30 and daily[0]["day"] == "2026-11-02" and daily[-1]["day"] == "2026-12-01"
    assert (daily[-1]["cost_usd"], daily[-2]["cost_usd"], daily[-3]["cost_usd"]) == (
        Decimal("0.80"),
        Decimal("1.00"),
        Decimal(0),
    )
    forecast, threshold = figures["alerts"]
    assert (forecast["kind"], forecast["status"], forecast["delivered_to"], forecast["last_error"]) == (
        "forecast",
        "pending",
        [],
        "smtp down",
    )
    assert (threshold["thresholds"], threshold["status"], threshold["delivered_to"]) == (
        [50, 80],
        "sent",
        ["email ops@example.com"],
    )
    assert threshold["subject"] == "[tokenward] budget team-x: 80% of $1.00"
    json.dumps(figures, default=str)  # plain data, ready for the API


def test_ranges_and_alerts_on_an_empty_ledger(tmp_path):
    now = dt.datetime(2026, 12, 1, 10, 20, tzinfo=UTC)
    assert range_start("today", "UTC", now) == dt.datetime(2026, 12, 1, tzinfo=UTC)
    assert range_start("7d", "UTC", now) == now - dt.timedelta(days=7)
    conn = open_ledger(tmp_path / "l.duckdb")
    try:
        assert sent_alerts(DuckLedger(tmp_path / "l.duckdb").state) == []
        figures = history(conn, now)
    finally:
        conn.close()
    assert figures["today"]["cost_usd"] is None and figures["by_model"] == []
    assert all(h["cost_usd"] == 0 for h in figures["hourly"]) and len(figures["daily"]) == 30
