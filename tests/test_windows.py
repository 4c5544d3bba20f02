"""Several windows on one scope ($/hour, $/day, $/month in one budget): each its own limit, thresholds and reset.

Requests cost exactly their worst case: 1007 input at $2.50 and 1000 output at $10.00 per 1M =
$0.0125175 (tests/fixtures/field_case_prices.yaml).
"""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal
from zoneinfo import ZoneInfo

import pytest
from click.testing import CliRunner

from tokenward.pricing.budgets import Period
from tokenward.pricing.settings import BudgetSettings, WindowSettings
from tokenward.proxy.cli import main
from tokenward.proxy.config import ConfigError, load_config
from tokenward.proxy.dashboard import budget_views
from tokenward.proxy.guard import BudgetGuard
from tokenward.proxy.live import LiveFeed

from .agentkit import post, prompt, record, serving
from .test_alerts import cost_row, run_check, seed, settings_for, smtp  # noqa: F401 - smtp is a fixture

EACH = Decimal("0.0125175")
UTC = dt.UTC


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch):
    monkeypatch.setenv("SIM_UPSTREAM_KEY", "sk-upstream")


def windows(zone: str = "UTC", **extra) -> BudgetSettings:
    return BudgetSettings(
        name="agents",
        scope={"key": "agent"},
        timezone=zone,
        action="block",
        thresholds=[50, 100],
        windows=[
            WindowSettings(period="hour", limit_usd="0.03"),
            WindowSettings(period="day", limit_usd="0.05", thresholds=[80]),
            WindowSettings(period="month", limit_usd=1),
        ],
        **extra,
    )


def test_one_definition_makes_one_budget_per_window():
    hour, day, month = windows("Asia/Kolkata").to_budgets()
    assert [b.name for b in (hour, day, month)] == ["agents/hour", "agents/day", "agents/month"]
    assert [b.group for b in (hour, day, month)] == ["agents"] * 3
    assert [b.thresholds for b in (hour, day, month)] == [(50, 100), (80,), (50, 100)]
    assert (hour.limit_usd, day.limit_usd, month.limit_usd) == (Decimal("0.03"), Decimal("0.05"), Decimal(1))
    # an hour is the local hour: India is UTC+05:30, so its hours start at :30 UTC
    assert hour.period.window(dt.datetime(2026, 11, 12, 10, 10, tzinfo=UTC)) == (
        dt.datetime(2026, 11, 12, 9, 30, tzinfo=UTC),
        dt.datetime(2026, 11, 12, 10, 30, tzinfo=UTC),
    )
    # the hour that repeats when DST ends in Paris (02:00 CEST -> 02:00 CET) is two hours of UTC, one each
    fold = dt.datetime(2026, 10, 25, 2, 40, tzinfo=ZoneInfo("Europe/Paris"), fold=1)
    assert Period("hour", "Europe/Paris").window(fold) == (
        dt.datetime(2026, 10, 25, 1, 0, tzinfo=UTC),
        dt.datetime(2026, 10, 25, 2, 0, tzinfo=UTC),
    )


def test_window_settings_are_checked(tmp_path):
    head = "upstreams: [{name: a, base_url: 'http://upstream.invalid'}]\n"
    for budget, says in (
        ("{name: b, limit_usd: 5, windows: [{period: day, limit_usd: 5}]}", "give windows or limit_usd and period"),
        ("{name: b, windows: [{period: day, limit_usd: 5}, {period: day, limit_usd: 9}]}", "two windows share a name"),
        ("{name: b, windows: [{period: rolling, limit_usd: 5}]}", "rolling period needs rolling_hours"),
        ("{name: b, windows: [{period: day, limit_usd: -5}]}", "limit_usd must be a positive amount"),
        ("{name: b}", "give limit_usd (or windows)"),
        ("{name: 'run:x', limit_usd: 1}", "are tokenward's own"),
        ("{name: 'u[1]', limit_usd: 1}", "are tokenward's own"),
        ("{name: b/day, limit_usd: 1}, {name: b, windows: [{period: day, limit_usd: 2}]}", "duplicate budget name"),
    ):
        path = tmp_path / "c.yaml"
        path.write_text(f"{head}budgets: [{budget}]\n")
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(path)
    path.write_text(
        head + "budgets: [{name: b, windows: [{period: day, limit_usd: 5}, {period: day, limit_usd: 9, name: peak}]}]\n"
    )
    assert [b.name for b in load_config(path).budget_list()] == ["b/day", "b/peak"]


def _zone_past_two_am() -> str:
    """A fixed-offset zone where it is now between 02:00 and 22:00 (so the local day began hours ago)."""
    now = dt.datetime.now(UTC)
    for offset in range(-12, 13):
        zone = f"Etc/GMT{'+' if offset <= 0 else '-'}{abs(offset)}"  # Etc/GMT-5 is UTC+5
        if 2 <= now.astimezone(ZoneInfo(zone)).hour < 22:
            return zone
    raise AssertionError("no zone found")


def test_each_window_binds_with_its_own_limit_and_reset(tmp_path, simulator):
    record(simulator, "windows", 1007, 1000)
    zone = _zone_past_two_am()
    now = dt.datetime.now(UTC)
    day_start = Period("day", zone).window(now)[0]
    ledger = tmp_path / "l.duckdb"
    # $0.03 spent this (local) day, more than an hour ago: the day window has $0.02 left, the hour $0.03
    seed(ledger, [cost_row("earlier", (day_start + dt.timedelta(minutes=1)).isoformat(), "0.03")])
    with serving(ledger, simulator, budgets=[windows(zone)]) as proxy:
        ok = post(proxy.url, prompt(1000, 1000), "windows")
        assert ok.status_code == 200
        entries = [entry.split(";") for entry in ok.headers["x-tokenward-budgets"].split(", ")]
        # after this request: hour $0.03 - $0.0125175, day $0.05 - $0.0425175, month $1 - $0.0425175
        assert [e[:3] for e in entries] == [
            ["agents/day", "limit_usd=0.05", "remaining_usd=0.0074825"],
            ["agents/hour", "limit_usd=0.03", "remaining_usd=0.0174825"],
            ["agents/month", "limit_usd=1", "remaining_usd=0.9574825"],
        ]
        resets = {e[0]: int(e[3].removeprefix("resets_in_s=")) for e in entries}
        assert 0 < resets["agents/hour"] <= 3600 and resets["agents/hour"] < resets["agents/day"] <= 86400 - 7200
        # the next one fits the hour ($0.025035 <= $0.03) but not the day ($0.055035 > $0.05)
        refused = post(proxy.url, prompt(1000, 1000), "windows")
        assert refused.status_code == 429 and refused.headers["x-tokenward-budget"] == "agents/day"
        assert abs(int(refused.headers["retry-after"]) - resets["agents/day"]) <= 2
        views = budget_views(proxy.app.state.guard, proxy.app.state.recorder.live, dt.datetime.now(UTC))
        assert [(v["budget"], v["group"], v["period"], v["spent_usd"]) for v in views] == [
            ("agents/hour", "agents", "hour", EACH),
            ("agents/day", "agents", "day", Decimal("0.03") + EACH),
            ("agents/month", "agents", "month", Decimal("0.03") + EACH),
        ]
        assert views[0]["resets_at"] == Period("hour", zone).window(dt.datetime.now(UTC))[1]


def test_the_hour_window_refuses_on_its_own(tmp_path, simulator):
    record(simulator, "hourly", 1007, 1000)
    with serving(tmp_path / "l.duckdb", simulator, budgets=[windows()]) as proxy:
        statuses = [post(proxy.url, prompt(1000, 1000), "hourly").status_code for _ in range(3)]
        assert statuses == [200, 200, 429]  # 2 x $0.0125175 fit $0.03; 3 do not (day: $0.05)
        refused = post(proxy.url, prompt(1000, 1000), "hourly")
        assert refused.headers["x-tokenward-budget"] == "agents/hour"
        assert refused.headers["x-tokenward-budget-remaining-usd"] == "0.004965"
        assert int(refused.headers["retry-after"]) <= 3600


def test_status_shows_the_windows_together_and_alerts_follow_each_windows_thresholds(tmp_path, smtp):  # noqa: F811
    inbox, port = smtp
    config = tmp_path / "c.yaml"
    config.write_text(
        "upstreams: [{name: a, base_url: 'http://upstream.invalid'}]\n"
        f"alerts: {{smtp: {{host: 127.0.0.1, port: {port}, security: none}}}}\n"
        "budgets:\n"
        "  - {name: agents, scope: {key: agent}, timezone: Europe/Paris, notify: [lead@example.com],\n"
        "     windows: [{period: hour, limit_usd: 0.03, thresholds: [50]}, {period: day, limit_usd: 0.05,\n"
        "               thresholds: [80]}, {period: month, limit_usd: 1}]}\n"
        "  - {name: other, limit_usd: 10, period: month}\n"
    )
    db = tmp_path / "l.duckdb"
    seed(
        db,
        [
            cost_row("a", "2026-11-12T08:10:00+00:00", "0.02"),  # 09:10 in Paris: an earlier hour of the day
            cost_row("b", "2026-11-12T09:05:00+00:00", "0.016"),  # 10:05 in Paris: this hour
        ],
    )
    result = CliRunner().invoke(
        main,
        ["budgets", "status", "--config", str(config), "--db", str(db), "--at", "2026-11-12T09:30:00+00:00"],
        env={"COLUMNS": "200"},  # the table, as on a wide terminal
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "agents/" in line]
    assert [line.split()[1] for line in lines] == ["agents/hour", "agents/day", "agents/month"]
    for line, figures in zip(
        lines,
        (
            ("$0.0160", "$0.03", "53.33", "2026-11-12 10:00 to 2026-11-12 11:00 Europe/Paris"),
            ("$0.0360", "$0.05", "72.00", "2026-11-12 00:00 to 2026-11-13 00:00 Europe/Paris"),
            ("$0.0360", "$1.00", "3.60", "2026-11-01 00:00 to 2026-12-01 00:00 Europe/Paris"),
        ),
        strict=True,
    ):
        for figure in figures:
            assert figure in line, (figure, line)
    # a section line separates the definition's windows from the next budget, none between them
    output = result.output.splitlines()
    first, last = output.index(lines[0]), output.index(lines[-1])
    assert last - first == 2 and "other" in "".join(output[last + 1 : last + 3])
    budgets = load_config(config).budget_list()
    settings = load_config(config).alerts
    sent = run_check(db, budgets, settings, "2026-11-12T09:30:00+00:00")
    # the hour crossed its 50 % ($0.016 of $0.03); the day (72 % of $0.05) has not reached its 80 %. Both
    # are projected past their limits at their rates so far: the hour's $0.016 in 30 min, the day's $0.036 in 10.5 h
    # (and the hour before, 66.67 % with $0.02 at 09:10, had its 50 % crossed unseen: owed once, as that hour's)
    assert [(a.budget, a.kind, a.thresholds) for a, _ in sent] == [
        ("agents/hour", "threshold", (50,)),
        ("agents/hour", "forecast", (0,)),
        ("agents/hour", "threshold", (50,)),
        ("agents/day", "forecast", (0,)),
    ]
    subjects = {m["Subject"] for m in inbox.wait_for(4)}
    assert "[tokenward] budget agents/hour: 53.33% of $0.03 (crossed 50%)" in subjects
    assert run_check(db, budgets, settings, "2026-11-12T09:40:00+00:00") == []
    # the next hour starts again from $0: $0.014 (46.67 %) but a forecast of its own; the day is at 100 %
    seed(db, [cost_row("c", "2026-11-12T10:05:00+00:00", "0.014")])
    sent = run_check(db, budgets, settings, "2026-11-12T10:06:00+00:00")
    assert [(a.budget, a.kind, a.thresholds) for a, _ in sent] == [
        ("agents/hour", "forecast", (0,)),
        ("agents/day", "threshold", (80,)),
    ]
    seed(db, [cost_row("d", "2026-11-12T10:07:00+00:00", "0.002")])  # this hour: $0.016, 53.33 %
    sent = run_check(db, budgets, settings, "2026-11-12T10:08:00+00:00")
    assert [(a.budget, a.kind, a.thresholds) for a, _ in sent] == [("agents/hour", "threshold", (50,))]


def test_budget_views_have_one_entry_per_window():
    guard = BudgetGuard(windows().to_budgets(), dt.datetime(2026, 11, 12, 9, 30, tzinfo=UTC))
    views = budget_views(guard, LiveFeed(guard.budgets), dt.datetime(2026, 11, 12, 9, 30, tzinfo=UTC))
    assert [(v["budget"], v["resets_at"]) for v in views] == [
        ("agents/hour", dt.datetime(2026, 11, 12, 10, 0, tzinfo=UTC)),
        ("agents/day", dt.datetime(2026, 11, 13, 0, 0, tzinfo=UTC)),
        ("agents/month", dt.datetime(2026, 12, 1, 0, 0, tzinfo=UTC)),
    ]
