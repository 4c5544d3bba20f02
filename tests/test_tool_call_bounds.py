"""Under a blocking budget, provider-run tools billed per call cannot spend past the limit.

Before, a request offering such a tool held everything left in its budget, but the model chose how
many calls to make, each billed on top of the tokens: a key with $0.05 left offering web search
could have the provider run 20 searches ($0.20 at $0.01 each) and end $0.15 over a hard limit. Now
the calls are bounded (a Responses ``max_tool_calls``, sent as ``guard.max_tool_calls`` when the
request sets none; an Anthropic server tool's ``max_uses``, required) and the bound prices them at
the entry's fee. A real proxy in front of :class:`~tests.raw_upstream.RawUpstream`; prices: the
built-in claude-sonnet-4-5 (3 in / 15 out per 1M, web search $0.01), and gpt-4.1 (2 / 8) with a
web search fee of $0.01 from a price file.
"""

from __future__ import annotations

import json
from decimal import Decimal

import anthropic
import httpx
import openai
import pytest

from tokenward.pricing.settings import BudgetSettings, GuardSettings, PricingSettings

from .raw_upstream import json_reply

USAGE = {"input_tokens": 1000, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 100,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 1100}  # fmt: skip


def searches(count: int) -> bytes:
    """A Responses reply that ran ``count`` web searches."""
    items = [{"type": "web_search_call", "id": f"ws_{i}", "status": "completed", "action": {"type": "search"}}
             for i in range(count)]  # fmt: skip
    body = {"id": "resp_s", "object": "response", "created_at": 1, "status": "completed", "model": "gpt-4.1",
            "error": None, "output": items, "usage": USAGE, "tools": []}  # fmt: skip
    return json_reply(json.dumps(body).encode())


@pytest.fixture
def searching_proxy(raw_proxy, tmp_path):
    prices = tmp_path / "prices.yaml"
    prices.write_text("entries:\n  - {id: openai/gpt-4.1, web_search: 0.01}\n")

    def start(limit: str, **guard):
        budgets = [BudgetSettings(name="cap", limit_usd=Decimal(limit), scope={}, period="total", action="block")]
        return raw_proxy(budgets=budgets, pricing=PricingSettings(files=[str(prices)]), guard=GuardSettings(**guard))

    return start


def test_a_responses_request_is_sent_with_a_tool_call_bound_and_reserves_its_fees(searching_proxy, raw_upstream):
    proxy = searching_proxy("10")
    raw_upstream.script = lambda head, body: [searches(2)]
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as client:
        raw = client.responses.with_raw_response.create(
            model="gpt-4.1", input="news?", max_output_tokens=100, tools=[{"type": "web_search"}]
        )
    assert raw.headers["x-tokenward-tool-limit"] == "max_tool_calls=8"
    sent = json.loads(raw_upstream.requests[0][1])
    assert sent["max_tool_calls"] == 8 and sent["tools"] == [{"type": "web_search"}]
    (row,) = proxy.rows(1)
    # 1000 x 2.00 + 100 x 8.00 = 2800 per 1M, plus 2 searches at $0.01: $0.0228
    assert (row["web_search_requests"], row["cost_usd"], row["price_status"]) == (2, Decimal("0.0228"), "priced")


def test_a_key_with_little_left_cannot_search_past_its_limit(searching_proxy, raw_upstream):
    """$0.05 left: 8 searches may cost $0.08, so the request is refused; before, 20 searches spent $0.2028."""
    proxy = searching_proxy("0.05")
    raw_upstream.script = lambda head, body: [searches(20)]
    body = {"model": "gpt-4.1", "input": "news?", "max_output_tokens": 100, "tools": [{"type": "web_search"}]}
    refused = httpx.post(f"{proxy.url}/v1/responses", json=body, timeout=30)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exceeded"
    hostile = httpx.post(f"{proxy.url}/v1/responses", json={**body, "max_tool_calls": 1000}, timeout=30)
    assert hostile.status_code == 429
    assert raw_upstream.requests == []  # nothing reached the provider
    # a request that bounds its searches to what is left runs: 2 x $0.01 + tokens
    assert httpx.post(f"{proxy.url}/v1/responses", json={**body, "max_tool_calls": 2}, timeout=30).status_code == 200
    rows = proxy.rows(expect=3)
    assert [r["outcome"] for r in rows] == ["rejected", "rejected", "ok"]


def test_an_anthropic_server_tool_is_sent_with_max_uses_under_a_blocking_budget(raw_proxy, raw_upstream):
    """Claude Code's web search without ``max_uses`` runs, bounded: ``max_uses`` = guard.max_tool_calls (8) is sent."""
    budgets = [BudgetSettings(name="cap", limit_usd=Decimal(10), scope={}, period="total", action="block")]
    proxy = raw_proxy(budgets=budgets)
    usage = {"input_tokens": 1000, "output_tokens": 100, "server_tool_use": {"web_search_requests": 2}}
    reply = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5", "usage": usage,
             "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn", "stop_sequence": None}  # fmt: skip
    raw_upstream.script = lambda head, body: [json_reply(json.dumps(reply).encode())]
    tool = {"type": "web_search_20250305", "name": "web_search"}
    request = {"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": [{"role": "user", "content": "news?"}]}
    with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0) as client:
        sent = client.messages.with_raw_response.create(**request, tools=[tool])
        assert sent.headers["x-tokenward-tool-limit"] == "max_uses=8"
        client.messages.create(**request, tools=[{**tool, "max_uses": 2}])
        with pytest.raises(anthropic.BadRequestError) as refused:  # a bound that is not a count is no bound
            client.messages.create(**request, tools=[{**tool, "max_uses": "many"}])
        assert refused.value.body["error"]["code"] == "tool_calls_unbounded"
        assert "max_uses" in refused.value.body["error"]["message"]
    first, second = (json.loads(body) for _, body in raw_upstream.requests)
    assert first["tools"] == [{**tool, "max_uses": 8}]
    assert second["tools"] == [{**tool, "max_uses": 2}]  # the client's own bound, untouched
    rows = proxy.rows(expect=3)
    assert [(r["outcome"], r["http_status"]) for r in rows] == [("ok", 200), ("ok", 200), ("rejected", 400)]
    # 1000 x 3 + 100 x 15 = 4500 per 1M + 2 x $0.01 = $0.0245; the reservations held 8 and 2 searches' fees
    assert [r["cost_usd"] for r in rows[:2]] == [Decimal("0.0245"), Decimal("0.0245")]
    assert rows[0]["reserved_usd"] >= Decimal("0.08") and rows[1]["reserved_usd"] >= Decimal("0.02")
    assert len(raw_upstream.requests) == 2


def test_tool_call_bounds_read_what_each_api_bounds():
    from tokenward.proxy.bounds import tool_call_bounds

    assert tool_call_bounds({"tools": [{"type": "web_search"}, {"type": "file_search"}], "max_tool_calls": 3}) == (
        {"web_search_requests": 3, "file_search_calls": 3},
        [],
    )
    anthropic_tools = [
        {"type": "web_search_20250305", "max_uses": 2},
        {"type": "web_fetch_20250910", "max_uses": 1},
        {"type": "code_execution_20250825"},
    ]
    assert tool_call_bounds({"tools": anthropic_tools}) == (
        {"web_search_requests": 2, "web_fetch_requests": 1, "code_containers": 1},
        [],
    )
    # a count that is not a plain integer bounds nothing (a lenient reader may take 1e9 from "1e9")
    for uses in ("5", 5.0, True, -1, None):
        assert tool_call_bounds({"tools": [{"type": "web_search_20250305", "max_uses": uses}]}) == (
            {},
            ["web_search_20250305"],
        )
    assert tool_call_bounds({"tools": [{"google_search": {}}]}) == ({"web_search_requests": 1}, [])
    assert tool_call_bounds({"tools": [{"type": "mcp", "server_url": "https://x"}]}) == ({}, [])  # billed as tokens
