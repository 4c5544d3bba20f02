"""Budget periods in named time zones, and hard limits that concurrency cannot overshoot."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from tokenward.pricing.budgets import Budget, Period, evaluate
from tokenward.pricing.catalog import load_catalog
from tokenward.pricing.settings import BudgetSettings, GuardSettings
from tokenward.proxy.config import UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.keys import key_id
from tokenward.proxy.simulator import FAULT_HEADER, RECORD_HEADER, Recording
from tokenward.reports.ledger import write_rows
from tokenward.reports.queries import Selection, spend_report

from .servers import post_then_leave
from .test_ledger import make_row

PRICES = Path(__file__).parent / "fixtures" / "field_case_prices.yaml"
UTC = dt.UTC


def at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text)


def test_b34_daily_window_resets_at_local_midnight_not_utc():
    period = Period("day", "Asia/Shanghai")
    # 23:50 local (15:50Z) is still the old day; 00:10 local (16:10Z) is the new one
    assert period.window(at("2026-11-29T15:50:00+00:00")) == (
        at("2026-11-28T16:00:00+00:00"),
        at("2026-11-29T16:00:00+00:00"),
    )
    assert period.window(at("2026-11-29T16:10:00+00:00")) == (
        at("2026-11-29T16:00:00+00:00"),
        at("2026-11-30T16:00:00+00:00"),
    )
    budget = Budget("daily", Decimal(100), period=period, action="block")
    # $100 spent by 21:30 local: at 23:50 local the day is used up; at 00:10 the new window starts at 0
    assert evaluate(budget, Decimal(100), at("2026-11-29T15:50:00+00:00")).remaining == 0
    assert evaluate(budget, Decimal(0), at("2026-11-29T16:10:00+00:00")).start == at("2026-11-29T16:00:00+00:00")


def test_days_across_dst_changes_are_23_and_25_hours():
    new_york = Period("day", "America/New_York")
    spring_start, spring_end = new_york.window(at("2026-03-08T12:00:00+00:00"))
    assert (spring_start, spring_end) == (at("2026-03-08T05:00:00+00:00"), at("2026-03-09T04:00:00+00:00"))
    assert spring_end - spring_start == dt.timedelta(hours=23)
    fall_start, fall_end = new_york.window(at("2026-11-01T12:00:00+00:00"))
    assert (fall_start, fall_end) == (at("2026-11-01T04:00:00+00:00"), at("2026-11-02T05:00:00+00:00"))
    assert fall_end - fall_start == dt.timedelta(hours=25)


def test_weeks_months_totals_and_rolling_windows():
    paris = "Europe/Paris"
    # a Sunday evening in Paris belongs to the ISO week that began on Monday 2026-11-23
    assert Period("week", paris).window(at("2026-11-29T20:00:00+00:00"))[0] == at("2026-11-22T23:00:00+00:00")
    # month end and a leap-free February: January 31 23:30 local is still January
    jan = Period("month", paris).window(at("2027-01-31T22:30:00+00:00"))
    assert jan == (at("2026-12-31T23:00:00+00:00"), at("2027-01-31T23:00:00+00:00"))
    feb = Period("month", paris).window(at("2027-02-15T00:00:00+00:00"))
    assert feb[1] - feb[0] == dt.timedelta(days=28)
    assert Period("total").window(at("2026-11-29T00:00:00+00:00"))[0].year == 1970
    rolling = Period("rolling", rolling_hours=720)  # a 30-day window that moves with time
    start, end = rolling.window(at("2026-11-29T12:00:00+00:00"))
    assert (start, end) == (at("2026-10-30T12:00:00+00:00"), at("2026-11-29T12:00:00+00:00"))
    with pytest.raises(ValueError, match="rolling_hours"):
        Period("rolling")
    with pytest.raises(ValueError, match="unknown time zone"):
        Period("day", "Mars/Olympus")


def test_thresholds_and_forecast():
    budget = Budget("m", Decimal(100), period=Period("month"), thresholds=(50, 80, 100))
    # 10 days into a 30-day month, $40 spent: 40 %, 50 % not crossed; forecast $120 over the limit
    status = evaluate(budget, Decimal(40), at("2026-11-11T00:00:00+00:00"))
    assert (status.percent, status.crossed, status.forecast, status.forecast_exceeds) == (
        Decimal("40.00"),
        (),
        Decimal("120.000000"),
        True,
    )
    assert evaluate(budget, Decimal(80), at("2026-11-20T00:00:00+00:00")).crossed == (50, 80)
    # 2 days in (under a tenth of the month), $10 projects to $150, but that is too early to alert
    early = evaluate(budget, Decimal(10), at("2026-11-03T00:00:00+00:00"))
    assert (early.forecast, early.forecast_exceeds) == (Decimal("150.000000"), False)
    at_limit = evaluate(budget, Decimal(10), at("2026-11-04T00:00:00+00:00"))  # 3 days: $100, not past it
    assert (at_limit.forecast, at_limit.forecast_exceeds) == (Decimal("100.000000"), False)
    assert evaluate(budget, Decimal(12), at("2026-11-04T00:00:00+00:00")).forecast_exceeds is True  # $120


def test_b35_spend_stays_until_the_window_ends(tmp_path):
    """A 30-day rolling budget's spend is what the ledger holds in the window: no reset job wipes it."""
    from tokenward.reports.budget_check import status_of
    from tokenward.reports.ledger import open_ledger
    from tokenward.reports.ledger.spend import DuckSpend

    path = tmp_path / "l.duckdb"
    created = at("2026-11-29T10:00:00+00:00").timestamp()
    write_rows(
        path,
        [
            make_row(
                f"c{i}", started_at=created + i, ended_at=created + i, end_user="cust-0042", cost_usd=Decimal(cost)
            )
            for i, cost in enumerate(("1.00", "1.10", "1.00"))
        ],
    )
    budget = BudgetSettings(
        name="cust-0042", limit_usd=20, scope={"end_user": "cust-0042"}, period="rolling", rolling_hours=720
    ).to_budget()
    conn = open_ledger(path, read_only=True)
    try:
        spend = DuckSpend(conn)
        assert status_of(spend, budget, at("2026-11-29T10:10:00+00:00")).spent == Decimal("3.10")
        assert status_of(spend, budget, at("2026-12-28T09:00:00+00:00")).spent == Decimal("3.10")
        assert status_of(spend, budget, at("2026-12-29T10:00:05+00:00")).spent == Decimal(0)
    finally:
        conn.close()


# --- hard limits through the real proxy ---------------------------------------------------------


def long_prompt_request(n_tokens: int, max_tokens: int) -> dict:
    """A chat request whose input is n_tokens + 7 tokens in o200k_base: "hello" + (n-1) x " hello"
    (one token each), 1 for the role "user", 3 per message, 3 for the reply's priming."""
    return {
        "model": "gpt-4o",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hello" + " hello" * (n_tokens - 1)}],
    }


def register(simulator, name: str, request: dict, prompt_tokens: int, completion_tokens: int) -> None:
    body = {
        "id": name,
        "object": "chat.completion",
        "model": "gpt-4o",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    simulator.simulator.add(
        Recording(
            name,
            "test",
            "openai",
            "chat_completions",
            False,
            {"body": request},
            {"status": 200, "content_type": "application/json", "body": body},
            None,
        )
    )


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch):
    monkeypatch.setenv("SIM_UPSTREAM_KEY", "sk-upstream")


EXACT_COUNT = GuardSettings(input_margin=1, input_margin_tokens=0)
"""No input margin: these tests bound requests by their counted text alone, to check the arithmetic
(the margins are tested in test_bound_is_a_bound.py)."""


def budget_proxy(start_proxy, simulator, budgets, *, seed_rows=(), **extra):
    factory = start_proxy
    extra.setdefault("guard", EXACT_COUNT)
    ledger = factory.directory / f"ledger{len(factory.contexts)}.duckdb"
    if seed_rows:
        write_rows(ledger, list(seed_rows))
    upstream = UpstreamConfig(
        name="test", base_url=f"{simulator.url}/test/v1", default=True, provider="test", api_key_env="SIM_UPSTREAM_KEY"
    )
    return factory(
        upstreams=[upstream],
        auth="virtual_keys",
        keys=[VirtualKeyConfig(name="agent", key="tw-agent-key-0001", team="research")],
        catalog=load_catalog([PRICES], builtin=False),
        budgets=budgets,
        **extra,
    )


async def send_many(url: str, request: dict, record: str, count: int) -> list[httpx.Response]:
    headers = {"authorization": "Bearer tw-agent-key-0001", RECORD_HEADER: record, FAULT_HEADER: "wait:300"}
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=count)) as client:
        return await asyncio.gather(
            *(client.post(f"{url}/v1/chat/completions", json=request, headers=headers) for _ in range(count))
        )


def test_b32_concurrent_requests_cannot_all_pass_on_the_same_spend(start_proxy, simulator):
    # $1.00 budget, $0.90 already spent; each request: 3000-token document + max_tokens 2000
    # worst case: (3007 * 2.50 + 2000 * 10.00) / 1M = $0.0275175; 0.90 + 3 x 0.0275175 <= 1.00 < + 4 x
    request = long_prompt_request(3000, 2000)
    register(simulator, "b32", request, prompt_tokens=3007, completion_tokens=1750)
    seed = make_row(
        "earlier",
        started_at=dt.datetime.now(UTC).timestamp() - 60,
        ended_at=dt.datetime.now(UTC).timestamp(),
        principal="agent",
        team="research",
        cost_usd=Decimal("0.90"),
    )
    budget = BudgetSettings(
        name="research-daily", limit_usd="1.00", scope={"team": "research"}, period="day", action="block"
    )
    proxy = budget_proxy(start_proxy, simulator, [budget], seed_rows=[seed])
    replies = asyncio.run(send_many(proxy.url, request, "b32", 8))
    statuses = sorted(r.status_code for r in replies)
    assert statuses == [200] * 3 + [429] * 5
    refusal = next(r for r in replies if r.status_code == 429)
    error = refusal.json()["error"]
    assert (error["code"], error["type"]) == ("budget_exceeded", "insufficient_quota")
    assert "research-daily" in error["message"] and refusal.headers["x-tokenward-budget"] == "research-daily"
    rows = proxy.rows(9)
    admitted = [r for r in rows if r["outcome"] == "ok" and r["request_id"] != "earlier"]
    # actual cost each: 3007 * 2.50 + 1750 * 10.00 = 25017.5 -> $0.0250175; total 0.90 + 3 x that = $0.9750525
    assert [r["cost_usd"] for r in admitted] == [Decimal("0.0250175")] * 3
    assert sum(r["cost_usd"] for r in rows if r["cost_usd"]) == Decimal("0.9750525")
    assert sum(r["outcome"] == "rejected" for r in rows) == 5
    ok = next(r for r in replies if r.status_code == 200)
    # after the three settle: 1.00 - 0.9750525 left (the header was computed while they were in flight)
    assert ok.headers["x-tokenward-budget"] == "research-daily"


def test_hundred_concurrent_requests_against_room_for_ten(start_proxy, simulator):
    # each request costs exactly its worst case: 1007 input tokens at $2.50 + 1000 output at $10.00
    # = (2517.5 + 10000) / 1M = $0.0125175; the budget holds exactly ten of them
    request = long_prompt_request(1000, 1000)
    register(simulator, "hundred", request, prompt_tokens=1007, completion_tokens=1000)
    budget = BudgetSettings(name="exactly-ten", limit_usd="0.125175", period="total", action="block")
    proxy = budget_proxy(start_proxy, simulator, [budget])
    replies = asyncio.run(send_many(proxy.url, request, "hundred", 100))
    assert sum(r.status_code == 200 for r in replies) == 10
    assert sum(r.status_code == 429 for r in replies) == 90
    rows = proxy.rows(100)
    spent = sum(r["cost_usd"] for r in rows if r["cost_usd"])
    assert spent == Decimal("0.125175")  # never above the limit, and every affordable request went through
    # once the ten have settled, nothing is left: one more is refused
    late = asyncio.run(send_many(proxy.url, request, "hundred", 1))[0]
    assert late.status_code == 429 and late.headers["x-tokenward-budget-remaining-usd"] == "0"


def test_sdk_does_not_retry_a_budget_refusal(start_proxy, simulator):
    import openai

    request = long_prompt_request(10, 100)
    register(simulator, "sdk-refused", request, prompt_tokens=17, completion_tokens=100)
    now = dt.datetime.now(UTC)
    seed = make_row(
        "spent",
        started_at=now.timestamp() - 5,
        ended_at=now.timestamp() - 4,
        principal="agent",
        team="research",
        cost_usd=Decimal("2.00"),
    )
    budget = BudgetSettings(name="daily-2", limit_usd=2, period="day", timezone="Asia/Tokyo", action="block")
    proxy = budget_proxy(start_proxy, simulator, [budget], seed_rows=[seed])
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="tw-agent-key-0001", max_retries=2)
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(**request, extra_headers={RECORD_HEADER: "sdk-refused"})
    reply = refused.value.response
    assert refused.value.code == "budget_exceeded" and reply.headers["x-should-retry"] == "false"
    # retry-after: the seconds until the next midnight in Tokyo (15:00 UTC)
    reset = (now + dt.timedelta(hours=9)).replace(hour=0, minute=0, second=0, microsecond=0) + dt.timedelta(days=1)
    expected = (reset - dt.timedelta(hours=9) - now).total_seconds()
    assert abs(int(reply.headers["retry-after"]) - expected) < 5
    assert "It resets at " in refused.value.message and "+09:00" in refused.value.message
    rows = proxy.rows(2)
    assert [(r["request_id"] == "spent", r["outcome"]) for r in rows] == [(True, "ok"), (False, "rejected")]


def test_worst_case_prices_input_at_the_dearest_rate_it_could_be_billed_at():
    from tokenward.pricing.quote import worst_case

    catalog = load_catalog([PRICES], builtin=False)
    when = at("2026-11-29T12:00:00+00:00")
    # claude-sonnet-4: input 3.00, 5-minute write 3.75, 1-hour write 6.00, output 15.00 per 1M.
    # 1000 input tokens could all be 1-hour cache writes: 1000 x 6.00 + 100 x 15.00 = 7500 -> $0.0075
    bound = worst_case(
        catalog, model="claude-sonnet-4", provider="test", at=when, input_tokens=1000, max_output_tokens=100
    )
    assert bound == Decimal("0.0075")
    # gpt-4o-audio-preview: 500 text tokens x 2.50 + 500 audio x 40.00 = 21250; audio reply 100 x 80.00 = 8000
    audio = worst_case(
        catalog,
        model="gpt-4o-audio-preview",
        provider="test",
        at=when,
        input_tokens=1000,
        max_output_tokens=100,
        audio_input_tokens=500,
        audio_output=True,
    )
    assert audio == Decimal("0.02925")


def test_request_content_the_tokenizer_cannot_count():
    from tokenward.proxy.bounds import scan

    body = {
        "model": "gpt-4o",
        "modalities": ["text", "audio"],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    {"type": "input_audio", "input_audio": {"data": "A" * 40000, "format": "mp3"}},
                ],
            }
        ],
    }
    found = scan(body)
    # 40000 base64 characters are 30000 bytes: at most 300 tokens of audio (1 per 100 bytes)
    assert (found.images, found.audio_tokens, found.files, found.audio_output, found.unbounded) == (
        2,
        300,
        0,
        True,
        False,
    )
    stored = scan({"model": "gpt-5", "previous_response_id": "resp_1", "input": "and then?"})
    assert (
        stored.unbounded
        and scan(
            {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-abc"}}]}]}
        ).unbounded
    )
    anthropic = scan(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                        {
                            "type": "document",
                            "source": {"type": "base64", "media_type": "application/pdf", "data": "AAAA"},
                        },
                    ],
                }
            ]
        }
    )
    assert (anthropic.images, anthropic.files) == (1, 1)


def test_tools_the_provider_runs_itself_leave_a_request_unbounded():
    from tokenward.proxy.bounds import scan

    # each call adds a fee ($0.01 a search at OpenAI and Anthropic) and the tokens it found, as often as
    # the model likes: nothing in the body bounds them
    served = [
        {"model": "gpt-5", "input": "news?", "tools": [{"type": "web_search"}]},
        {"model": "gpt-5", "input": "news?", "tools": [{"type": "web_search_preview_2025_03_11"}]},
        {"model": "gpt-5", "input": "q", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]},
        {"model": "gpt-5", "input": "q", "tools": [{"type": "mcp", "server_url": "https://x.example"}]},
        {"model": "gpt-5", "input": "q", "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
        {"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [],
         "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]},
        {"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [], "tools": [{"type": "web_fetch_20250910"}]},
        {"model": "gpt-4o-search-preview", "messages": [], "web_search_options": {}},
        {"model": "openai/gpt-4o", "messages": [], "plugins": [{"id": "web"}]},
        {"model": "openai/gpt-4o:online", "messages": []},
    ]  # fmt: skip
    assert [scan(body).server_tools for body in served] == [1] * len(served)
    assert all(scan(body).unbounded for body in served)
    client_run = {
        "model": "gpt-5",
        "input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}],  # history, not a tool
        "tools": [
            {"type": "function", "name": "web_search_local", "parameters": {}},
            {"type": "custom", "name": "mcp"},
        ],
    }
    assert (scan(client_run).server_tools, scan(client_run).unbounded) == (0, False)


def image_request(n_tokens: int, max_tokens: int) -> dict:
    """n_tokens of text ("hello" x n, one token each) and one image; 7 tokens of chat overhead."""
    return {
        "model": "gpt-4o",
        "max_tokens": max_tokens,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hello" + " hello" * (n_tokens - 1)},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                ],
            }
        ],
    }


def test_images_count_toward_the_worst_case(start_proxy, simulator):
    # text 10 + 7 overhead + 3000 per image (guard.image_tokens) = 3017 input; worst case
    # (3017 x 2.50 + 10 x 10.00) / 1M = $0.0076425; the $0.023 budget holds three (0.0229275), not four.
    # Each really costs (1113 x 2.50 + 10 x 10.00) / 1M = $0.0028825: without the image allowance
    # (17 input tokens: $0.0001425 each) all eight would have been let through: $0.02306, over the limit
    request = image_request(10, 10)
    register(simulator, "vision", request, prompt_tokens=1113, completion_tokens=10)
    budget = BudgetSettings(name="vision", limit_usd="0.023", period="total", action="block")
    proxy = budget_proxy(start_proxy, simulator, [budget])
    replies = asyncio.run(send_many(proxy.url, request, "vision", 8))
    assert sorted(r.status_code for r in replies) == [200] * 3 + [429] * 5
    rows = proxy.rows(8)
    assert sum(r["cost_usd"] for r in rows if r["cost_usd"]) == Decimal("0.0086475")


def test_a_request_that_cannot_be_bounded_runs_alone(start_proxy, simulator):
    request = {
        "model": "gpt-4o",
        "max_tokens": 10,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "summarise"}, {"type": "file", "file": {"file_id": "file-abc"}}],
            }
        ],
    }
    register(simulator, "stored-file", request, prompt_tokens=5000, completion_tokens=10)
    budget = BudgetSettings(name="files", limit_usd=1, period="total", action="block")
    proxy = budget_proxy(start_proxy, simulator, [budget])
    agent = key_id(hashlib.sha256(b"tw-agent-key-0001").hexdigest())  # the file is the key's own upload
    proxy.app.state.ledger.state.record_objects([("file-abc", "file", agent, dt.datetime.now(dt.UTC))])
    first, second = asyncio.run(send_many(proxy.url, request, "stored-file", 2))
    # the first one holds everything left while it runs; the other is refused, saying why
    assert sorted([first.status_code, second.status_code]) == [200, 429]
    refused = first if first.status_code == 429 else second
    assert "whose cost cannot be bounded" in refused.json()["error"]["message"]
    proxy.rows(2)
    # once it has settled at (5000 x 2.50 + 10 x 10.00) / 1M = $0.0126, the next one may run
    again = asyncio.run(send_many(proxy.url, request, "stored-file", 1))[0]
    assert again.status_code == 200
    # a whole reply's headers are made once it has settled: $1 - 2 x $0.0126 left, and what it cost
    assert again.headers["x-tokenward-budget-remaining-usd"] == "0.9748"
    assert again.headers["x-tokenward-cost-usd"] == "0.0126"
    spent = sum(r["cost_usd"] for r in proxy.rows(3) if r["cost_usd"])
    assert spent == Decimal("0.0252")


def test_reservations_are_released_on_errors(start_proxy, simulator, sample):
    request = long_prompt_request(10, 100)
    register(simulator, "released", request, prompt_tokens=17, completion_tokens=100)
    # worst case (17 * 2.50 + 100 * 10.00) / 1M = $0.0010425; room for one at a time
    budget = BudgetSettings(name="one-at-a-time", limit_usd="0.0015", period="total", action="block")
    proxy = budget_proxy(start_proxy, simulator, [budget])
    headers = {"authorization": "Bearer tw-agent-key-0001", RECORD_HEADER: "released"}
    failed = httpx.post(
        f"{proxy.url}/v1/chat/completions", json=request, headers={**headers, FAULT_HEADER: "flaky:1:503"}
    )
    assert failed.status_code == 503  # the upstream refused: nothing billed, reservation released
    ok = httpx.post(f"{proxy.url}/v1/chat/completions", json=request, headers=headers)
    assert ok.status_code == 200
    # 17 * 2.50 + 100 * 10.00 = 1042.5 -> $0.0010425 spent; $0.0004575 left: the next worst case does not fit
    assert ok.headers["x-tokenward-budget-remaining-usd"] in ("0.0004575", "0.0015")
    proxy.rows(2)
    again = httpx.post(f"{proxy.url}/v1/chat/completions", json=request, headers=headers)
    assert again.status_code == 429


def test_attribution_from_keys_headers_and_the_user_field(start_proxy, simulator):
    request = dict(long_prompt_request(5, 10), user="customer-7")
    register(simulator, "attrib", request, prompt_tokens=12, completion_tokens=10)
    budget = BudgetSettings(name="tagged", limit_usd=10, scope={"tag": "nightly"}, period="month")
    proxy = budget_proxy(start_proxy, simulator, [budget])
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=request,
        headers={
            "authorization": "Bearer tw-agent-key-0001",
            RECORD_HEADER: "attrib",
            "x-tokenward-tags": "nightly, batch-7",
            "x-tokenward-session": "run-42",
        },
    )
    assert reply.status_code == 200 and reply.headers["x-tokenward-budget"] == "tagged"
    sent = simulator.simulator.requests[-1]["headers"]
    assert "x-tokenward-tags" not in sent and "x-tokenward-session" not in sent
    (row,) = proxy.rows(1)
    assert (row["principal"], row["team"], row["end_user"], row["tags"], row["session_id"]) == (
        "agent",
        "research",
        "customer-7",
        ["batch-7", "nightly"],
        "run-42",
    )
    # the budget in scope of the tag counts it: 12 * 2.50 + 10 * 10.00 = 130 -> $0.00013
    snapshot = next(s for s in proxy.app.state.guard.snapshot(dt.datetime.now(UTC)) if s["budget"] == "tagged")
    assert snapshot["spent_usd"] == Decimal("0.00013")


def test_budget_config_is_validated(tmp_path):
    from tokenward.proxy.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    cases = {
        "budgets: [{name: b, limit_usd: 0}]": "limit_usd must be a positive amount of USD",
        "budgets: [{name: b, limit_usd: abc}]": r"Invalid decimal string - at `\$.budgets\[0\].limit_usd`",
        "budgets: [{name: b, limit_usd: .inf}]": "limit_usd must be a positive amount of USD",
        "budgets: [{name: b, limit_usd: '1e999999999'}]": "out of range",
        "budgets: [{name: '', limit_usd: 5}]": "a budget needs a name",
        "alerts: {evaluate_every_s: -1}": "evaluate_every_s",
        "alerts: {webhooks: [{name: h}]}": "give url or url_env",
        "alerts: {webhooks: [{name: h, url: 'ftp://x'}]}": "url must be http",
        "alerts: {webhooks: [{name: h, url_env: A}, {name: h, url_env: B}]}": "duplicate webhook name 'h'",
        "alerts: {smtp: {host: h, port: 99999}}": "port",
        "alerts: {retries: -1}": "retries",
        "guard: {default_max_output_tokens: -5}": "default_max_output_tokens",
        "virtual_keys: [{name: k, key_sha256: nothex}]": "key_sha256",
        "virtual_keys: [{name: k, key: a}, {name: k, key: b}]": "duplicate key name 'k'",
        "budgets: [{name: b, limit_usd: 5, scope: {color: red}}]": "unknown scope 'color'",
        "budgets: [{name: b, limit_usd: 5, timezone: Mars/Olympus}]": "unknown time zone",
        "budgets: [{name: b, limit_usd: 5}, {name: b, limit_usd: 6}]": "duplicate budget name",
        "budgets: [{name: b, limit_usd: 5, notify: [slack]}]": "neither an email address nor a webhook",
    }
    for text, expected in cases.items():
        path.write_text(f"upstreams: [{{name: a, base_url: 'http://x'}}]\n{text}\n")
        with pytest.raises(ConfigError, match=expected):
            load_config(path)
    path.write_text(
        json.dumps(
            {
                "upstreams": [{"name": "a", "base_url": "http://x"}],
                "budgets": [{"name": "ok", "limit_usd": 5, "notify": ["a@example.com"]}],
                "alerts": {"smtp": {"host": "127.0.0.1"}},
            }
        )
    )
    assert load_config(path).budget_list()[0].limit_usd == Decimal(5)


def test_a_model_scope_covers_its_dated_snapshots_in_the_guard_and_the_ledger(tmp_path):
    from tokenward.reports.ledger import open_ledger
    from tokenward.reports.ledger.spend import DuckSpend

    dated = Budget("dated", Decimal(1), scope=(("model", "gpt-4o-2024-08-06"),), action="block")
    plain = Budget("plain", Decimal(1), scope=(("model", "gpt-4o"),), action="block")
    # at admission only the requested name is known: a request for gpt-4o may be served as the snapshot
    assert dated.matches({"model": ("gpt-4o",)}) and plain.matches({"model": ("gpt-4o-2024-08-06",)})
    assert not dated.matches({"model": ("gpt-4o-2024-11-20",)}) and not plain.matches({"model": ("gpt-4o-mini",)})
    path = tmp_path / "l.duckdb"
    rows = [
        ("a", "gpt-4o", "gpt-4o-2024-08-06", "1"),
        ("b", "gpt-4o", "gpt-4o-2024-11-20", "2"),
        ("c", "gpt-4o-mini", "gpt-4o-mini-2024-07-18", "4"),
        ("d", "gpt-4o-2024-08-06", None, "8"),
        # routing prefixes (OpenRouter's, LiteLLM's): the same model for the guard and the ledger
        ("e", "openai/gpt-4o", "openai/gpt-4o", "16"),
        ("f", "azure/gpt-4o-2024-08-06", None, "32"),
        ("g", "openrouter/openai/gpt-4o-mini", None, "64"),
        ("h", "azure/gpt-4o-2024-11-20", None, "128"),
    ]
    write_rows(
        path,
        [
            make_row(i, requested_model=r, served_model=s, cost_usd=Decimal(c), started_at=1_780_000_000.0)
            for i, r, s, c in rows
        ],
    )
    conn = open_ledger(path, read_only=True)
    window = (dt.datetime(2020, 1, 1, tzinfo=UTC), dt.datetime(2030, 1, 1, tzinfo=UTC))
    # dated: a (served as it), b (requested as gpt-4o, which the snapshot belongs to), d (requested as it),
    # e (gpt-4o behind openai/), f (the snapshot behind azure/): 1 + 2 + 8 + 16 + 32 = 59
    # plain: a, b, d, e, f and h (all gpt-4o): 59 + 128 = 187; never gpt-4o-mini (g)
    spend = DuckSpend(conn)
    assert (spend.spend_in(dated, *window), spend.spend_in(plain, *window)) == (Decimal(59), Decimal(187))
    # a report's --where model= filter reads the names the same way
    selection = Selection(filters={"model": ["gpt-4o"]})
    assert sum(r["cost_usd"] for r in spend_report(conn, ["model"], selection)[0]) == Decimal(187)
    conn.close()
    for row_id, requested, served, _ in rows:
        attributes = {"model": (requested, served) if served else (requested,)}
        assert dated.matches(attributes) == (row_id in "abdef") and plain.matches(attributes) == (row_id in "abdefh")


def test_a_routing_prefix_does_not_take_a_request_out_of_its_model_budget(start_proxy, simulator):
    request = long_prompt_request(10, 100) | {"model": "azure/gpt-4o"}  # priced as gpt-4o (routing_prefix)
    register(simulator, "prefixed", request, prompt_tokens=17, completion_tokens=100)
    # worst case (17 x 2.50 + 100 x 10.00) / 1M = $0.0010425 > the $0.001 left in the gpt-4o budget
    budget = BudgetSettings(name="gpt-4o-cap", limit_usd="0.001", scope={"model": "gpt-4o"}, period="total", action="block")
    proxy = budget_proxy(start_proxy, simulator, [budget])
    headers = {"authorization": "Bearer tw-agent-key-0001", RECORD_HEADER: "prefixed"}
    for model in ("azure/gpt-4o", "openrouter/openai/gpt-4o", "gpt-4o"):
        refused = httpx.post(f"{proxy.url}/v1/chat/completions", json=request | {"model": model}, headers=headers)
        assert refused.status_code == 429, (model, refused.text)
        assert refused.json()["error"]["code"] == "budget_exceeded" and "gpt-4o-cap" in refused.json()["error"]["message"]


CLOUD_NAMES = (  # Anthropic's claude-sonnet-4 as Bedrock (plain, cross-region profiles) and Vertex AI name it
    "anthropic.claude-sonnet-4-20250514-v1:0",
    "us.anthropic.claude-sonnet-4-20250514-v1:0",
    "global.anthropic.claude-sonnet-4-20250514-v1:0",
    "claude-sonnet-4@20250514",
)


def test_a_cloud_name_does_not_take_a_request_out_of_its_model_budget(start_proxy, simulator):
    request = long_prompt_request(10, 100) | {"model": CLOUD_NAMES[0]}  # priced as claude-sonnet-4 (cloud_name)
    register(simulator, "cloud", request, prompt_tokens=17, completion_tokens=100)
    # the output alone is 100 x $15 / 1M = $0.0015 > the $0.001 the claude-sonnet-4 budget has
    budget = BudgetSettings(
        name="sonnet-cap", limit_usd="0.001", scope={"model": "claude-sonnet-4"}, period="total", action="block"
    )
    proxy = budget_proxy(start_proxy, simulator, [budget])
    headers = {"authorization": "Bearer tw-agent-key-0001", RECORD_HEADER: "cloud"}
    for model in (*CLOUD_NAMES, "claude-sonnet-4"):
        refused = httpx.post(f"{proxy.url}/v1/chat/completions", json=request | {"model": model}, headers=headers)
        assert refused.status_code == 429, (model, refused.text)
        assert refused.json()["error"]["code"] == "budget_exceeded" and "sonnet-cap" in refused.json()["error"]["message"]
    # the same scope in memory, and the other way round: a budget on the Bedrock name covers the plain name
    bedrock = Budget("b", Decimal(1), scope=(("model", CLOUD_NAMES[1]),), action="block")
    assert bedrock.matches({"model": ("claude-sonnet-4",)}) and bedrock.matches({"model": (CLOUD_NAMES[3],)})
    assert not bedrock.matches({"model": ("claude-sonnet-4-5",)}) and not bedrock.matches({"model": ("claude-opus-4",)})


def test_a_client_that_leaves_before_the_reply_keeps_its_reservation_as_spend(start_proxy, simulator):
    request = long_prompt_request(10, 100)
    register(simulator, "slow", request, prompt_tokens=17, completion_tokens=100)
    # worst case (17 x 2.50 + 100 x 10.00) / 1M = $0.0010425: the budget has room for one at a time
    budget = BudgetSettings(name="one-at-a-time", limit_usd="0.0015", period="total", action="block")
    proxy = budget_proxy(start_proxy, simulator, [budget], drain_s=0.3)
    headers = {"authorization": "Bearer tw-agent-key-0001", RECORD_HEADER: "slow"}
    # the upstream never answers; the client gives up once the request is there
    seen = simulator.simulator.requests  # the last 1000, in a session-wide simulator: compare the last one
    last = seen[-1] if seen else None
    post_then_leave(
        f"{proxy.url}/v1/chat/completions",
        lambda: bool(seen) and seen[-1] is not last,
        json=request,
        headers={**headers, FAULT_HEADER: "hang"},
    )
    (left,) = proxy.rows(1)
    # tokenward waited 0.3 s more for the upstream, then gave up: the provider may bill it, so no $0
    assert (left["outcome"], left["price_status"], left["cost_usd"]) == ("client_disconnected", "usage_unknown", None)
    assert left["latency_ms"] < 5000  # not the 600 s read timeout
    # the provider may have billed up to the worst case: it stays counted (never a silent $0), so
    # $0.0015 - $0.0010425 = $0.0004575 is left, too little for another worst case
    assert left["reserved_usd"] == Decimal("0.0010425")
    refused = httpx.post(f"{proxy.url}/v1/chat/completions", json=request, headers=headers)
    assert refused.status_code == 429 and "$0.0004575 left" in refused.json()["error"]["message"]


def test_far_from_its_limit_a_request_is_bounded_by_its_bytes_near_it_by_its_tokens(
    start_proxy, simulator, monkeypatch
):
    import json

    from tokenward.proxy import forward

    counted = []
    real = forward._count_for_bound
    monkeypatch.setattr(forward, "_count_for_bound", lambda *args: counted.append(args) or real(*args))
    request = long_prompt_request(10, 100)
    body = json.dumps(request, separators=(",", ":")).encode()
    register(simulator, "one", request, prompt_tokens=17, completion_tokens=100)
    ample = BudgetSettings(name="ample", limit_usd="100", period="total", action="block")
    proxy = budget_proxy(start_proxy, simulator, [ample])
    headers = {"authorization": "Bearer tw-agent-key-0001", RECORD_HEADER: "one", "content-type": "application/json"}
    ok = httpx.post(f"{proxy.url}/v1/chat/completions", content=body, headers=headers)
    assert ok.status_code == 200, ok.text
    (row,) = proxy.rows(1)
    # $100 left: bounded by the bytes of the texts it would count ("user" 4, the content 59) + 6 of
    # overhead, no token counted: (69 x $2.50 + 100 x $10.00) / 1M = $0.0011725, under a hundredth
    # of the headroom
    assert counted == []
    assert row["reserved_usd"] == Decimal("0.0011725")
    assert row["cost_usd"] == Decimal("0.0010425")  # (17 x $2.50 + 100 x $10.00) / 1M, as billed
    # $0.0015 left: $0.0011725 is more than a hundredth of it, so the text is counted: 17 tokens
    tight = BudgetSettings(name="tight", limit_usd="0.0015", period="total", action="block")
    proxy = budget_proxy(start_proxy, simulator, [tight])
    ok = httpx.post(f"{proxy.url}/v1/chat/completions", content=body, headers=headers)
    assert ok.status_code == 200, ok.text
    (row,) = proxy.rows(1)
    assert len(counted) == 1 and row["reserved_usd"] == Decimal("0.0010425")


def test_a_bytes_bound_refused_is_counted_before_the_request_is_refused(start_proxy, simulator, monkeypatch):
    import json

    from tokenward.proxy.guard import BudgetGuard

    request = long_prompt_request(10, 100)
    body = json.dumps(request, separators=(",", ":")).encode()
    register(simulator, "one", request, prompt_tokens=17, completion_tokens=100)
    # room for the counted bound ($0.0010425) but not the bytes bound ($0.0011725)
    budget = BudgetSettings(name="tight", limit_usd="0.0011", period="total", action="block")
    real = BudgetGuard.tightest

    def seen_ample(self, attributes, now):  # as when others' holds were released just after the look
        found = real(self, attributes, now)
        return (found[0], Decimal(1000)) if found else None

    monkeypatch.setattr(BudgetGuard, "tightest", seen_ample)
    proxy = budget_proxy(start_proxy, simulator, [budget])
    headers = {"authorization": "Bearer tw-agent-key-0001", RECORD_HEADER: "one", "content-type": "application/json"}
    ok = httpx.post(f"{proxy.url}/v1/chat/completions", content=body, headers=headers)
    assert ok.status_code == 200, ok.text
    (row,) = proxy.rows(1)
    assert row["reserved_usd"] == Decimal("0.0010425")


def test_a_bytes_bound_is_never_below_the_counted_bound_numbers_in_a_tool_schema(start_proxy, simulator):
    import msgspec

    # A tool schema's numbers written short: "1e15" is 4 bytes in the body, but the counter reads
    # the tools as their JSON re-encoded, where it is "1000000000000000.0" (9 tokens with its
    # comma, o200k_base). 1000 of them: the body is 5,208 bytes, its count 9,039 tokens (9 x 1000
    # - 1 for the last comma + 31 for the rest of the tools' JSON, + 1 "user" + 1 "hi" + 3 for the
    # message + 3 for the reply's priming).
    request = long_prompt_request(1, 1)
    request["messages"][0]["content"] = "hi"
    request["tools"] = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"x": {"type": "number", "enum": ["N"]}}},
            },
        }
    ]
    text = json.dumps(request, separators=(",", ":")).replace('["N"]', "[" + ",".join(["1e15"] * 1000) + "]")
    body = text.encode()
    assert len(body) == 5208
    register(simulator, "tools", msgspec.json.decode(body), prompt_tokens=9039, completion_tokens=1)
    headers = {"authorization": "Bearer tw-agent-key-0001", RECORD_HEADER: "tools", "content-type": "application/json"}
    reserved = {}
    for share in (0, 0.01):  # 0: every request counted; 0.01: $100 left, so bounded without the tokenizer
        ample = BudgetSettings(name="ample", limit_usd="100", period="total", action="block")
        guard = GuardSettings(input_margin=1, input_margin_tokens=0, bytes_bound_share=share)
        proxy = budget_proxy(start_proxy, simulator, [ample], guard=guard)
        ok = httpx.post(f"{proxy.url}/v1/chat/completions", content=body, headers=headers)
        assert ok.status_code == 200, ok.text
        (row,) = proxy.rows(1)
        reserved[share] = row["reserved_usd"]
    # counted: (9,039 x $2.50 + 1 x $10.00) / 1M
    assert reserved[0] == Decimal("0.0226075")
    # without the tokenizer, the texts the counter reads are bounded by their UTF-8 bytes (19,122 for
    # the tools' JSON, 4 "user", 2 "hi") + the same 6 of overhead: (19,134 x $2.50 + $10.00) / 1M.
    # (Bounded by the body's 5,208 bytes it was $0.01303: 42 % under what the count says.)
    assert reserved[0.01] == Decimal("0.047845") and reserved[0.01] >= reserved[0]


def test_a_refusal_of_a_request_without_an_output_limit_says_what_was_priced(start_proxy, simulator):
    import openai

    budget = BudgetSettings(name="cap", limit_usd="0.10", period="day", action="block")
    proxy = budget_proxy(start_proxy, simulator, [budget])
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="tw-agent-key-0001", max_retries=0)
    request = long_prompt_request(10, 1000)  # 17 tokens in
    del request["max_tokens"]
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(**request)
    # 17 x $2.50 + 16384 (the default output limit) x $10.00 per 1M = $0.1638825, over the $0.10 left
    message = refused.value.body["message"]
    assert message.startswith(
        "Budget 'cap' (all traffic) has $0.1 left of $0.1 this period; this request may cost up to $0.1638825. "
    )
    # before: nothing said why a 17-token request was bounded at 16 cents
    assert message.endswith(
        " The request sets no output limit, so 16384 output tokens (guard.default_max_output_tokens) were "
        "priced: with a max_tokens it can afford it may fit."
    )
    register(simulator, "fits", {**request, "max_tokens": 1000}, prompt_tokens=17, completion_tokens=3)
    client.chat.completions.create(**request, max_tokens=1000, extra_headers={RECORD_HEADER: "fits"})  # $0.0100425
    with pytest.raises(openai.RateLimitError) as again:  # one that set a limit is told nothing more
        client.chat.completions.create(**request, max_tokens=20000)
    # 17 x $2.50 + 20000 x $10.00 per 1M
    assert "this request may cost up to $0.2000425. It resets at " in again.value.body["message"]
    assert again.value.body["message"].endswith("+00:00.")
