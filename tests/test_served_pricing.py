"""What a reply says was served prices its row: service tier, data residency, model names of clouds.

A real proxy in front of :class:`~tests.raw_upstream.RawUpstream`, the real ``anthropic`` and
``openai`` SDKs as clients, the builtin catalog (USD per 1M tokens, from
shared/reference/usage-and-pricing.md 2.1 and 2.2): claude-opus-4-6 5 in / 25 out, 1h cache write
10; claude-sonnet-4-5 3 in / 15 out; gpt-5 1.25 in / 10 out, flex 0.625 / 5.00, priority
2.50 / 20.00; data residency ``inference_geo: "us"`` 1.1x on Opus 4.6 and later [R30].
"""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal

import anthropic
import openai
import pytest

from tokenward.pricing.catalog import load_catalog
from tokenward.pricing.quote import quote, worst_case
from tokenward.pricing.usage import Usage

from .raw_upstream import LAST_CHUNK, chunk, json_reply, sse_head

CATALOG = load_catalog()
WHEN = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


@pytest.fixture
def proxy(raw_proxy):
    return raw_proxy()


def event(obj: dict, name: str) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def anthropic_reply(model: str, usage: dict, stream: bool) -> list[bytes]:
    """A message of ``model`` with ``usage`` (1000 in, 100 out), whole or as a stream whose message_delta ends it."""
    message = {"id": "msg_g", "type": "message", "role": "assistant", "model": model, "stop_sequence": None}
    if not stream:
        body = {**message, "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn", "usage": usage}
        return [json_reply(json.dumps(body).encode())]
    start = {**usage, "output_tokens": 1}
    events = [
        event({"type": "message_start", "message": {**message, "content": [], "stop_reason": None, "usage": start}},
              "message_start"),
        event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              "content_block_start"),
        event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
              "content_block_delta"),
        event({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        event({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
               "usage": {"output_tokens": usage["output_tokens"]}}, "message_delta"),
        event({"type": "message_stop"}, "message_stop"),
    ]  # fmt: skip
    return [sse_head(), *(chunk(e) for e in events), LAST_CHUNK]


def usage_at(geo: str) -> dict:
    return {"input_tokens": 1000, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
            "output_tokens": 100, "service_tier": "standard", "inference_geo": geo}  # fmt: skip


# (model, inference_geo in the reply's usage, cost, price_status, service_tier recorded)
GEOS = [
    # 1000 x 5 + 100 x 25 = 7500 -> $0.0075, x 1.1 in the US: $0.00825 (before: $0.0075, the 10 % unbilled)
    ("claude-opus-4-6", "us", Decimal("0.00825"), "priced", "standard@us"),
    ("claude-opus-4-6", "global", Decimal("0.0075"), "priced", "standard"),
    # no data-residency price for Sonnet 4.5 in the reference: standard rates, and the row says so
    # (1000 x 3 + 100 x 15 = 4500 -> $0.0045)
    ("claude-sonnet-4-5", "us", Decimal("0.0045"), "partially_priced", "standard@us"),
    ("claude-sonnet-4-5", "not_available", Decimal("0.0045"), "priced", "standard"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("model", "geo", "cost", "status", "tier"), GEOS, ids=[f"{g[0]}-{g[1]}" for g in GEOS])
def test_the_geography_a_reply_ran_in_prices_its_row(proxy, raw_upstream, stream, model, geo, cost, status, tier):
    raw_upstream.script = lambda head, body: anthropic_reply(model, usage_at(geo), stream)
    with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0) as client:
        request = {"model": model, "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
        if stream:
            with client.messages.stream(**request) as events:
                assert events.get_final_message().usage.output_tokens == 100
        else:
            assert client.messages.create(**request).usage.inference_geo == geo
    (row,) = proxy.rows(1)
    assert (row["input_tokens"], row["output_tokens"]) == (1000, 100)
    assert (row["cost_usd"], row["price_status"], row["service_tier"]) == (cost, status, tier)


def test_the_bound_prices_the_dearest_geography_unless_the_request_names_one():
    def bound(**kwargs) -> Decimal | None:
        return worst_case(
            CATALOG, model="claude-opus-4-6", provider="anthropic", at=WHEN, input_tokens=1000,
            max_output_tokens=100, **kwargs,
        )  # fmt: skip

    # every input token at the dearest input-side rate (1h cache write, 10) + 100 x 25 = 12,500 -> $0.0125;
    # a workspace may default to US-only inference: x 1.1 = $0.01375 (before: $0.0125, under what a US reply bills)
    assert bound() == Decimal("0.01375")
    assert bound(inference_geo="us") == Decimal("0.01375")
    assert bound(inference_geo="global") == Decimal("0.0125")


def test_a_served_tier_and_geography_combine():
    usage = Usage(input_tokens=1000, output_tokens=100)
    # fast mode 6x on Opus 4.6, then the US 1.1x: 7500 x 6 x 1.1 = 49,500 -> $0.0495
    fast_us = quote(CATALOG, usage, model="claude-opus-4-6", provider="anthropic", at=WHEN, service_tier="fast@us")
    assert (fast_us.cost_usd, fast_us.status) == (Decimal("0.0495"), "priced")
    assert fast_us.lines[0]["rule"] == "tier:fast+geo:us"


def openai_reply(tier: str, stream: bool) -> list[bytes]:
    """A gpt-5 chat reply served at ``tier``: 1000 in, 100 out (the tier on every chunk, as OpenAI sends it)."""
    usage = {"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100}
    head = {"id": "c", "model": "gpt-5-2025-08-07", "service_tier": tier}
    if not stream:
        body = {**head, "object": "chat.completion", "usage": usage,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}]}  # fmt: skip
        return [json_reply(json.dumps(body).encode())]
    pieces = [
        {**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hi"}}]},
        {**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage},
    ]
    data = [b"data: " + json.dumps(p).encode() + b"\n\n" for p in pieces] + [b"data: [DONE]\n\n"]
    return [sse_head(), *(chunk(d) for d in data), LAST_CHUNK]


# (served tier, cost, price_status): 1000 in, 100 out of gpt-5
OPENAI_TIERS = [
    ("default", Decimal("0.00225"), "priced"),  # 1000 x 1.25 + 100 x 10 = 2250
    ("priority", Decimal("0.0045"), "priced"),  # 1000 x 2.50 + 100 x 20 = 4500
    ("flex", Decimal("0.001125"), "priced"),  # 1000 x 0.625 + 100 x 5 = 1125
    # scale: the reference gives no price; standard rates, and the row says so (never a silent figure)
    ("scale", Decimal("0.00225"), "partially_priced"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("tier", "cost", "status"), OPENAI_TIERS, ids=[t[0] for t in OPENAI_TIERS])
def test_the_openai_tier_a_reply_was_served_at_prices_its_row(proxy, raw_upstream, stream, tier, cost, status):
    raw_upstream.script = lambda head, body: openai_reply(tier, stream)
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as client:
        request = {"model": "gpt-5", "service_tier": "auto", "messages": [{"role": "user", "content": "hi"}]}
        if stream:
            assert [c.service_tier for c in client.chat.completions.create(**request, stream=True)][-1] == tier
        else:
            assert client.chat.completions.create(**request).service_tier == tier
    (row,) = proxy.rows(1)
    assert (row["cost_usd"], row["price_status"], row["service_tier"]) == (cost, status, tier)


CLOUD_NAMES = [
    "claude-sonnet-4-5@20250929",  # Vertex AI
    "anthropic.claude-sonnet-4-5-20250929-v1:0",  # Bedrock
    "us.anthropic.claude-sonnet-4-5-20250929-v1:0",  # a Bedrock cross-region inference profile
    "global.anthropic.claude-sonnet-4-5-20250929-v1:0",
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", CLOUD_NAMES)
def test_a_clouds_name_for_a_claude_model_is_priced_as_that_model(proxy, raw_upstream, stream, name):
    # before: unpriced (cost NULL), and refused with 400 model_not_priced under a blocking budget
    raw_upstream.script = lambda head, body: anthropic_reply(name, usage_at("not_available"), stream)
    with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0) as client:
        request = {"model": name, "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
        if stream:
            with client.messages.stream(**request) as events:
                events.get_final_message()
        else:
            client.messages.create(**request)
    (row,) = proxy.rows(1)
    # claude-sonnet-4-5: 1000 x 3 + 100 x 15 = 4500 -> $0.0045
    assert (row["cost_usd"], row["price_status"], row["price_resolved_by"]) == (Decimal("0.0045"), "priced", "cloud_name")
    assert row["price_entry_id"] == "anthropic/claude-sonnet-4-5"


def test_a_clouds_name_is_bounded_as_its_model():
    # 1000 in at the 1h cache write rate (6) + 100 x 15 = 7500 -> $0.0075, the same as claude-sonnet-4-5's bound
    for name in [*CLOUD_NAMES, "claude-sonnet-4-5", "eu.anthropic.claude-sonnet-4-5-20250929-v1:0"]:
        bound = worst_case(CATALOG, model=name, provider="anthropic", at=WHEN, input_tokens=1000, max_output_tokens=100)
        assert bound == Decimal("0.0075"), name
    # a dotted OpenRouter-style name is no Bedrock vendor prefix: claude-opus-4.5 stays Opus 4.5
    assert CATALOG.resolve("claude-opus-4.5@20251101", "anthropic", WHEN).entry.id == "anthropic/claude-opus-4-5"
