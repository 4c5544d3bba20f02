"""A response delivered streamed and not gives the same ledger row.

Every non-streamed corpus reply with usage (Chat Completions, Responses, Anthropic Messages) is
also served as the stream its API would send for it (usage where that API puts it in a stream);
both go through the proxy and their rows must agree on every token field, model and cost.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx

from tokenward.pricing.usage import TOKEN_FIELDS
from tokenward.proxy.simulator import RECORD_HEADER, Recording

from .conftest import ProxyFactory, corpus_records

COMPARED = (
    "served_model",
    *TOKEN_FIELDS,
    "usage_source",
    "cost_usd",
    "price_status",
    "price_entry_id",
    "provider_cost_usd",
)


def sse(events: list[tuple[str | None, dict[str, Any]]]) -> str:
    out = []
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        out.append(f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n")
    return "".join(out)


def chat_stream(body: dict[str, Any]) -> str:
    base = {k: body[k] for k in ("id", "model", "service_tier") if k in body} | {"object": "chat.completion.chunk"}
    events = []
    for choice in body.get("choices") or []:
        message = choice.get("message") or {}
        delta = {"role": "assistant", "content": message.get("content")}
        events.append((None, base | {"choices": [{"index": choice.get("index", 0), "delta": delta}], "usage": None}))
        events.append(
            (
                None,
                base
                | {
                    "choices": [
                        {"index": choice.get("index", 0), "delta": {}, "finish_reason": choice.get("finish_reason")}
                    ],
                    "usage": None,
                },
            )
        )
    events.append((None, base | {"choices": [], "usage": body["usage"]}))
    return sse(events) + "data: [DONE]\n\n"


def responses_stream(body: dict[str, Any]) -> str:
    created = copy.deepcopy(body) | {"status": "in_progress", "usage": None, "output": []}
    return sse(
        [
            ("response.created", {"type": "response.created", "sequence_number": 0, "response": created}),
            ("response.completed", {"type": "response.completed", "sequence_number": 1, "response": body}),
        ]
    )


def messages_stream(body: dict[str, Any]) -> str:
    usage = body["usage"]
    start_usage = {
        k: usage[k]
        for k in (
            "input_tokens",
            "cache_creation_input_tokens",
            "cache_read_input_tokens",
            "cache_creation",
            "service_tier",
        )
        if k in usage
    } | {"output_tokens": 1}
    message = {k: v for k, v in body.items() if k != "content"} | {"content": [], "usage": start_usage}
    blocks: list[tuple[str | None, dict[str, Any]]] = []
    for index, block in enumerate(body.get("content") or []):  # each block opens and closes as the API streams it
        blocks.append(("content_block_start", {"type": "content_block_start", "index": index, "content_block": block}))
        blocks.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    return sse(
        [
            ("message_start", {"type": "message_start", "message": message}),
            ("ping", {"type": "ping"}),
            *blocks,
            (
                "message_delta",
                {"type": "message_delta", "delta": {"stop_reason": body.get("stop_reason")}, "usage": usage},
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
    )


CONVERT = {"chat_completions": chat_stream, "responses": responses_stream, "anthropic_messages": messages_stream}
PATHS = {"chat_completions": "chat/completions", "responses": "responses", "anthropic_messages": "messages"}


def test_streamed_and_non_streamed_rows_are_identical(tmp_path_factory, simulator):
    records = [
        r
        for r in corpus_records()
        if not r["stream"]
        and r["response"]["status"] == 200
        and r["usage_as_reported"]
        and r["endpoint"] in CONVERT
        and isinstance(r["response"].get("body"), dict)
        and not r["request"]["body"].get("background")
    ]
    factory = ProxyFactory(tmp_path_factory.mktemp("parity"), simulator)
    proxy = factory()
    pairs = []
    with httpx.Client(timeout=30) as client:
        for record in records:
            body = dict(record["request"]["body"], stream=True)
            if record["endpoint"] == "chat_completions":
                body["stream_options"] = {"include_usage": True}
            stream_id = record["id"] + "#as-stream"
            simulator.simulator.add(
                Recording(
                    stream_id,
                    record["provider"],
                    record["dialect"],
                    record["endpoint"],
                    True,
                    {"body": body},
                    {
                        "status": 200,
                        "content_type": "text/event-stream",
                        "sse": CONVERT[record["endpoint"]](record["response"]["body"]),
                    },
                    None,
                )
            )
            url = f"{proxy.url}/v1/{PATHS[record['endpoint']]}"
            upstream = {"x-tokenward-upstream": record["provider"]}
            plain = client.post(url, json=record["request"]["body"], headers={RECORD_HEADER: record["id"], **upstream})
            streamed = client.post(url, json=body, headers={RECORD_HEADER: stream_id, **upstream})
            assert plain.status_code == streamed.status_code == 200, record["id"]
            pairs.append(
                (record["id"], plain.headers["x-tokenward-request-id"], streamed.headers["x-tokenward-request-id"])
            )
    rows = {r["request_id"]: r for r in proxy.rows(2 * len(pairs), "WHERE row_kind = 'request'")}
    factory.stop_all()
    mismatches = []
    for record_id, plain_id, stream_id in pairs:
        plain, streamed = rows[plain_id], rows[stream_id]
        if streamed["stream"] is not True or any(plain[k] != streamed[k] for k in COMPARED):
            diff = {k: (plain[k], streamed[k]) for k in COMPARED if plain[k] != streamed[k]}
            mismatches.append(f"{record_id}: {diff}")
    assert len(pairs) > 500 and mismatches == []
