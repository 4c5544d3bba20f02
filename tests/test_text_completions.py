"""Anthropic's legacy Text Completions (``POST /v1/complete``) are metered, never spent unmetered.

Its reply carries no usage (``{"type": "completion", "completion": ..., "stop_reason": ...}``,
https://docs.anthropic.com/en/api/complete), so both sides are counted offline with the tokenizer
and the row says ``estimated``; a blocking budget bounds it by its prompt and
``max_tokens_to_sample`` like any other generating request. Before, it was forwarded unmetered
(a ``passthrough`` row, no cost, outside every budget) unless a blocking budget covered it, which
refused it with 403. Prices: claude-sonnet-4-5 3.00 in / 15.00 out per 1M tokens (built-in).
"""

from __future__ import annotations

import json
from decimal import Decimal

import httpx
import pytest

from tokenward.pricing.settings import BudgetSettings

from .raw_upstream import LAST_CHUNK, chunk, json_reply, sse_head

PROMPT = "\n\nHuman: Name three primes.\n\nAssistant:"  # 9 tokens (o200k_base)
HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "sk-ant-test"}


def completion_reply(stream: bool) -> list[bytes]:
    """The reply ``" 2, 3 and 5."`` (9 tokens), whole or as two streamed pieces, as the API sends it."""
    if not stream:
        body = {"type": "completion", "id": "compl_1", "completion": " 2, 3 and 5.", "stop_reason": "stop_sequence",
                "model": "claude-sonnet-4-5", "stop": "\n\nHuman:", "log_id": "compl_1"}  # fmt: skip
        return [json_reply(json.dumps(body).encode())]
    events = [
        (b"completion", {"type": "completion", "completion": " 2, 3", "stop_reason": None, "model": "claude-sonnet-4-5"}),
        (b"ping", {"type": "ping"}),
        (b"completion", {"type": "completion", "completion": " and 5.", "stop_reason": "stop_sequence",
                         "model": "claude-sonnet-4-5"}),
    ]  # fmt: skip
    return [
        sse_head(),
        *(chunk(b"event: " + name + b"\ndata: " + json.dumps(data).encode() + b"\n\n") for name, data in events),
        LAST_CHUNK,
    ]


def complete(proxy, **extra) -> httpx.Response:
    body = {"model": "claude-sonnet-4-5", "prompt": PROMPT, "max_tokens_to_sample": 50, **extra}
    return httpx.post(f"{proxy.url}/v1/complete", json=body, headers=HEADERS, timeout=30)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_completions_are_metered_by_estimate(raw_proxy, raw_upstream, stream):
    proxy = raw_proxy()
    raw_upstream.script = lambda head, body: completion_reply(stream)
    reply = complete(proxy, stream=stream)
    assert reply.status_code == 200
    (row,) = proxy.rows(1)
    # before: endpoint "passthrough", price_status "not_metered", cost NULL, counted by no budget
    assert (row["endpoint"], row["upstream"], row["usage_source"], row["stream"]) == (
        "anthropic_complete",
        "anthropic",
        "estimated",
        stream,
    )
    assert (row["input_tokens"], row["output_tokens"]) == (9, 9)
    # 9 x 3.00 + 9 x 15.00 = 162 per 1M -> $0.000162; streamed and whole alike
    assert (row["cost_usd"], row["price_status"]) == (Decimal("0.000162"), "priced")


def test_text_completions_are_bounded_by_a_blocking_budget(raw_proxy, raw_upstream):
    """Under a blocking budget it reserves its bound and settles to the estimate, or gets 429 like any request."""
    budgets = [BudgetSettings(name="claude", limit_usd=1, scope={"model": "claude-sonnet-4-5"}, action="block")]
    proxy = raw_proxy(budgets=budgets)
    raw_upstream.script = lambda head, body: completion_reply(False)
    assert complete(proxy).status_code == 200
    refused = complete(proxy, max_tokens_to_sample=100_000)  # 100,000 x 15.00 per 1M = $1.50 of output alone
    assert refused.status_code == 429
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "rate_limit_error"
    rows = proxy.rows(expect=2)
    assert [(r["endpoint"], r["outcome"], r["cost_usd"]) for r in rows] == [
        ("anthropic_complete", "ok", Decimal("0.000162")),
        ("anthropic_complete", "rejected", Decimal(0)),
    ]
    assert rows[0]["reserved_usd"] > Decimal("0.00075")  # at least the 50 output tokens it may generate
    assert len(raw_upstream.requests) == 1
