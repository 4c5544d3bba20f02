"""Run budgets set by header: created on first use, nested under every budget, ended by their ttl, kept across restarts.

Prices (tests/fixtures/field_case_prices.yaml): gpt-4o $2.50 input, $10.00 output per 1M tokens.
``prompt(n, m)`` has n + 7 input tokens and asks for at most m output tokens, so its worst case is
((n + 7) x 2.50 + m x 10.00) / 1M.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import time
from decimal import Decimal

import httpx
import openai
import pytest

from tokenward.pricing.runs import RunHeader, RunPolicy, RunRefused, parse_duration, parse_run_header
from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.config import RunSettings, VirtualKeyConfig
from tokenward.proxy.simulator import RECORD_HEADER

from .agentkit import AGENT_KEY, agent_key, post, post_many, prompt, record, serving

AGENT_ID = "vk-" + hashlib.sha256(AGENT_KEY.encode()).hexdigest()[:12]


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch):
    monkeypatch.setenv("SIM_UPSTREAM_KEY", "sk-upstream")


# --- the header and the policy --------------------------------------------------------------------


def test_run_headers_parse_and_malformed_ones_say_what_is_wrong():
    assert parse_run_header("id=task-42; limit_usd=0.50; ttl=1h") == RunHeader("task-42", Decimal("0.50"), 3600.0)
    assert parse_run_header(' ttl=90s , ID="a/b:c@d" ') == RunHeader("a/b:c@d", None, 90.0)
    assert parse_duration("1.5h") == 5400.0 and parse_duration("2d") == 172800.0 and parse_duration(30) == 30.0
    for header, says in (
        ("limit_usd=1", "needs id="),
        ("id=a b", "needs id="),
        ("id=" + "x" * 129, "needs id="),
        ("id=a; limit_usd=-1", "not a positive amount"),
        ("id=a; limit_usd=NaN", "not a positive amount"),
        ("id=a; limit_usd=1e30", "not a positive amount"),
        ("id=a; ttl=forever", "not a duration"),
        ("id=a; ttl=0s", "not a duration"),
        ("id=a; id=b", "gives id twice"),
        ("id=a; budget=5", "is not id="),
    ):
        with pytest.raises(RunRefused) as refused:
            parse_run_header(header)
        assert refused.value.status == 400 and refused.value.code == "invalid_run" and says in refused.value.message


def test_a_run_policy_bounds_what_a_header_may_ask_for():
    policy = RunPolicy(max_limit_usd=Decimal("1.00"), default_ttl_s=600, max_ttl_s=3600, where="virtual_keys[0].runs")
    assert policy.settle(None) is None
    assert policy.settle(RunHeader("r", Decimal("1.00"))) == RunHeader("r", Decimal("1.00"), 600)
    cases = [
        (policy, RunHeader("r", Decimal("1.01")), 403, "run_limit_too_high"),
        (policy, RunHeader("r", Decimal("0.5"), 7200), 403, "run_ttl_too_long"),
        (policy, RunHeader("r"), 400, "invalid_run"),  # no limit, no default
        (RunPolicy(mode="forbidden"), RunHeader("r", Decimal(1)), 403, "run_not_allowed"),
        (RunPolicy(mode="required"), None, 403, "run_required"),
    ]
    for rules, header, status, code in cases:
        with pytest.raises(RunRefused) as refused:
            rules.settle(header)
        assert (refused.value.status, refused.value.code) == (status, code)
    assert RunPolicy(default_limit_usd=Decimal("0.25")).settle(RunHeader("r")) == RunHeader("r", Decimal("0.25"), 3600)


# --- through the proxy ------------------------------------------------------------------------------


def test_a_three_step_agent_loop_stops_exactly_before_the_step_that_would_exceed_its_run(tmp_path, simulator):
    # run cap $0.045. Step 1: worst (1007 x 2.50 + 1000 x 10) / 1M = $0.0125175, costs (1007 x 2.50 + 400 x 10)
    # / 1M = $0.0065175. Step 2: worst $0.0150175 (2007 in, 1000 out), costs $0.0130175 (800 out); spent
    # $0.019535. Step 3: worst (3007 x 2.50 + 2000 x 10) / 1M = $0.0275175 > $0.045 - $0.019535 = $0.025465.
    record(simulator, "loop-1", 1007, 400)
    record(simulator, "loop-2", 2007, 800)
    record(simulator, "loop-3", 3007, 1500)
    team = BudgetSettings(name="research", limit_usd=50, scope={"team": "research"}, period="month", action="block")
    with serving(tmp_path / "l.duckdb", simulator, budgets=[team]) as proxy:
        client = openai.OpenAI(
            base_url=f"{proxy.url}/v1",
            api_key=AGENT_KEY,
            max_retries=2,
            default_headers={"X-Tokenward-Run": "id=task-42; limit_usd=0.045; ttl=1h"},
        )
        steps = [(prompt(1000, 1000), "loop-1"), (prompt(2000, 1000), "loop-2"), (prompt(3000, 2000), "loop-3")]
        costs, left_before, stopped = [], [], None
        for request, name in steps:
            standing = client.get("/tokenward/budget", cast_to=object)
            run = next(b for b in standing["budgets"] if b["name"] == f"run:{AGENT_ID}:task-42")
            left_before.append(run["remaining_usd"])
            try:
                raw = client.chat.completions.with_raw_response.create(**request, extra_headers={RECORD_HEADER: name})
            except openai.RateLimitError as exc:
                stopped = exc
                break
            costs.append(raw.headers["x-tokenward-cost-usd"])
        assert costs == ["0.0065175", "0.0130175"]
        assert left_before == ["0.045", "0.0384825", "0.025465"]
        assert stopped is not None and stopped.code == "budget_exceeded"
        reply = stopped.response
        assert reply.headers["x-tokenward-budget"] == f"run:{AGENT_ID}:task-42"
        assert reply.headers["x-tokenward-budget-remaining-usd"] == "0.025465"
        assert reply.headers["x-should-retry"] == "false"
        assert "up to $0.0275175" in stopped.message and "It does not reset." in stopped.message
        assert standing["limited_by"] == f"run:{AGENT_ID}:task-42" and standing["remaining_usd"] == "0.025465"
        assert standing["run"]["id"] == "task-42" and standing["run"]["limit_usd"] == "0.045"
        rows = proxy.rows(3)
    # the upstream saw the first two steps only; every row names the run
    sent = [r["headers"].get(RECORD_HEADER) for r in simulator.simulator.requests if r["path"].startswith("/test/")]
    assert "loop-3" not in sent and {"loop-1", "loop-2"} <= set(sent)
    assert [(r["outcome"], r["run_id"], r["cost_usd"]) for r in rows] == [
        ("ok", "task-42", Decimal("0.0065175")),
        ("ok", "task-42", Decimal("0.0130175")),
        ("rejected", "task-42", Decimal(0)),
    ]
    assert all("x-tokenward-run" not in r["headers"] for r in simulator.simulator.requests)


def test_a_runs_spend_and_age_survive_a_restart(tmp_path, simulator):
    # cap $0.02; each step: worst $0.0125175, costs $0.0065175. Before the restart: one step.
    # After: step 2 fits ($0.0065175 + $0.0125175 = $0.019035), step 3 does not ($0.013035 + $0.0125175).
    # Had the restart forgotten the first step, step 3 would fit ($0.0065175 + $0.0125175).
    record(simulator, "restart", 1007, 400)
    header = {"x-tokenward-run": "id=nightly; limit_usd=0.02; ttl=2h"}
    ledger = tmp_path / "l.duckdb"
    with serving(ledger, simulator) as proxy:
        assert post(proxy.url, prompt(1000, 1000), "restart", **header).status_code == 200
        first = proxy.rows(1)[0]["started_at"]
    with serving(ledger, simulator) as proxy:
        standing = httpx.get(
            f"{proxy.url}/v1/tokenward/budget", headers={"authorization": f"Bearer {AGENT_KEY}", **header}
        ).json()
        run = next(b for b in standing["budgets"] if b["group"] == "run")
        assert (run["spent_usd"], run["remaining_usd"], run["held_usd"]) == ("0.0065175", "0.0134825", "0")
        assert dt.datetime.fromisoformat(standing["run"]["started_at"]) == first  # its ttl counts from step 1
        assert dt.datetime.fromisoformat(standing["run"]["expires_at"]) == first + dt.timedelta(hours=2)
        assert post(proxy.url, prompt(1000, 1000), "restart", **header).status_code == 200
        refused = post(proxy.url, prompt(1000, 1000), "restart", **header)
        assert refused.status_code == 429 and refused.headers["x-tokenward-budget-remaining-usd"] == "0.006965"
        rows = proxy.rows(3)
    assert sum(r["cost_usd"] for r in rows) == Decimal("0.013035") <= Decimal("0.02")


def test_concurrent_steps_of_one_run_cannot_overshoot_it(tmp_path, simulator):
    # each request costs exactly its worst case, $0.0125175; the run holds exactly five
    record(simulator, "burst", 1007, 1000)
    header = {"x-tokenward-run": "id=burst; limit_usd=0.0625875", RECORD_HEADER: "burst"}
    with serving(tmp_path / "l.duckdb", simulator) as proxy:
        replies = asyncio.run(post_many(proxy.url, [(prompt(1000, 1000), AGENT_KEY, header)] * 20))
        assert sorted(r.status_code for r in replies) == [200] * 5 + [429] * 15
        rows = proxy.rows(20)
    assert sum(r["cost_usd"] for r in rows) == Decimal("0.0625875")


def test_a_hostile_key_holder_cannot_widen_anything_with_a_run_header(tmp_path, simulator):
    record(simulator, "hostile", 1007, 400)  # worst $0.0125175, costs $0.0065175
    keys = [
        agent_key(runs=RunSettings(max_limit_usd="1.00", max_ttl="1h", max_active=2)),
        VirtualKeyConfig(name="other", key="tw-other-key-0002", team="research", runs=RunSettings(mode="forbidden")),
        VirtualKeyConfig(name="bot", key="tw-bot-key-00003", team="ops", runs=RunSettings(mode="required")),
    ]
    # the agent key may spend $0.01 in all: less than one worst case
    budgets = [BudgetSettings(name="agent-cap", limit_usd="0.01", scope={"key": "agent"}, action="block")]
    with serving(tmp_path / "l.duckdb", simulator, keys=keys, budgets=budgets) as proxy:

        def send(key: str, run: str | None) -> httpx.Response:
            return post(proxy.url, prompt(1000, 1000), "hostile", key, **({"x-tokenward-run": run} if run else {}))

        # a run never widens the key's budget: the key's $0.01 still binds under a $1.00 run
        refused = send(AGENT_KEY, "id=wide; limit_usd=1.00")
        assert refused.status_code == 429 and refused.headers["x-tokenward-budget"] == "agent-cap"
        for key, run, status, code in (
            (AGENT_KEY, "id=a; limit_usd=5", 403, "run_limit_too_high"),
            (AGENT_KEY, "id=a; limit_usd=0.5; ttl=2h", 403, "run_ttl_too_long"),
            (AGENT_KEY, "id=a; limit_usd=oops", 400, "invalid_run"),
            ("tw-other-key-0002", "id=a; limit_usd=0.5", 403, "run_not_allowed"),
            ("tw-bot-key-00003", None, 403, "run_required"),
        ):
            reply = send(key, run)
            assert (reply.status_code, reply.json()["error"]["code"]) == (status, code), run
            assert reply.headers["x-should-retry"] == "false"
        assert send("tw-other-key-0002", None).status_code == 200  # no run: as before
        # the same run id under another key is another run, with its own cap
        assert send("tw-bot-key-00003", "id=shared; limit_usd=0.02").status_code == 200
        assert send("tw-bot-key-00003", "id=shared; limit_usd=0.03").json()["error"]["code"] == "run_limit_raised"
        # lowered to $0.015: $0.0065175 spent + $0.0125175 no longer fits
        lowered = send("tw-bot-key-00003", "id=shared; limit_usd=0.015")
        assert lowered.status_code == 429 and lowered.headers["x-tokenward-budget-remaining-usd"] == "0.0084825"
        # the agent key has two live runs at most (the refused "wide" one counts: it was created)
        assert send(AGENT_KEY, "id=second; limit_usd=0.5").status_code == 429  # by agent-cap, but created
        third = send(AGENT_KEY, "id=third; limit_usd=0.5")
        assert (third.status_code, third.json()["error"]["code"]) == (429, "too_many_runs")
        rows = proxy.rows(12)
    assert [r["outcome"] for r in rows].count("rejected") == 9
    assert all(r["run_id"] is None for r in rows if r["principal"] == "other")


def test_a_run_ends_after_its_ttl(tmp_path, simulator):
    record(simulator, "ttl", 1007, 400)
    header = {"x-tokenward-run": "id=short; limit_usd=1; ttl=1s"}
    with serving(tmp_path / "l.duckdb", simulator) as proxy:
        assert post(proxy.url, prompt(1000, 1000), "ttl", **header).status_code == 200
        time.sleep(1.1)
        ended = post(proxy.url, prompt(1000, 1000), "ttl", **header)
        assert (ended.status_code, ended.json()["error"]["code"]) == (409, "run_ended")
        assert ended.headers["x-should-retry"] == "false"
        # a new run goes on
        assert post(proxy.url, prompt(1000, 1000), "ttl", **{"x-tokenward-run": "id=next; limit_usd=1"}).is_success
        dynamic = proxy.app.state.dynamic
        assert not proxy.app.state.guard.has_book(f"run:{AGENT_ID}:short")  # its books are closed
        assert dynamic.run_of(AGENT_ID, "short").ended(time.time())


def test_a_streamed_reply_carries_the_budget_standing_with_its_worst_case_held(tmp_path, simulator):
    # the headers of a stream leave before its cost is known: the run's $0.045 less the $0.0125175 held
    with serving(tmp_path / "l.duckdb", simulator) as proxy:
        headers = {"authorization": f"Bearer {AGENT_KEY}", "x-tokenward-run": "id=stream; limit_usd=0.045"}
        with httpx.stream(
            "POST", f"{proxy.url}/v1/chat/completions", json={**prompt(1000, 1000), "stream": True}, headers=headers
        ) as reply:
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
            assert reply.headers["x-tokenward-budget"] == f"run:{AGENT_ID}:stream"
            assert reply.headers["x-tokenward-budget-remaining-usd"] == "0.0324825"
            assert "x-tokenward-cost-usd" not in reply.headers
            assert b"[DONE]" in b"".join(reply.iter_bytes())
        (row,) = proxy.rows(1)
    assert row["run_id"] == "stream" and row["reserved_usd"] == Decimal("0.0125175") and row["cost_usd"] > 0


def test_a_second_proxy_on_the_ledger_serves_no_runs(tmp_path, simulator):
    # without blocking budgets two proxies may share a DuckDB ledger; the runs stay with the one holding its lock
    record(simulator, "two", 1007, 400)
    header = {"x-tokenward-run": "id=shared; limit_usd=1"}
    ledger = tmp_path / "l.duckdb"
    with serving(ledger, simulator) as first, serving(ledger, simulator) as second:
        assert post(first.url, prompt(1000, 1000), "two", **header).status_code == 200
        refused = post(second.url, prompt(1000, 1000), "two", **header)
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "runs_unavailable")
        assert post(second.url, prompt(1000, 1000), "two").status_code == 200  # no run: served

