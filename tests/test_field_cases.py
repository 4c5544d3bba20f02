"""Field cases from shared/fixtures/field-cases.md, through the real proxy, with their exact numbers.

Each case's upstream reply is served by the simulator as a synthetic recording; prices are the
field cases' test prices (tests/fixtures/field_case_prices.yaml, USD per 1M tokens).
"""

from __future__ import annotations

import gzip
import json
from decimal import Decimal
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tokenward.pricing.catalog import load_catalog
from tokenward.proxy.simulator import FAULT_HEADER, RECORD_HEADER, Recording

PRICES = Path(__file__).parent / "fixtures" / "field_case_prices.yaml"


@pytest.fixture(scope="module")
def catalog():
    return load_catalog([PRICES], builtin=False)


@pytest.fixture
def proxy(start_proxy, catalog, simulator):
    from .conftest import upstreams_for

    return start_proxy(upstreams=upstreams_for(simulator.url, ["test", "anthropic-test"]), catalog=catalog)


def chunk(**fields) -> str:
    return "data: " + json.dumps(fields, separators=(",", ":")) + "\n\n"


def register(simulator, case: str, endpoint: str, request: dict, *, body=None, sse=None, dialect="openai") -> Recording:
    response = {"status": 200, "content_type": "text/event-stream" if sse else "application/json"}
    response.update({"sse": sse} if sse else {"body": body})
    recording = Recording(
        case, "test", dialect, endpoint, bool(request.get("stream")), {"body": request}, response, None
    )
    simulator.simulator.add(recording)
    return recording


def row_of(proxy):
    (row,) = proxy.rows(1)
    return row


def tokens(row):
    return {
        k: row[k]
        for k in ("input_tokens", "cached_input_tokens", "cache_write_tokens", "output_tokens", "reasoning_tokens")
    }


def openai_client(proxy, upstream="test"):
    return openai.OpenAI(
        base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0, default_headers={"x-tokenward-upstream": upstream}
    )


B01_REQUEST = {
    "model": "gpt-4o-mini",
    "stream": True,
    "messages": [{"role": "user", "content": "Give me three prime numbers, comma separated."}],
}
B01_CHUNKS = [
    {
        "id": "chatcmpl-b01",
        "object": "chat.completion.chunk",
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
    },
    {
        "id": "chatcmpl-b01",
        "object": "chat.completion.chunk",
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [{"index": 0, "delta": {"content": "2, 3, 5"}, "finish_reason": None}],
    },
    {
        "id": "chatcmpl-b01",
        "object": "chat.completion.chunk",
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    },
]
B01_USAGE = {
    "id": "chatcmpl-b01",
    "choices": [],
    "usage": {
        "prompt_tokens": 14,
        "completion_tokens": 5,
        "total_tokens": 19,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    },
}


def test_b01_stream_usage_is_asked_for_and_hidden_again(proxy, simulator):
    # the upstream sends the usage chunk only because tokenward asked for it
    sse = "".join(chunk(**c) for c in B01_CHUNKS) + chunk(**B01_USAGE) + "data: [DONE]\n\n"
    register(simulator, "B01", "chat_completions", {**B01_REQUEST, "stream_options": {"include_usage": True}}, sse=sse)
    with openai_client(proxy) as client:
        events = list(client.chat.completions.create(**B01_REQUEST, extra_headers={RECORD_HEADER: "B01"}))
    assert len(events) == 3 and all(e.choices for e in events)  # no extra usage chunk reaches the client
    row = row_of(proxy)
    assert tokens(row) == {
        "input_tokens": 14,
        "cached_input_tokens": 0,
        "cache_write_tokens": 0,
        "output_tokens": 5,
        "reasoning_tokens": 0,
    }
    # 14 * 0.15 + 5 * 0.60 = 5.1 -> $0.0000051
    assert row["cost_usd"] == Decimal("0.0000051") and row["usage_source"] == "reported"


def test_b01_upstream_that_ignores_include_usage_is_estimated_not_zero(proxy, simulator):
    sse = "".join(chunk(**c) for c in B01_CHUNKS) + "data: [DONE]\n\n"
    register(simulator, "B01-no-usage", "chat_completions", B01_REQUEST, sse=sse)
    with openai_client(proxy) as client:
        list(client.chat.completions.create(**B01_REQUEST, extra_headers={RECORD_HEADER: "B01-no-usage"}))
    row = row_of(proxy)
    # o200k_base: the 9 tokens of the content + 1 for the role "user" + 3 per message + 3 reply priming
    # = 16 input; "2, 3, 5" is 7 tokens ("2" "," " " "3" "," " " "5")
    assert (row["usage_source"], row["input_tokens"], row["output_tokens"]) == ("estimated", 16, 7)
    # 16 * 0.15 + 7 * 0.60 = 6.6 -> $0.0000066
    assert row["cost_usd"] == Decimal("0.0000066")


def test_b03_responses_stream_usage_from_response_completed(proxy, simulator):
    request = {"model": "gpt-4.1-mini", "input": "Summarize the plot of Hamlet in one sentence.", "stream": True}
    sse = (
        'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":{"id":"resp_b03",'
        '"status":"in_progress","usage":null}}\n\n'
        'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":4,'
        '"item_id":"msg_b03","output_index":0,"content_index":0,"delta":"A grieving Danish prince feigns madness"}\n\n'
        'event: response.completed\ndata: {"type":"response.completed","sequence_number":9,"response":{"id":"resp_b03",'
        '"status":"completed","usage":{"input_tokens":21,"input_tokens_details":{"cached_tokens":0},"output_tokens":38,'
        '"output_tokens_details":{"reasoning_tokens":0},"total_tokens":59}}}\n\n'
    )
    register(simulator, "B03", "responses", request, sse=sse)
    reply = httpx.post(
        f"{proxy.url}/v1/responses", json=request, headers={RECORD_HEADER: "B03", "x-tokenward-upstream": "test"}
    )
    assert reply.text == sse  # relayed untouched
    row = row_of(proxy)
    assert (row["input_tokens"], row["output_tokens"], row["requested_model"]) == (21, 38, "gpt-4.1-mini")
    # 21 * 0.40 + 38 * 1.60 = 69.2 -> $0.0000692
    assert row["cost_usd"] == Decimal("0.0000692")


def test_b05_anthropic_final_counts_only_on_message_delta(proxy, simulator):
    request = {
        "model": "claude-sonnet-4",
        "max_tokens": 256,
        "stream": True,
        "messages": [{"role": "user", "content": "Does rule 7 apply to contractors?"}],
    }
    sse = (
        'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_b05","model":"claude-sonnet-4",'
        '"usage":{"input_tokens":0,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":0}}}\n\n'
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Yes."}}\n\n'
        'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":12,'
        '"cache_creation_input_tokens":4510,"cache_read_input_tokens":0,"output_tokens":5}}\n\n'
        'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    register(simulator, "B05", "anthropic_messages", request, sse=sse, dialect="anthropic")
    reply = httpx.post(
        f"{proxy.url}/v1/messages",
        json=request,
        headers={RECORD_HEADER: "B05", "x-tokenward-upstream": "anthropic-test"},
    )
    assert reply.text == sse
    row = row_of(proxy)
    assert tokens(row) == {
        "input_tokens": 4522,
        "cached_input_tokens": 0,
        "cache_write_tokens": 4510,
        "output_tokens": 5,
        "reasoning_tokens": 0,
    }
    # 12 * 3.00 + 4510 * 3.75 + 5 * 15.00 = 17023.5 -> $0.0170235 (the buggy output-only figure: $0.000075)
    assert row["cost_usd"] == Decimal("0.0170235")


B07_REQUEST = {
    "model": "grok-3",
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "And what about Tuesday?"}],
}
B07_USAGE = {
    "prompt_tokens": 2400,
    "completion_tokens": 80,
    "total_tokens": 2480,
    "prompt_tokens_details": {"cached_tokens": 2304, "text_tokens": 2400, "audio_tokens": 0, "image_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0},
}


def test_b07_stream_and_non_stream_bill_cached_tokens_the_same(proxy, simulator):
    sse = (
        chunk(
            id="b07",
            object="chat.completion.chunk",
            model="grok-3",
            choices=[{"index": 0, "delta": {"content": "Tuesday is free."}, "finish_reason": "stop"}],
        )
        + chunk(id="b07", object="chat.completion.chunk", choices=[], usage=B07_USAGE)
        + "data: [DONE]\n\n"
    )
    register(simulator, "B07-stream", "chat_completions", B07_REQUEST, sse=sse)
    plain_request = {k: v for k, v in B07_REQUEST.items() if k not in ("stream", "stream_options")}
    body = {
        "id": "b07",
        "object": "chat.completion",
        "model": "grok-3",
        "usage": B07_USAGE,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Tuesday is free."}, "finish_reason": "stop"}
        ],
    }
    register(simulator, "B07-plain", "chat_completions", plain_request, body=body)
    with openai_client(proxy) as client:
        events = list(client.chat.completions.create(**B07_REQUEST, extra_headers={RECORD_HEADER: "B07-stream"}))
        client.chat.completions.create(**plain_request, extra_headers={RECORD_HEADER: "B07-plain"})
    assert events[-1].usage.prompt_tokens_details.cached_tokens == 2304  # the client sees the same object
    streamed, plain = proxy.rows(2)
    assert (
        tokens(streamed)
        == tokens(plain)
        == {
            "input_tokens": 2400,
            "cached_input_tokens": 2304,
            "cache_write_tokens": 0,
            "output_tokens": 80,
            "reasoning_tokens": 0,
        }
    )
    # uncached 96 * 3.00 + cached 2304 * 0.75 + output 80 * 15.00 = 3216 -> $0.003216 (buggy: $0.0084)
    assert streamed["cost_usd"] == plain["cost_usd"] == Decimal("0.003216")


@pytest.mark.parametrize(
    ("case", "model", "usage", "expected_tokens", "cost"),
    [
        # B09: cached_tokens is part of prompt_tokens: 102 * 2.50 + 2048 * 1.25 + 120 * 10.00 = 4015
        (
            "B09",
            "gpt-4o",
            {
                "prompt_tokens": 2150,
                "completion_tokens": 120,
                "total_tokens": 2270,
                "prompt_tokens_details": {"cached_tokens": 2048, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0},
            },
            (2150, 2048, 0, 120, 0),
            "0.004015",
        ),
        # B12: DeepSeek's own fields only: 112 * 0.27 + 5888 * 0.07 + 300 * 1.10 = 772.4
        (
            "B12",
            "deepseek-chat",
            {
                "prompt_tokens": 6000,
                "completion_tokens": 300,
                "total_tokens": 6300,
                "prompt_cache_hit_tokens": 5888,
                "prompt_cache_miss_tokens": 112,
            },
            (6000, 5888, 0, 300, 0),
            "0.0007724",
        ),
    ],
)
def test_b09_b12_cached_input_priced_once(proxy, simulator, case, model, usage, expected_tokens, cost):
    request = {"model": model, "messages": [{"role": "user", "content": "Next question: what is the refund window?"}]}
    register(
        simulator,
        case,
        "chat_completions",
        request,
        body={"id": case, "object": "chat.completion", "model": model, "usage": usage, "choices": []},
    )
    with openai_client(proxy) as client:
        client.chat.completions.create(**request, extra_headers={RECORD_HEADER: case})
    row = row_of(proxy)
    assert tuple(tokens(row).values()) == expected_tokens and row["cost_usd"] == Decimal(cost)


def test_b10_anthropic_cache_writes_priced_once(proxy, simulator):
    request = {"model": "claude-sonnet-4", "max_tokens": 512, "messages": [{"role": "user", "content": "Summarize."}]}
    body = {
        "id": "msg_b10",
        "type": "message",
        "model": "claude-sonnet-4",
        "stop_reason": "end_turn",
        "content": [{"type": "text", "text": "Here is the summary..."}],
        "usage": {
            "input_tokens": 100,
            "cache_creation_input_tokens": 900,
            "cache_read_input_tokens": 2000,
            "output_tokens": 250,
        },
    }
    register(simulator, "B10", "anthropic_messages", request, body=body, dialect="anthropic")
    with anthropic.Anthropic(
        base_url=proxy.url, api_key="sk-ant", max_retries=0, default_headers={"x-tokenward-upstream": "anthropic-test"}
    ) as client:
        client.messages.create(**request, extra_headers={RECORD_HEADER: "B10"})
    row = row_of(proxy)
    assert tokens(row) == {
        "input_tokens": 3000,
        "cached_input_tokens": 2000,
        "cache_write_tokens": 900,
        "output_tokens": 250,
        "reasoning_tokens": 0,
    }
    # 100 * 3.00 + 900 * 3.75 + 2000 * 0.30 + 250 * 15.00 = 8025 -> $0.008025 (buggy: $0.010725)
    assert row["cost_usd"] == Decimal("0.008025")


def test_b13_responses_cached_tokens(proxy, simulator):
    request = {"model": "gpt-4.1", "instructions": "<style guide>", "input": "Rewrite paragraph 3 in plain English."}
    body = {
        "id": "resp_b13",
        "object": "response",
        "status": "completed",
        "model": "gpt-4.1",
        "usage": {
            "input_tokens": 5200,
            "input_tokens_details": {"cached_tokens": 4864},
            "output_tokens": 410,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 5610,
        },
    }
    register(simulator, "B13", "responses", request, body=body)
    with openai_client(proxy) as client:
        client.responses.create(
            model="gpt-4.1", instructions="<style guide>", input=request["input"], extra_headers={RECORD_HEADER: "B13"}
        )
    row = row_of(proxy)
    assert tuple(tokens(row).values()) == (5200, 4864, 0, 410, 0)
    # 336 * 2.00 + 4864 * 0.50 + 410 * 8.00 = 6384 -> $0.006384 (buggy: $0.01368)
    assert row["cost_usd"] == Decimal("0.006384")


B25_REQUEST = {
    "model": "gpt-4o",
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "Write a 2000-word story about a lighthouse keeper."}],
}


def b25_stream(with_usage: bool) -> str:
    events = [
        chunk(
            id="b25",
            object="chat.completion.chunk",
            model="gpt-4o-2024-08-06",
            choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        )
    ]
    events += [
        chunk(
            id="b25",
            object="chat.completion.chunk",
            model="gpt-4o-2024-08-06",
            choices=[{"index": 0, "delta": {"content": " wave"}, "finish_reason": None}],
        )
        for _ in range(150)
    ]
    if with_usage:
        events.append(
            chunk(
                id="b25",
                object="chat.completion.chunk",
                choices=[],
                usage={"prompt_tokens": 20, "completion_tokens": 2650, "total_tokens": 2670},
            )
        )
    return "".join(events) + "data: [DONE]\n\n"


def test_b25_client_disconnect_keeps_reading_for_the_usage(proxy, simulator):
    register(simulator, "B25", "chat_completions", B25_REQUEST, sse=b25_stream(True))
    with httpx.stream(
        "POST",
        f"{proxy.url}/v1/chat/completions",
        json=B25_REQUEST,
        headers={RECORD_HEADER: "B25", "x-tokenward-upstream": "test", FAULT_HEADER: "delay:2"},
    ) as reply:
        next(reply.iter_raw())  # the client hangs up after the first event
    row = row_of(proxy)
    assert (row["outcome"], row["usage_source"], row["input_tokens"], row["output_tokens"]) == (
        "client_disconnected",
        "reported",
        20,
        2650,
    )
    # 20 * 2.50 + 2650 * 10.00 = 26550 -> $0.02655
    assert row["cost_usd"] == Decimal("0.02655")


def test_b25_stream_cut_before_usage_bills_input_and_output_seen(proxy, simulator):
    register(simulator, "B25-cut", "chat_completions", B25_REQUEST, sse=b25_stream(False))
    received = b""
    with pytest.raises(httpx.RemoteProtocolError):  # the stream breaks off, as it did upstream
        with httpx.stream(
            "POST",
            f"{proxy.url}/v1/chat/completions",
            json=B25_REQUEST,
            headers={RECORD_HEADER: "B25-cut", "x-tokenward-upstream": "test", FAULT_HEADER: "cut:151"},
        ) as reply:
            for piece in reply.iter_raw():
                received += piece
    assert received.count(b"data: ") == 151
    row = row_of(proxy)
    # input counted from the request (o200k_base): 12 content tokens ("Write" " a" " " "200" "0" "-word" " story"
    # " about" " a" " lighthouse" " keeper" ".") + 1 role + 3 per message + 3 priming = 19;
    # output: the 150 deltas " wave" received, one token each
    assert (row["outcome"], row["usage_source"], row["input_tokens"], row["output_tokens"]) == (
        "upstream_failed",
        "partial",
        19,
        150,
    )
    # 19 * 2.50 + 150 * 10.00 = 1547.5 -> $0.0015475 (the field case's rougher lower bound: $0.00154 with 16 input)
    assert row["cost_usd"] == Decimal("0.0015475")


def test_b30_gzip_body_is_decoded_for_metering_and_relayed_as_sent(proxy, simulator):
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "ping"}]}
    body = {
        "id": "chatcmpl-b30",
        "object": "chat.completion",
        "usage": {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42},
    }
    register(simulator, "B30", "chat_completions", request, body=body)
    headers = {RECORD_HEADER: "B30", FAULT_HEADER: "gzip", "accept-encoding": "gzip"}
    with httpx.stream(
        "POST", f"{proxy.url}/v1/chat/completions", json=request, headers={**headers, "x-tokenward-upstream": "test"}
    ) as via:
        raw = b"".join(via.iter_raw())
        assert via.headers["content-encoding"] == "gzip"
    assert raw[:2] == b"\x1f\x8b" and json.loads(gzip.decompress(raw)) == body  # relayed as the upstream sent it
    row = row_of(proxy)
    assert (row["input_tokens"], row["output_tokens"]) == (30, 12)
    # 30 * 0.15 + 12 * 0.60 = 11.7 -> $0.0000117
    assert row["cost_usd"] == Decimal("0.0000117")


def test_error_event_on_http_200_is_not_billed_as_output(proxy, simulator):
    request = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Use the tool."}]}
    sse = (
        chunk(
            id="e",
            object="chat.completion.chunk",
            model="gpt-4o-mini",
            choices=[{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}],
        )
        + 'event: error\ndata: {"error":{"message":"Tool choice is required, but model did not call a tool",'
        '"type":"invalid_request_error","code":"tool_use_failed"}}\n\n'
    )
    register(simulator, "error-200", "chat_completions", request, sse=sse)
    httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=request,
        headers={RECORD_HEADER: "error-200", "x-tokenward-upstream": "test"},
    )
    row = row_of(proxy)
    assert row["outcome"] == "upstream_error" and "Tool choice is required" in row["error"]
    assert (row["usage_source"], row["output_tokens"], row["cost_usd"]) == ("none", 0, 0)


@pytest.mark.parametrize(
    ("case", "usage", "expected", "cost"),
    [
        # n=2: usage is the total over both choices: 30 * 0.15 + 40 * 0.60 = 28.5
        (
            "n2",
            {"prompt_tokens": 30, "completion_tokens": 40, "total_tokens": 70},
            {"input_tokens": 30, "output_tokens": 40},
            "0.0000285",
        ),
        # predicted outputs: rejected prediction tokens are inside completion_tokens and billed: 93 * 0.60
        (
            "prediction",
            {
                "prompt_tokens": 100,
                "completion_tokens": 93,
                "total_tokens": 193,
                "completion_tokens_details": {"accepted_prediction_tokens": 89, "rejected_prediction_tokens": 4},
            },
            {"input_tokens": 100, "output_tokens": 93},
            "0.0000708",
        ),
        # image input tokens are a subset of input: 800 * 0.15 + 10 * 0.60 = 126
        (
            "image",
            {
                "prompt_tokens": 800,
                "completion_tokens": 10,
                "prompt_tokens_details": {"image_tokens": 765, "cached_tokens": 0},
            },
            {"input_tokens": 800, "image_input_tokens": 765, "output_tokens": 10},
            "0.000126",
        ),
    ],
)
def test_choices_predictions_and_images(proxy, simulator, case, usage, expected, cost):
    request = {"model": "gpt-4o-mini", "n": 2, "messages": [{"role": "user", "content": case}]}
    choices = [
        {
            "index": i,
            "message": {
                "role": "assistant",
                "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            "finish_reason": "tool_calls",
        }
        for i in range(2)
    ]
    register(
        simulator,
        case,
        "chat_completions",
        request,
        body={"id": case, "object": "chat.completion", "model": "gpt-4o-mini", "usage": usage, "choices": choices},
    )
    with openai_client(proxy) as client:
        reply = client.chat.completions.create(**request, extra_headers={RECORD_HEADER: case})
    assert len(reply.choices) == 2
    row = row_of(proxy)
    assert {k: row[k] for k in expected} == expected and row["cost_usd"] == Decimal(cost)


def test_audio_tokens_priced_at_audio_rates(proxy, simulator):
    request = {
        "model": "gpt-4o-audio-preview",
        "modalities": ["text", "audio"],
        "messages": [{"role": "user", "content": "Say hi"}],
    }
    usage = {
        "prompt_tokens": 64,
        "completion_tokens": 40,
        "total_tokens": 104,
        "prompt_tokens_details": {"audio_tokens": 44, "text_tokens": 20, "cached_tokens": 0},
        "completion_tokens_details": {"audio_tokens": 30, "text_tokens": 10},
    }
    register(
        simulator,
        "audio",
        "chat_completions",
        request,
        body={"id": "a", "object": "chat.completion", "model": "gpt-4o-audio-preview", "usage": usage, "choices": []},
    )
    httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=request,
        headers={RECORD_HEADER: "audio", "x-tokenward-upstream": "test"},
    )
    row = row_of(proxy)
    assert (row["audio_input_tokens"], row["audio_output_tokens"]) == (44, 30)
    # text in 20 * 2.50 + audio in 44 * 40.00 + text out 10 * 10.00 + audio out 30 * 80.00 = 4310 -> $0.00431
    assert row["cost_usd"] == Decimal("0.00431")


def test_broken_invariants_are_repaired_flagged_and_counted(proxy, simulator):
    # seen in the corpus (OpenRouter): reasoning_tokens 11 > completion_tokens 10, while the total
    # (53 = 43 + 10) vouches for the output: repair rule R2 clamps reasoning to it
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "odd usage"}]}
    usage = {
        "prompt_tokens": 43,
        "completion_tokens": 10,
        "total_tokens": 53,
        "completion_tokens_details": {"reasoning_tokens": 11},
    }
    register(
        simulator,
        "invariant",
        "chat_completions",
        request,
        body={"id": "i", "object": "chat.completion", "model": "gpt-4o-mini", "usage": usage, "choices": []},
    )
    httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=request,
        headers={RECORD_HEADER: "invariant", "x-tokenward-upstream": "test"},
    )
    row = row_of(proxy)
    assert (row["output_tokens"], row["reasoning_tokens"]) == (10, 10)
    assert row["violations"] == "R2: reasoning_tokens 11 > completion_tokens 10: clamped to the output"
    # never plain priced: 43 x 0.15/1M + 10 x 0.60/1M = $0.00001245, status repaired, what was reported kept
    assert (row["price_status"], row["cost_usd"]) == ("repaired", Decimal("0.00001245"))
    assert json.loads(row["raw_usage"]) == usage
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert "tokenward_usage_invariant_violations_total 1.0" in metrics
    assert 'tokenward_requests_total{endpoint="chat_completions",outcome="ok",upstream="test"} 1.0' in metrics
    assert 'tokenward_tokens_total{kind="input_tokens",model="gpt-4o-mini"} 43.0' in metrics


def test_groq_compound_inner_models_become_parts(proxy, simulator):
    # shape from pydantic-ai's cassette test_groq_model_web_search_tool.yaml: usage is the total over
    # usage_breakdown.models (138 + 495 + 2378 + 2285 = 5296 in, 4 + 106 + 55 + 222 = 387 out)
    request = {
        "model": "groq/compound",
        "messages": [{"role": "user", "content": "What is the weather in San Francisco today?"}],
    }
    inner = [
        ("llama-3.3-70b-versatile", 138, 4),
        ("meta-llama/llama-4-scout-17b-16e-instruct", 495, 106),
        ("meta-llama/llama-4-scout-17b-16e-instruct", 2378, 55),
        ("llama-3.3-70b-versatile", 2285, 222),
    ]
    body = {
        "id": "stub",
        "object": "chat.completion",
        "model": "groq/compound",
        "choices": [],
        "usage": {"prompt_tokens": 5296, "completion_tokens": 387, "total_tokens": 5683, "queue_time": 0.22},
        "usage_breakdown": {
            "models": [
                {"model": m, "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}
                for m, p, c in inner
            ]
        },
    }
    register(simulator, "compound", "chat_completions", request, body=body)
    httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=request,
        headers={RECORD_HEADER: "compound", "x-tokenward-upstream": "test"},
    )
    rows = proxy.rows(5)
    main = next(r for r in rows if r["row_kind"] == "request")
    parts = sorted((r["served_model"], r["input_tokens"], r["output_tokens"]) for r in rows if r["row_kind"] == "part")
    assert parts == sorted((m, p, c) for m, p, c in inner)
    assert all(r["parent_request_id"] == main["request_id"] for r in rows if r["row_kind"] == "part")
    # the compound model's own row keeps what the parts leave over: nothing, so tokens are not counted twice
    assert (main["served_model"], main["input_tokens"], main["output_tokens"]) == ("groq/compound", 0, 0)
    assert sum(r["input_tokens"] for r in rows) == 5296 and sum(r["output_tokens"] for r in rows) == 387


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("served", "resolved_by"),
    [
        ("azure/o1-2024-12-17", "snapshot"),  # the name B22's gateway logged: a routing prefix and a snapshot
        ("openrouter/openai/o1", "routing_prefix"),  # LiteLLM's name for OpenRouter's openai/o1
        ("openai/o1-2024-12-17", "snapshot"),  # a vendor prefix naming no provider of this catalog
    ],
)
def test_b22_a_routing_prefix_and_a_snapshot_are_stripped_to_the_base_model(
    proxy, simulator, served, resolved_by, stream
):
    # 500 * 15.00 + 2000 * 60.00 = 127500 -> $0.1275 (reasoning is inside the output); before, every one of
    # these names was unpriced (cost NULL): the prefix was kept, so neither the name nor its base was found
    usage = {
        "prompt_tokens": 500,
        "completion_tokens": 2000,
        "total_tokens": 2500,
        "completion_tokens_details": {"reasoning_tokens": 1600},
    }
    request = {"model": served, "messages": [{"role": "user", "content": "Prove it."}]}
    choice = {"index": 0, "message": {"role": "assistant", "content": "QED"}, "finish_reason": "stop"}
    if stream:
        head = {"id": "b22", "object": "chat.completion.chunk", "model": served}
        sse = (
            chunk(**head, choices=[{"index": 0, "delta": {"content": "QED"}, "finish_reason": None}])
            + chunk(**head, choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}])
            + chunk(**head, choices=[], usage=usage)
            + "data: [DONE]\n\n"
        )
        sent = {**request, "stream": True, "stream_options": {"include_usage": True}}
        register(simulator, f"B22-{served}", "chat_completions", sent, sse=sse)
    else:
        body = {"id": "b22", "object": "chat.completion", "model": served, "choices": [choice], "usage": usage}
        register(simulator, f"B22-{served}", "chat_completions", request, body=body)
    with openai_client(proxy) as client:
        reply = client.chat.completions.create(**request, stream=stream, extra_headers={RECORD_HEADER: f"B22-{served}"})
        if stream:
            assert "".join(c.choices[0].delta.content or "" for c in reply if c.choices) == "QED"
    row = row_of(proxy)
    assert (row["served_model"], row["price_status"], row["price_entry_id"]) == (served, "priced", "test/o1")
    assert (row["price_resolved_by"], row["cost_usd"]) == (resolved_by, Decimal("0.1275"))
    assert (row["input_tokens"], row["output_tokens"], row["reasoning_tokens"]) == (500, 2000, 1600)
