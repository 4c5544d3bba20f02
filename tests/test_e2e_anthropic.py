"""Anthropic's Messages API through tokenward with the real anthropic SDK (ANTHROPIC_BASE_URL)."""

from __future__ import annotations

from decimal import Decimal

import anthropic
import httpx
import pytest

from tokenward.proxy.simulator import RECORD_HEADER

STREAM = "tests/models/cassettes/test_anthropic/test_request_stream_fallback_for_high_max_tokens.yaml#0"
CACHE_READ = "tests/models/cassettes/test_anthropic_mid_conversation_system/test_inline_system_prompt_cache_prefix_is_reused.yaml#1"


@pytest.fixture
def claude():
    clients = []

    def make(proxy, **kw):
        client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0, **kw)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def send(client, recording, **extra):
    body = dict(recording.request["body"])
    headers = {RECORD_HEADER: recording.id, "x-tokenward-upstream": "anthropic"}
    kwargs = {k: body.pop(k) for k in ("model", "max_tokens", "messages")}
    stream = body.pop("stream", False)
    if stream:
        with client.messages.stream(**kwargs, extra_body=body, extra_headers=headers, **extra) as events:
            return list(events)
    return client.messages.create(**kwargs, extra_body=body, extra_headers=headers, **extra)


def test_cache_reads_are_added_to_input(start_proxy, sample, claude, simulator):
    proxy = start_proxy()
    reply = send(claude(proxy), sample[CACHE_READ])
    assert reply.usage.cache_read_input_tokens == 1590
    sent = simulator.simulator.requests[-1]
    assert sent["headers"]["authorization"] == "Bearer sk-ant-test" and sent["headers"]["anthropic-version"]
    (row,) = proxy.rows(1)
    assert row["endpoint"] == "anthropic_messages" and row["served_model"] == "claude-opus-4-8"
    # input_tokens 2 excludes the 1590 cache reads: 1592 input, 1590 of them cached
    assert (row["input_tokens"], row["cached_input_tokens"], row["cache_write_tokens"], row["output_tokens"]) == (
        1592,
        1590,
        0,
        4,
    )
    # claude-opus-4-8: 2 * 5.00 + 1590 * 0.50 + 4 * 25.00 = 905 -> $0.000905
    assert row["cost_usd"] == Decimal("0.000905") and row["service_tier"] == "standard"


def test_stream_running_totals_replace_start_values(start_proxy, sample, claude):
    proxy = start_proxy()
    events = send(claude(proxy), sample[STREAM])
    assert events[-1].type == "message_stop"
    (row,) = proxy.rows(1)
    # message_start says output 1 (a placeholder), message_delta 5: 5, not 6
    assert (row["input_tokens"], row["output_tokens"], row["stream"]) == (20, 5, True)
    assert row["served_model"] == "claude-sonnet-4-5-20250929"
    # claude-sonnet-4-5: 20 * 3.00 + 5 * 15.00 = 135 -> $0.000135
    assert row["cost_usd"] == Decimal("0.000135")


def test_anthropic_bytes_pass_through_unchanged(start_proxy, sample, simulator):
    proxy = start_proxy()
    for record in (sample[STREAM], sample[CACHE_READ]):
        headers = {RECORD_HEADER: record.id, "anthropic-version": "2023-06-01"}
        direct = httpx.post(
            f"{simulator.url}/anthropic/v1/messages?beta=true", json=record.request["body"], headers=headers
        )
        via = httpx.post(
            f"{proxy.url}/v1/messages?beta=true",
            json=record.request["body"],
            headers={**headers, "x-tokenward-upstream": "anthropic"},
        )
        assert (via.status_code, via.headers["content-type"], via.content) == (
            direct.status_code,
            direct.headers["content-type"],
            direct.content,
        )
