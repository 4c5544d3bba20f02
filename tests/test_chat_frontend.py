"""Chat frontends: a header names the user (Open WebUI's X-OpenWebUI-User-Email), each user gets a budget on first sight.

Each request costs exactly its worst case, $0.0125175 (1007 in at $2.50, 1000 out at $10.00 per 1M).
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import httpx
import pytest

from tokenward.pricing.runs import RunRefused
from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.config import AttributionRule, AttributionSettings, VirtualKeyConfig
from tokenward.proxy.guard import BudgetGuard
from tokenward.proxy.run_budgets import DynamicBudgets

from .agentkit import post, prompt, record, serving

WEBUI_KEY = "tw-open-webui-key-1"
APP_KEY = "tw-plain-app-key-02"
KEYS = [
    VirtualKeyConfig(
        name="open-webui",
        key=WEBUI_KEY,
        team="chat",
        attribution=AttributionSettings(end_user=AttributionRule(header="X-OpenWebUI-User-Email", required=True)),
    ),
    VirtualKeyConfig(name="app", key=APP_KEY, team="chat"),
]
PER_USER = BudgetSettings(
    name="chat-user", per="end_user", scope={"team": "chat"}, limit_usd="0.02", period="month", action="block"
)
EMAIL = "x-openwebui-user-email"


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch):
    monkeypatch.setenv("SIM_UPSTREAM_KEY", "sk-upstream")


def test_each_user_gets_a_budget_on_first_sight_and_keeps_it_across_a_restart(tmp_path, simulator):
    record(simulator, "webui", 1007, 1000)
    ledger = tmp_path / "l.duckdb"
    with serving(ledger, simulator, keys=KEYS, budgets=[PER_USER]) as proxy:
        # the header names the user; the body's user field and X-Tokenward-User do not
        alice = post(
            proxy.url, {**prompt(1000, 1000), "user": "bob"}, "webui", WEBUI_KEY, **{EMAIL: "alice@example.com"}
        )
        assert alice.status_code == 200
        assert alice.headers["x-tokenward-budget"] == "chat-user[alice@example.com]"
        assert alice.headers["x-tokenward-budget-remaining-usd"] == "0.0074825"
        # a second request for alice does not fit her $0.02 ($0.025035); bob has his own $0.02
        refused = post(proxy.url, prompt(1000, 1000), "webui", WEBUI_KEY, **{EMAIL: "alice@example.com"})
        assert refused.status_code == 429 and "chat-user[alice@example.com]" in refused.json()["error"]["message"]
        assert post(proxy.url, prompt(1000, 1000), "webui", WEBUI_KEY, **{EMAIL: "bob@example.com"}).status_code == 200
        # no header: refused (required), and the header never reaches the provider
        nobody = post(proxy.url, prompt(1000, 1000), "webui", WEBUI_KEY, **{"x-tokenward-user": "carol"})
        assert (nobody.status_code, nobody.json()["error"]["code"]) == (403, "attribution_refused")
        assert not any(EMAIL in r["headers"] for r in simulator.simulator.requests)
        rows = proxy.rows(4)
    assert [(r["end_user"], r["outcome"]) for r in rows] == [
        ("alice@example.com", "ok"),
        ("alice@example.com", "rejected"),
        ("bob@example.com", "ok"),
        ("carol", "rejected"),  # a refused request keeps what it claimed (at $0), for the record
    ]
    with serving(ledger, simulator, keys=KEYS, budgets=[PER_USER]) as proxy:
        standing = httpx.get(
            f"{proxy.url}/v1/tokenward/budget",
            headers={"authorization": f"Bearer {WEBUI_KEY}", EMAIL: "alice@example.com"},
        ).json()
        assert standing["end_user"] == "alice@example.com"
        assert [(b["name"], b["spent_usd"], b["remaining_usd"]) for b in standing["budgets"]] == [
            ("chat-user[alice@example.com]", "0.0125175", "0.0074825")
        ]
        again = post(proxy.url, prompt(1000, 1000), "webui", WEBUI_KEY, **{EMAIL: "alice@example.com"})
        assert again.status_code == 429  # her spend this month came back from the ledger
        assert post(proxy.url, prompt(1000, 1000), "webui", WEBUI_KEY, **{EMAIL: "dave@example.com"}).is_success


def test_a_client_chosen_user_name_cannot_forge_reply_headers(tmp_path, simulator):
    record(simulator, "forged", 1007, 1000)
    with serving(tmp_path / "l.duckdb", simulator, keys=KEYS, budgets=[PER_USER]) as proxy:
        forged = {**prompt(1000, 1000), "user": "eve\r\nx-evil: 1"}
        reply = post(proxy.url, forged, "forged", APP_KEY)
        assert reply.status_code == 200 and "x-evil" not in reply.headers
        assert reply.headers["x-tokenward-budget"] == "chat-user[eve%0D%0Ax-evil:%201]"
        assert "chat-user[eve%0D%0Ax-evil:%201];limit_usd=0.02" in reply.headers["x-tokenward-budgets"]


def test_a_template_makes_at_most_its_share_of_budgets():
    now = dt.datetime(2026, 11, 12, tzinfo=dt.UTC)
    guard = BudgetGuard([], now)
    dynamic = DynamicBudgets(guard, PER_USER.to_budgets(), max_per_template=2)
    for user in ("u1", "u2"):
        dynamic.check_capacity({"team": "chat", "end_user": user})
        assert dynamic.scope({"team": "chat", "end_user": user}, now) == [f"chat-user[{user}]"]
    dynamic.check_capacity({"team": "chat", "end_user": "u1"})  # known users go on
    with pytest.raises(RunRefused) as full:
        dynamic.check_capacity({"team": "chat", "end_user": "u3"})
    assert (full.value.status, full.value.code) == (429, "budget_capacity")
    assert dynamic.scope({"team": "other", "end_user": "u3"}, now) == []  # out of the template's scope
    budget = guard.standing({"team": "chat", "end_user": "u1"}, now)[0]
    assert (budget["budget"].scope, budget["remaining_usd"]) == (
        (("end_user", "u1"), ("team", "chat")),
        Decimal("0.02"),
    )


def test_budgets_status_lists_the_largest_per_user_budgets(tmp_path):
    from click.testing import CliRunner

    from tokenward.proxy.cli import main

    from .test_alerts import cost_row, seed

    config = tmp_path / "c.yaml"
    config.write_text(
        "upstreams: [{name: a, base_url: 'http://upstream.invalid'}]\n"
        "budgets: [{name: chat-user, per: end_user, scope: {team: research}, limit_usd: 5, period: month}]\n"
    )
    db = tmp_path / "l.duckdb"
    seed(
        db,
        [
            {**cost_row("a", "2026-11-10T09:00:00+00:00", "1.25"), "end_user": "alice@example.com"},
            {**cost_row("b", "2026-11-11T09:00:00+00:00", "4.00"), "end_user": "bob@example.com"},
            {**cost_row("c", "2026-10-30T09:00:00+00:00", "9.00"), "end_user": "alice@example.com"},  # October's
            {**cost_row("d", "2026-11-11T09:00:00+00:00", "0.50"), "end_user": "carol@example.com"},
        ],
    )
    args = ["budgets", "status", "--config", str(config), "--db", str(db), "--at", "2026-11-12T00:00:00+00:00"]
    result = CliRunner().invoke(main, [*args, "--top", "2"], env={"COLUMNS": "200"})  # the table, as on a wide terminal
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "chat-user[" in line]
    assert len(lines) == 2 and "bob@example.com" in lines[0] and "alice@example.com" in lines[1]
    for figure in ("$4.0000", "$5.00", "80.00", "$1.0000"):
        assert figure in lines[0], figure
    assert "$1.2500" in lines[1] and "25.00" in lines[1]
