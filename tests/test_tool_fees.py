"""Provider-run tools billed outside the tokens: every call is counted, none is billed as free.

A real proxy in front of :class:`~tests.raw_upstream.RawUpstream` (the ``raw_proxy`` fixture),
the real ``openai`` and ``anthropic`` SDKs as clients, the built-in prices: gpt-4.1 2.00 in /
8.00 out per 1M tokens; claude-sonnet-4-5 3 in / 15 out and web search $0.01 a call. The
reference (``shared/reference/usage-and-pricing.md``) gives no fee for OpenAI file search or code
interpreter, nor for Anthropic web fetch or code execution: such a row is ``partially_priced``
with a note and keeps the counts, so an operator can add the fee to a price file and re-price.
"""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal

import anthropic
import openai
import pytest

from tokenward.pricing.catalog import Resolution, load_catalog, parse_entry
from tokenward.pricing.quote import quote
from tokenward.pricing.usage import Usage

from .raw_upstream import LAST_CHUNK, chunk, json_reply, sse_head

USAGE = {"input_tokens": 1000, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 100,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 1100}  # fmt: skip
ITEMS = [  # two file searches; three code interpreter calls in two containers (billed per container)
    {"type": "file_search_call", "id": "fs_1", "status": "completed", "queries": ["q"], "results": None},
    {"type": "file_search_call", "id": "fs_2", "status": "completed", "queries": ["r"], "results": None},
    {"type": "code_interpreter_call", "id": "ci_1", "status": "completed", "code": "1", "container_id": "cntr_a",
     "outputs": None},
    {"type": "code_interpreter_call", "id": "ci_2", "status": "completed", "code": "2", "container_id": "cntr_a",
     "outputs": None},
    {"type": "code_interpreter_call", "id": "ci_3", "status": "completed", "code": "3", "container_id": "cntr_b",
     "outputs": None},
    {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "Hi", "annotations": []}]},
]  # fmt: skip
RESPONSE = {"id": "resp_t", "object": "response", "created_at": 1, "status": "completed", "model": "gpt-4.1",
            "error": None, "output": ITEMS, "usage": USAGE, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": []}  # fmt: skip


def event(obj: dict, name: str) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def responses_reply(stream: bool, response: dict = RESPONSE) -> list[bytes]:
    """``response`` whole, or streamed: created, each output item done, then completed (repeating them)."""
    if not stream:
        return [json_reply(json.dumps(response).encode())]
    created = {**response, "status": "in_progress", "output": [], "usage": None}
    events = [event({"type": "response.created", "sequence_number": 0, "response": created}, "response.created")]
    for index, item in enumerate(response["output"]):
        done = {"type": "response.output_item.done", "sequence_number": index + 1, "output_index": index, "item": item}
        events.append(event(done, "response.output_item.done"))
    completed = {"type": "response.completed", "sequence_number": 9, "response": response}
    events.append(event(completed, "response.completed"))
    return [sse_head(), *(chunk(e) for e in events), LAST_CHUNK]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_file_search_and_code_interpreter_calls_are_counted_and_never_billed_as_free(raw_proxy, raw_upstream, stream):
    proxy = raw_proxy()
    raw_upstream.script = lambda head, body: responses_reply(stream)
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as client:
        request = {
            "model": "gpt-4.1",
            "input": "find it",
            "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}],
        }
        if stream:
            assert [e.type for e in client.responses.create(**request, stream=True)][-1] == "response.completed"
        else:
            assert client.responses.create(**request).usage.output_tokens == 100
    (row,) = proxy.rows(1)
    # tokens: 1000 x 2.00 + 100 x 8.00 = 2800 -> $0.0028; before, the row said "priced" at $0.0028 with
    # no trace of the 2 file searches or the 2 containers OpenAI bills on top
    assert (row["cost_usd"], row["price_status"]) == (Decimal("0.0028"), "partially_priced")
    assert (row["file_search_calls"], row["code_containers"], row["web_search_requests"]) == (2, 2, 0)
    notes = [line["note"] for line in json.loads(row["cost_lines"]) if "note" in line]
    assert notes == [
        "2 file search calls and no fee for them in openai/gpt-4.1: not billed",
        "2 code execution containers and no fee for them in openai/gpt-4.1: not billed",
    ]


def test_a_price_file_fee_for_the_tools_prices_them(tmp_path):
    raw = {"id": "openai/gpt-4.1", "provider": "openai", "model": "gpt-4.1", "input": Decimal("2.00"),
           "output": Decimal("8.00"), "file_search": Decimal("0.0025"), "code_container": Decimal("0.03"),
           "web_fetch": Decimal(0), "source": "test", "checked": dt.date(2026, 12, 1)}  # fmt: skip
    resolution = Resolution(parse_entry(tmp_path / "p.yaml", 0, raw), "exact")
    catalog = load_catalog(builtin=False)
    catalog.add(resolution.entry)
    usage = Usage(input_tokens=1000, output_tokens=100, file_search_calls=2, code_containers=2, web_fetch_requests=3)
    found = quote(catalog, usage, model="gpt-4.1", provider="openai", at=None)
    # 0.0028 + 2 x 0.0025 + 2 x 0.03 + 3 x 0 = 0.0678
    assert (found.status, found.cost_usd) == ("priced", Decimal("0.0678"))
    fees = {line["component"]: (line["quantity"], line["amount"]) for line in found.lines}
    assert fees["file_search"] == (2, Decimal("0.0050")) and fees["code_container"] == (2, Decimal("0.06"))
    assert fees["web_fetch"] == (3, Decimal(0))


def anthropic_reply(stream: bool) -> list[bytes]:
    """claude-sonnet-4-5: 1000 in, 100 out, 2 web searches, 3 web fetches and one code execution."""
    usage = {"input_tokens": 1000, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
             "output_tokens": 100, "server_tool_use": {"web_search_requests": 2, "web_fetch_requests": 3}}  # fmt: skip
    tool = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "bash_code_execution", "input": {"command": "ls"}}
    text = {"type": "text", "text": "Hi"}
    message = {"id": "msg_t", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
               "stop_sequence": None, "container": {"id": "container_1", "expires_at": "2026-12-01T00:00:00Z"}}  # fmt: skip
    if not stream:
        body = {**message, "content": [tool, text], "stop_reason": "end_turn", "usage": usage}
        return [json_reply(json.dumps(body).encode())]
    start = {**usage, "output_tokens": 1, "server_tool_use": {"web_search_requests": 0, "web_fetch_requests": 0}}
    events = [
        event({"type": "message_start", "message": {**message, "content": [], "stop_reason": None, "usage": start}},
              "message_start"),
        event({"type": "content_block_start", "index": 0, "content_block": {**tool, "input": {}}}, "content_block_start"),
        event({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        event({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
              "content_block_start"),
        event({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hi"}},
              "content_block_delta"),
        event({"type": "content_block_stop", "index": 1}, "content_block_stop"),
        event({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
               "usage": {"output_tokens": 100, "server_tool_use": usage["server_tool_use"]}}, "message_delta"),
        event({"type": "message_stop"}, "message_stop"),
    ]  # fmt: skip
    return [sse_head(), *(chunk(e) for e in events), LAST_CHUNK]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_web_fetches_and_code_execution_are_counted_and_never_billed_as_free(raw_proxy, raw_upstream, stream):
    proxy = raw_proxy()
    raw_upstream.script = lambda head, body: anthropic_reply(stream)
    with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0) as client:
        request = {"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
        if stream:
            with client.messages.stream(**request) as events:
                assert events.get_final_message().usage.output_tokens == 100
        else:
            assert client.messages.create(**request).usage.output_tokens == 100
    (row,) = proxy.rows(1)
    # 1000 x 3 + 100 x 15 = 4500 -> $0.0045, + 2 searches x $0.01 = $0.0245; before: "priced", the
    # fetches and the container not counted
    assert (row["cost_usd"], row["price_status"]) == (Decimal("0.0245"), "partially_priced")
    assert (row["web_search_requests"], row["web_fetch_requests"], row["code_containers"]) == (2, 3, 1)
    notes = [line["note"] for line in json.loads(row["cost_lines"]) if "note" in line]
    assert notes == [
        "3 web fetch calls and no fee for them in anthropic/claude-sonnet-4-5: not billed",
        "1 code execution containers and no fee for them in anthropic/claude-sonnet-4-5: not billed",
    ]


IMAGE_ITEMS = [  # the image tool ran twice; the same call repeated in response.completed counts once
    {"type": "image_generation_call", "id": "ig_1", "status": "completed", "result": "aGk=", "size": "1024x1024",
     "quality": "low"},
    {"type": "image_generation_call", "id": "ig_2", "status": "completed", "result": "aGk=", "size": "1024x1024",
     "quality": "low"},
    {"type": "message", "id": "msg_2", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "Here", "annotations": []}]},
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_image_generation_calls_are_counted_and_never_billed_as_free(raw_proxy, raw_upstream, stream):
    proxy = raw_proxy()
    raw_upstream.script = lambda head, body: responses_reply(
        stream, {**RESPONSE, "id": "resp_img", "output": IMAGE_ITEMS}
    )
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as client:
        request = {"model": "gpt-4.1", "input": "draw two cats", "tools": [{"type": "image_generation"}]}
        if stream:
            assert [e.type for e in client.responses.create(**request, stream=True)][-1] == "response.completed"
        else:
            assert client.responses.create(**request).usage.output_tokens == 100
    (row,) = proxy.rows(1)
    # tokens: 1000 x 2.00 + 100 x 8.00 = 2800 -> $0.0028. Before: "priced" at $0.0028 with no trace of
    # the two images OpenAI bills for the tool (the reference gives no per-image fee for it)
    assert (row["cost_usd"], row["price_status"], row["image_generation_calls"]) == (
        Decimal("0.0028"),
        "partially_priced",
        2,
    )
    notes = [line["note"] for line in json.loads(row["cost_lines"]) if "note" in line]
    assert notes == ["2 image generation calls and no fee for them in openai/gpt-4.1: not billed"]


def test_a_price_file_fee_for_the_image_tool_prices_it(tmp_path):
    raw = {"id": "openai/gpt-4.1", "provider": "openai", "model": "gpt-4.1", "input": Decimal("2.00"),
           "output": Decimal("8.00"), "image_generation": Decimal("0.011"), "source": "test",
           "checked": dt.date(2026, 12, 1)}  # fmt: skip
    catalog = load_catalog(builtin=False)
    catalog.add(parse_entry(tmp_path / "p.yaml", 0, raw))
    usage = Usage(input_tokens=1000, output_tokens=100, image_generation_calls=2)
    found = quote(catalog, usage, model="gpt-4.1", provider="openai", at=None)
    # 0.0028 + 2 x 0.011 = 0.0248
    assert (found.status, found.cost_usd) == ("priced", Decimal("0.0248"))


def gemini_reply(stream: bool) -> list[bytes]:
    """A Gemini OpenAI-compatible reply grounded with Google Search (its grounding metadata on the choice)."""
    grounding = {"web_search_queries": ["euro 2024 winner", "euro 2024 final"],
                 "grounding_chunks": [{"web": {"uri": "https://example.com/a", "title": "a"}}]}  # fmt: skip
    usage = {"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100}
    if not stream:
        body = {"id": "g1", "object": "chat.completion", "model": "gemini-2.5-flash", "usage": usage,
                "choices": [{"index": 0, "finish_reason": "stop", "grounding_metadata": grounding,
                             "message": {"role": "assistant", "content": "Spain."}}]}  # fmt: skip
        return [json_reply(json.dumps(body).encode())]
    chunks = [
        {"id": "g1", "object": "chat.completion.chunk", "model": "gemini-2.5-flash",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Spain."}}]},
        {"id": "g1", "object": "chat.completion.chunk", "model": "gemini-2.5-flash", "usage": usage,
         "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "grounding_metadata": grounding}]},
    ]  # fmt: skip
    events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
    return [sse_head(), *(chunk(e) for e in events), LAST_CHUNK]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_gemini_google_search_grounding_is_counted_and_priced(raw_proxy, raw_upstream, stream):
    proxy = raw_proxy(provider="google")
    raw_upstream.script = lambda head, body: gemini_reply(stream)
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as client:
        request = {"model": "gemini-2.5-flash", "messages": [{"role": "user", "content": "who won euro 2024?"}],
                   "extra_body": {"tools": [{"google_search": {}}]}}  # fmt: skip
        if stream:
            assert len(list(client.chat.completions.create(**request, stream=True))) == 2
        else:
            assert client.chat.completions.create(**request).usage.prompt_tokens == 1000
    (row,) = proxy.rows(1)
    # gemini-2.5-flash: 1000 x 0.30 + 100 x 2.50 = 550 per 1M -> $0.00055, plus one grounded request at
    # $0.035 = $0.03555. Before: "priced" at $0.00055, the grounding not counted
    assert (row["web_search_requests"], row["cost_usd"], row["price_status"]) == (1, Decimal("0.03555"), "priced")


def test_gemini_grounding_offered_and_not_shown_is_never_plain_priced(raw_proxy, raw_upstream):
    """Gemini's OpenAI-compatible replies may carry no grounding metadata: the search fee is then not known."""
    proxy = raw_proxy(provider="google")
    body = {"id": "g2", "object": "chat.completion", "model": "gemini-2.5-flash",
            "usage": {"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100},
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Spain."}}]}  # fmt: skip
    raw_upstream.script = lambda head, _: [json_reply(json.dumps(body).encode())]
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as client:
        client.chat.completions.create(
            model="gemini-2.5-flash",
            messages=[{"role": "user", "content": "who won euro 2024?"}],
            extra_body={"tools": [{"google_search": {}}]},
        )
    (row,) = proxy.rows(1)
    # before: "priced" at the tokens' $0.00055 though a grounded prompt bills $0.035 more
    assert (row["cost_usd"], row["price_status"], row["web_search_requests"]) == (
        Decimal("0.00055"),
        "partially_priced",
        0,
    )
    notes = [line["note"] for line in json.loads(row["cost_lines"]) if "note" in line]
    assert notes == [
        "the request offered Google Search grounding and the reply does not say whether it ran: not billed"
    ]
