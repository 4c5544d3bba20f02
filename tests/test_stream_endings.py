"""How a reply ended decides its row: terminal events, cuts, in-stream errors, partial estimates.

Token counts of estimates are o200k_base counts worked out here: the request
``[{"role": "user", "content": "hello world"}]`` is 9 input tokens ("hello world" 2, the role
"user" 1, +3 for the message, +3 priming the reply); "The quick brown fox jumps over the lazy
dog." is 10 tokens (one per word, with its leading space, and "."), "Hello" / " world" / "!" one
each. Prices: gpt-4o-mini test prices, 0.15 in / 0.60 out per 1M.
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from tokenward.pricing.catalog import load_catalog
from tokenward.proxy.simulator import RECORD_HEADER, Recording
from tokenward.proxy.sse import MAX_EVENT_BYTES

from .conftest import upstreams_for

PRICES = Path(__file__).parent / "fixtures" / "field_case_prices.yaml"
CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hello world"}]}
FOX = ["The qu", "ick bro", "wn fo", "x jum", "ps ov", "er the la", "zy do", "g."]  # 10 tokens joined, 17 apart


def chunk(**fields) -> str:
    return "data: " + json.dumps(fields, separators=(",", ":")) + "\n\n"


def delta(text: str) -> str:
    return chunk(
        id="c", object="chat.completion.chunk", model="gpt-4o-mini", choices=[{"index": 0, "delta": {"content": text}}]
    )


FINISH = chunk(
    id="c",
    object="chat.completion.chunk",
    model="gpt-4o-mini",
    choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}],
)


@pytest.fixture
def proxy(start_proxy, simulator):
    catalog = load_catalog([PRICES], builtin=False)
    return start_proxy(upstreams=upstreams_for(simulator.url, ["test"]), catalog=catalog)


def serve(simulator, name, request, *, sse=None, text=None):
    response = {"status": 200, "content_type": "text/event-stream" if sse is not None else "application/json"}
    response.update({"sse": sse} if sse is not None else {"text": text})
    simulator.simulator.add(
        Recording(
            name, "test", "openai", "chat_completions", bool(request.get("stream")), {"body": request}, response, None
        )
    )


def post(proxy, name, request):
    return httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=request,
        headers={RECORD_HEADER: name, "x-tokenward-upstream": "test"},
        timeout=60,
    )


def test_content_then_an_error_event_is_billed_as_a_partial_estimate(proxy, simulator):
    error = 'event: error\ndata: {"error":{"message":"Tool choice is required","type":"invalid_request_error"}}\n\n'
    serve(simulator, "content-error", CHAT, sse=delta("Hello") + delta(" world") + delta("!") + error)
    reply = post(proxy, "content-error", CHAT)
    assert reply.status_code == 200 and reply.text.endswith(error)
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["error"], row["usage_source"]) == (
        "upstream_error",
        "Tool choice is required",
        "partial",
    )
    # 9 input tokens, "Hello world!" 3 output tokens: 9 x 0.15/1M + 3 x 0.60/1M = $0.00000315
    assert (row["input_tokens"], row["output_tokens"], row["cost_usd"]) == (9, 3, Decimal("0.00000315"))


def test_an_error_event_before_any_content_is_not_billed(proxy, simulator):
    request = dict(CHAT, user="no-content")
    serve(simulator, "error-first", request, sse='event: error\ndata: {"error":{"message":"overloaded"}}\n\n')
    post(proxy, "error-first", request)
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["usage_source"], row["price_status"], row["cost_usd"]) == (
        "upstream_error",
        "none",
        "not_billed",
        0,
    )


def test_a_stream_that_ends_without_its_terminal_event_failed_and_is_partially_billed(proxy, simulator):
    request = dict(CHAT, user="no-terminal")
    serve(simulator, "no-terminal", request, sse="".join(delta(piece) for piece in FOX))  # closes cleanly, no [DONE]
    reply = post(proxy, "no-terminal", request)
    assert reply.status_code == 200
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["error"]) == ("upstream_failed", "the stream ended without its terminal event")
    # the 8 deltas joined are 10 tokens (counted one by one they would be 17):
    # 9 x 0.15/1M + 10 x 0.60/1M = $0.00000735
    assert (row["usage_source"], row["input_tokens"], row["output_tokens"]) == ("partial", 9, 10)
    assert row["cost_usd"] == Decimal("0.00000735")


def test_a_complete_stream_without_usage_is_estimated_from_each_choice_joined(proxy, simulator):
    request = dict(CHAT, user="finished")
    serve(simulator, "finished", request, sse="".join(delta(piece) for piece in FOX) + FINISH + "data: [DONE]\n\n")
    post(proxy, "finished", request)
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["usage_source"], row["input_tokens"], row["output_tokens"]) == (
        "ok",
        "estimated",
        9,
        10,
    )


def test_a_finish_reason_ends_a_stream_that_sends_no_done(proxy, simulator):
    request = dict(CHAT, user="finish-only")
    usage = chunk(id="c", choices=[], usage={"prompt_tokens": 14, "completion_tokens": 5})
    serve(simulator, "finish-only", request, sse=delta("2, 3, 5") + FINISH + usage)
    post(proxy, "finish-only", request)
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["usage_source"], row["cost_usd"]) == ("ok", "reported", Decimal("0.0000051"))


def test_a_json_body_cut_mid_body_may_be_billed(proxy, simulator):
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "cut"}]}
    cut = '{"id":"chatcmpl-cut","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"content":"Hel'
    serve(simulator, "cut-body", request, text=cut)
    reply = post(proxy, "cut-body", request)
    assert reply.status_code == 200 and reply.text == cut  # relayed as received
    (row,) = proxy.rows(1)
    assert (row["price_status"], row["cost_usd"], row["usage_source"]) == ("usage_unknown", None, "none")


def test_a_body_that_breaks_off_is_usage_unknown_not_free(start_proxy, simulator):
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'{"id":"chatcmpl-x","object":"chat.completion","choices":[{"message":{"content":"Hel'
            raise httpx.ReadError("connection reset by peer")

    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, headers={"content-type": "application/json"}, stream=Broken())
    )
    proxy = start_proxy(upstreams=upstreams_for(simulator.url, ["test"]), transport=transport)
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-tokenward-upstream": "test"},
    )
    assert reply.status_code == 502
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["price_status"], row["cost_usd"]) == ("upstream_failed", "usage_unknown", None)


def test_an_event_over_the_cap_is_relayed_untouched_and_metered_without_its_long_strings(proxy, simulator):
    request = dict(CHAT, user="huge")
    huge = delta("a" * (MAX_EVENT_BYTES + 1024))
    usage = chunk(id="c", choices=[], usage={"prompt_tokens": 14, "completion_tokens": 5})
    sse = delta("start") + huge + FINISH + usage + "data: [DONE]\n\n"
    serve(simulator, "huge", request, sse=sse)
    reply = post(proxy, "huge", request)
    # the client did not ask for usage: tokenward asked, and removes the usage chunk again,
    # while the oversized event goes through byte for byte
    assert reply.content == (delta("start") + huge + FINISH + "data: [DONE]\n\n").encode()
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["usage_source"], row["cost_usd"]) == ("ok", "reported", Decimal("0.0000051"))
    assert row["error"] is None  # the usage was reported: the content left out of the event's copy is not needed
