"""Usage families beyond the public corpus, each from a fixture in tests/fixtures/usage, through the real proxy.

Prices: tests/fixtures/field_case_prices.yaml and tests/fixtures/metering_prices.yaml (test
prices, USD per 1M tokens; web searches USD per call), except the xAI case, which uses the
built-in catalog (imported.yaml: xai/grok-4.20 input 1.25, output 2.50, reasoning 2.50).
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from tokenward.pricing.catalog import load_catalog
from tokenward.proxy.simulator import RECORD_HEADER, Recording

from .conftest import upstreams_for

FIXTURES = Path(__file__).parent / "fixtures"
USAGE = FIXTURES / "usage"
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello world"}]}


def fixture_json(name: str) -> dict:
    return json.loads((USAGE / name).read_text())


def fixture_sse(name: str) -> str:
    return (USAGE / name).read_text()


@pytest.fixture(scope="module")
def catalog():
    return load_catalog([FIXTURES / "field_case_prices.yaml", FIXTURES / "metering_prices.yaml"], builtin=False)


@pytest.fixture
def proxy(start_proxy, catalog, simulator):
    return start_proxy(upstreams=upstreams_for(simulator.url, ["test"]), catalog=catalog)


def serve(simulator, name, endpoint, request, *, body=None, sse=None, text=None, content_type=None):
    response = {"status": 200, "content_type": content_type or ("text/event-stream" if sse else "application/json")}
    if sse is not None:
        response["sse"] = sse
    elif text is not None:
        response["text"] = text
    else:
        response["body"] = body
    simulator.simulator.add(
        Recording(name, "test", "openai", endpoint, bool(request.get("stream")), {"body": request}, response, None)
    )


def send(proxy, name, path, request, upstream="test", **extra):
    return httpx.post(
        f"{proxy.url}/v1/{path}",
        json=request,
        headers={RECORD_HEADER: name, "x-tokenward-upstream": upstream, **extra},
        timeout=30,
    )


def request_row(proxy, expect=1):
    rows = proxy.rows(expect)
    return next(r for r in rows if r["row_kind"] == "request"), [r for r in rows if r["row_kind"] == "part"]


# --- Responses API hosted web searches -----------------------------------------------------------

RESPONSES_REQUEST = {"model": "gpt-4.1", "input": "Weather in Tokyo?", "tools": [{"type": "web_search"}]}


@pytest.mark.parametrize("streamed", [False, True])
def test_responses_web_search_calls_are_counted_once_and_priced_per_call(proxy, simulator, streamed):
    request = dict(RESPONSES_REQUEST, stream=streamed)
    if streamed:
        serve(simulator, "ws-stream", "responses", request, sse=fixture_sse("responses_web_search_stream.sse"))
    else:
        serve(simulator, "ws-body", "responses", request, body=fixture_json("responses_web_search.json"))
    reply = send(proxy, "ws-stream" if streamed else "ws-body", "responses", request)
    assert reply.status_code == 200
    row, _ = request_row(proxy)
    # two web_search_call items (a search and an open_page); in the stream each is in its
    # output_item.done event and again in response.completed: still 2
    assert (row["web_search_requests"], row["input_tokens"], row["cached_input_tokens"], row["output_tokens"]) == (
        2,
        3000,
        1000,
        200,
    )
    # gpt-4.1 test prices: 2000 x 2.00/1M + 1000 x 0.50/1M + 200 x 8.00/1M + 2 x $0.01 = $0.0261
    assert (row["price_status"], row["cost_usd"]) == ("priced", Decimal("0.0261"))
    assert (row["outcome"], row["error"]) == ("ok", None)


def test_responses_web_search_without_a_fee_is_partially_priced(proxy, simulator):
    request = dict(RESPONSES_REQUEST, model="gpt-4.1-mini")
    body = fixture_json("responses_web_search.json") | {"model": "gpt-4.1-mini"}
    serve(simulator, "ws-nofee", "responses", request, body=body)
    send(proxy, "ws-nofee", "responses", request)
    row, _ = request_row(proxy)
    # gpt-4.1-mini has no web_search fee: tokens only, 2000 x 0.40 + 1000 x 0.10 + 200 x 1.60 (per 1M) = $0.00122
    assert (row["price_status"], row["cost_usd"], row["web_search_requests"]) == (
        "partially_priced",
        Decimal("0.00122"),
        2,
    )
    unpriced = [line for line in json.loads(row["cost_lines"]) if line.get("component") == "web_search"]
    assert unpriced == [
        {"component": "web_search", "quantity": 2, "rate": None, "amount": None, "rule": "no fee in catalog"}
    ]


def test_an_error_object_on_a_completed_response_is_not_an_upstream_error(proxy, simulator):
    request = dict(RESPONSES_REQUEST, tools=[])
    body = fixture_json("responses_web_search.json") | {
        "error": {"code": "partial_results", "message": "one source failed"}
    }
    serve(simulator, "resp-odd-error", "responses", request, body=body)
    failed = body | {"status": "failed", "error": {"code": "server_error", "message": "The model failed"}}
    serve(simulator, "resp-failed", "responses", dict(request, input="again"), body=failed)
    send(proxy, "resp-odd-error", "responses", request)
    send(proxy, "resp-failed", "responses", dict(request, input="again"))
    first, second = proxy.rows(2)
    assert (first["outcome"], first["error"], first["price_status"]) == ("ok", None, "priced")
    assert (second["outcome"], second["error"]) == ("upstream_error", "The model failed")
    assert second["cost_usd"] == first["cost_usd"] == Decimal("0.0261")  # the usage reported is billed either way


# --- xAI: reasoning tokens outside completion_tokens ----------------------------------------------


def test_xai_reasoning_reported_outside_completion_is_billed(start_proxy, simulator):
    proxy = start_proxy(upstreams=upstreams_for(simulator.url, ["xai"]))  # the built-in catalog
    request = {"model": "grok-4.20", "messages": [{"role": "user", "content": "the answer?"}]}
    serve(simulator, "xai", "chat_completions", request, body=fixture_json("xai_reasoning.json"))
    send(proxy, "xai", "chat/completions", request, upstream="xai")
    row, _ = request_row(proxy)
    # total 19600 = prompt 5000 + completion 5000 + reasoning 9600: the reasoning is extra output
    assert (row["input_tokens"], row["output_tokens"], row["reasoning_tokens"]) == (5000, 14600, 9600)
    # xai/grok-4.20: 5000 x 1.25/1M + 14600 x 2.50/1M = 0.00625 + 0.0365 = $0.04275 (dropping them: $0.01875)
    assert (row["price_status"], row["cost_usd"], row["price_entry_id"]) == (
        "priced",
        Decimal("0.04275"),
        "xai/grok-4.20",
    )


# --- OpenAI-shaped relays of Anthropic models (LiteLLM) -------------------------------------------

LITELLM_REQUEST = {"model": "claude-sonnet-4", "messages": [{"role": "user", "content": "Summarize."}]}


def test_litellm_relay_of_anthropic_bills_cache_writes_at_write_rates(proxy, simulator):
    serve(simulator, "litellm", "chat_completions", LITELLM_REQUEST, body=fixture_json("litellm_anthropic_relay.json"))
    send(proxy, "litellm", "chat/completions", LITELLM_REQUEST)
    row, _ = request_row(proxy)
    assert (
        row["input_tokens"],
        row["cached_input_tokens"],
        row["cache_write_tokens"],
        row["cache_write_1h_tokens"],
        row["output_tokens"],
    ) == (3000, 2000, 900, 300, 250)
    # claude-sonnet-4 test prices: 100 uncached x 3.00 + 2000 x 0.30 + 600 (5m) x 3.75 + 300 (1h) x 6.00
    # + 250 x 15.00, per 1M = 0.0003 + 0.0006 + 0.00225 + 0.0018 + 0.00375 = $0.0087
    assert (row["price_status"], row["cost_usd"]) == ("priced", Decimal("0.0087"))


def test_litellm_top_level_cache_fields_alone(proxy, simulator):
    body = fixture_json("litellm_anthropic_relay.json")
    body["usage"] = {
        "prompt_tokens": 3000,
        "completion_tokens": 250,
        "total_tokens": 3250,
        "cache_creation_input_tokens": 900,
        "cache_read_input_tokens": 2000,
    }
    request = dict(LITELLM_REQUEST, user="top-level")
    serve(simulator, "litellm-top", "chat_completions", request, body=body)
    send(proxy, "litellm-top", "chat/completions", request)
    row, _ = request_row(proxy)
    # field case B10's numbers: 100 x 3.00 + 900 x 3.75 + 2000 x 0.30 + 250 x 15.00, per 1M = $0.008025
    assert (row["cache_write_tokens"], row["cached_input_tokens"], row["cost_usd"]) == (900, 2000, Decimal("0.008025"))


def test_cache_reported_outside_the_prompt_is_repaired_and_flagged(proxy, simulator):
    # a relay that passes Anthropic's exclusive input_tokens through as prompt_tokens
    body = fixture_json("litellm_anthropic_relay.json")
    body["usage"] = {
        "prompt_tokens": 100,
        "completion_tokens": 250,
        "total_tokens": 350,
        "prompt_tokens_details": {"cached_tokens": 2000, "cache_creation_tokens": 900},
    }
    request = dict(LITELLM_REQUEST, user="exclusive")
    serve(simulator, "exclusive", "chat_completions", request, body=body)
    send(proxy, "exclusive", "chat/completions", request)
    row, _ = request_row(proxy)
    # rule R1: cached 2000 > prompt 100 cannot be a subset: input = 100 + 2000 + 900 = 3000
    assert (row["input_tokens"], row["cached_input_tokens"], row["cache_write_tokens"]) == (3000, 2000, 900)
    assert row["price_status"] == "repaired" and row["violations"].startswith("R1: cached 2000")
    assert row["cost_usd"] == Decimal("0.008025")  # as B10, not the too-low cost of 100 uncached tokens
    assert json.loads(row["raw_usage"]) == body["usage"]


# --- Groq compound ---------------------------------------------------------------------------------

COMPOUND = {"model": "groq/compound", "messages": [{"role": "user", "content": "What is the weather in SF?"}]}


def test_groq_compound_with_tools_non_streamed(proxy, simulator):
    serve(simulator, "compound-tools", "chat_completions", COMPOUND, body=fixture_json("groq_compound.json"))
    send(proxy, "compound-tools", "chat/completions", COMPOUND)
    row, parts = request_row(proxy, 5)
    # the parts add up to the total (5296 in, 387 out): the compound row keeps the two searches
    assert (row["input_tokens"], row["output_tokens"], row["web_search_requests"]) == (0, 0, 2)
    assert (row["price_status"], row["cost_usd"]) == ("priced", Decimal("0.01"))  # 2 x $0.005
    by_part = sorted((p["served_model"], p["input_tokens"], p["output_tokens"], p["cost_usd"]) for p in parts)
    assert by_part == [
        ("llama-3.3-70b-versatile", 138, 4, Decimal("0.000146")),  # 138 x 1.00 + 4 x 2.00, per 1M
        ("llama-3.3-70b-versatile", 2285, 222, Decimal("0.002729")),  # 2285 x 1.00 + 222 x 2.00
        ("meta-llama/llama-4-scout-17b-16e-instruct", 495, 106, Decimal("0.0001025")),  # 495 x 0.10 + 106 x 0.50
        ("meta-llama/llama-4-scout-17b-16e-instruct", 2378, 55, Decimal("0.0002653")),  # 2378 x 0.10 + 55 x 0.50
    ]
    assert sum(r["cost_usd"] for r in [row, *parts]) == Decimal("0.0132428")


def test_groq_compound_stream_whose_parts_repeat_the_total_gets_one_repaired_row(proxy, simulator):
    request = dict(COMPOUND, stream=True)
    serve(simulator, "compound-stream", "chat_completions", request, sse=fixture_sse("groq_compound_stream.sse"))
    reply = send(proxy, "compound-stream", "chat/completions", request)
    assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
    rows = proxy.rows(1)
    assert len(rows) == 1  # four parts each equal to the total (4 x 5003 > 5003) are not a split: dropped
    (row,) = rows
    assert (row["input_tokens"], row["output_tokens"], row["web_search_requests"]) == (5003, 359, 1)
    # the one search was streamed twice (index 0); groq/compound test prices:
    # 5003 x 1.00/1M + 359 x 2.00/1M + 1 x $0.005 = 0.005003 + 0.000718 + 0.005 = $0.010721
    assert (row["price_status"], row["cost_usd"], row["outcome"]) == ("repaired", Decimal("0.010721"), "ok")
    assert row["violations"].startswith("R3: usage_breakdown parts add up to more than usage")


# --- counts that cannot be true ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_json", "shown"),
    [
        ("10000000000000000000", "10000000000000000000"),
        ("1e30", "1e+30"),
        ("-7", "-7"),
        ('"12"', "'12'"),
        ("12.5", "12.5"),
    ],
)
def test_an_invalid_count_gives_a_flagged_row_and_costs_only_itself(proxy, simulator, prompt_json, shown):
    bad = (
        '{"id":"x","object":"chat.completion","model":"gpt-4o-mini","choices":[],'
        f'"usage":{{"prompt_tokens":{prompt_json},"completion_tokens":5,"total_tokens":19}}}}'
    )
    serve(simulator, "bad-count", "chat_completions", CHAT, text=bad, content_type="application/json")
    good = {
        "id": "y",
        "object": "chat.completion",
        "model": "gpt-4o-mini",
        "choices": [],
        "usage": {"prompt_tokens": 14, "completion_tokens": 5},
    }
    serve(simulator, "good-count", "chat_completions", dict(CHAT, user="good"), body=good)
    assert send(proxy, "bad-count", "chat/completions", CHAT).status_code == 200
    assert send(proxy, "good-count", "chat/completions", dict(CHAT, user="good")).status_code == 200
    bad_row, good_row = proxy.rows(2)  # both in the ledger: one bad value no longer loses a flush
    assert (bad_row["price_status"], bad_row["cost_usd"], bad_row["input_tokens"], bad_row["output_tokens"]) == (
        "usage_invalid",
        None,
        0,
        5,
    )
    assert bad_row["violations"] == f"prompt_tokens: {shown} is not a count (an integer 0 <= n < 2^53)"
    assert bad_row["raw_usage"] is not None and bad_row["outcome"] == "ok"
    # field case B01's numbers: 14 x 0.15/1M + 5 x 0.60/1M = $0.0000051
    assert (good_row["price_status"], good_row["cost_usd"]) == ("priced", Decimal("0.0000051"))
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert "tokenward_usage_invariant_violations_total 1.0" in metrics
