"""Pools several keys draw from, and org -> team -> key budgets, enforced together (the tightest binds).

Every request here costs exactly its worst case: 1007 input tokens at $2.50 and 1000 output at
$10.00 per 1M = $0.0125175 (tests/fixtures/field_case_prices.yaml).
"""

from __future__ import annotations

import asyncio
from decimal import Decimal

import httpx
import pytest

from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.config import VirtualKeyConfig
from tokenward.proxy.simulator import RECORD_HEADER

from .agentkit import post, post_many, prompt, record, serving

EACH = Decimal("0.0125175")
KEYS = [
    VirtualKeyConfig(name="a1", key="tw-key-a1-000001", team="alpha", org="acme", pool="dept"),
    VirtualKeyConfig(name="a2", key="tw-key-a2-000002", team="alpha", org="acme", pool="dept"),
    VirtualKeyConfig(name="b1", key="tw-key-b1-000003", team="beta", org="acme", pool="dept"),
    VirtualKeyConfig(name="c1", key="tw-key-c1-000004", team="beta", org="acme"),
]
BUDGETS = [  # room for 20, 12, 8 and 3 requests
    BudgetSettings(name="acme", limit_usd=EACH * 20, scope={"org": "acme"}, period="total", action="block"),
    BudgetSettings(name="dept-pool", limit_usd=EACH * 12, scope={"pool": "dept"}, period="total", action="block"),
    BudgetSettings(name="alpha", limit_usd=EACH * 8, scope={"team": "alpha"}, period="total", action="block"),
    BudgetSettings(name="a1-cap", limit_usd=EACH * 3, scope={"key": "a1"}, period="total", action="block"),
]


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch):
    monkeypatch.setenv("SIM_UPSTREAM_KEY", "sk-upstream")


def test_the_tightest_level_binds_in_turn(tmp_path, simulator):
    record(simulator, "pool", 1007, 1000)
    with serving(tmp_path / "l.duckdb", simulator, keys=KEYS, budgets=BUDGETS) as proxy:

        def until_refused(key: str) -> tuple[int, httpx.Response]:
            for passed in range(30):
                reply = post(proxy.url, prompt(1000, 1000), "pool", key)
                if reply.status_code != 200:
                    return passed, reply
            raise AssertionError("never refused")

        # a1: its own 3; a2: what is left of alpha's 8; b1: of the pool's 12; c1 (no pool): of acme's 20
        for key, passes, binding in (
            ("tw-key-a1-000001", 3, "a1-cap"),
            ("tw-key-a2-000002", 5, "alpha"),
            ("tw-key-b1-000003", 4, "dept-pool"),
            ("tw-key-c1-000004", 8, "acme"),
        ):
            passed, refused = until_refused(key)
            assert (passed, refused.status_code, refused.headers["x-tokenward-budget"]) == (passes, 429, binding)
        # every level is full now; a reply lists each budget in scope, tightest first
        standing = httpx.get(
            f"{proxy.url}/v1/tokenward/budget", headers={"authorization": "Bearer tw-key-a2-000002"}
        ).json()
        assert [(b["name"], b["spent_usd"], b["remaining_usd"]) for b in standing["budgets"]] == [
            ("acme", "0.25035", "0"),
            ("dept-pool", "0.15021", "0"),
            ("alpha", "0.10014", "0"),
        ]
        assert standing["key"] == {
            "name": "a2",
            "id": standing["key"]["id"],
            "team": "alpha",
            "project": None,
            "org": "acme",
            "pool": "dept",
        }
        rows = proxy.rows(24)
    assert {r["principal"]: (r["org"], r["pool"]) for r in rows} == {
        "a1": ("acme", "dept"),
        "a2": ("acme", "dept"),
        "b1": ("acme", "dept"),
        "c1": ("acme", None),
    }


def test_a_hundred_concurrent_requests_from_four_keys_stay_within_every_limit(tmp_path, simulator):
    record(simulator, "pool-burst", 1007, 1000)
    keys = [k.key for k in KEYS]
    requests = [(prompt(1000, 1000), keys[i % 4], {RECORD_HEADER: "pool-burst"}) for i in range(100)]
    with serving(tmp_path / "l.duckdb", simulator, keys=KEYS, budgets=BUDGETS) as proxy:
        replies = asyncio.run(post_many(proxy.url, requests))
        rows = proxy.rows(100)
    assert sum(r.status_code == 200 for r in replies) == 20  # c1 alone could fill acme: it is always full
    assert sum(r.status_code == 429 for r in replies) == 80
    spent = {name: Decimal(0) for name in ("acme", "dept-pool", "alpha", "a1-cap")}
    for row in rows:
        cost = row["cost_usd"] or Decimal(0)
        spent["acme"] += cost
        spent["dept-pool"] += cost if row["pool"] == "dept" else 0
        spent["alpha"] += cost if row["principal"] in ("a1", "a2") else 0
        spent["a1-cap"] += cost if row["principal"] == "a1" else 0
    assert spent["acme"] == EACH * 20
    assert spent["dept-pool"] <= EACH * 12 and spent["alpha"] <= EACH * 8 and spent["a1-cap"] <= EACH * 3


def test_the_budget_endpoint_answers_the_caller_only(tmp_path, simulator):
    budgets = [
        *BUDGETS,
        BudgetSettings(name="alpha-gpt4o", limit_usd=1, scope={"team": "alpha", "model": "gpt-4o"}, period="day"),
        BudgetSettings(name="beta-only", limit_usd=1, scope={"team": "beta"}, period="week"),
    ]
    with serving(tmp_path / "l.duckdb", simulator, keys=KEYS, budgets=budgets) as proxy:
        url = f"{proxy.url}/v1/tokenward/budget"
        unknown = httpx.get(url, headers={"authorization": "Bearer tw-not-a-key"})
        assert unknown.status_code == 401 and "acme" not in unknown.text and "budgets" not in unknown.json()
        assert httpx.get(url).status_code == 401
        mine = httpx.get(url, headers={"authorization": "Bearer tw-key-a1-000001"})
        assert mine.headers["cache-control"] == "no-store"
        views = {b["name"]: b for b in mine.json()["budgets"]}
        assert set(views) == {"acme", "dept-pool", "alpha", "a1-cap", "alpha-gpt4o"}  # not beta's
        assert views["alpha-gpt4o"]["applies"] == "model=gpt-4o" and views["alpha-gpt4o"]["action"] == "alert"
        assert views["alpha-gpt4o"]["resets_at"] is not None and views["acme"]["resets_at"] is None
        assert mine.json()["limited_by"] == "a1-cap" and mine.json()["remaining_usd"] == "0.0375525"
        # nothing of this reached the provider, and no row was written for it
        assert not any("tokenward/budget" in r["path"] for r in simulator.simulator.requests)
        assert proxy.rows() == []
