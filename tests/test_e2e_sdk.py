"""End to end with the real openai SDK (sync and async, streamed and not) -> tokenward -> simulator.

Expected token counts come from the recorded usage objects; expected costs are worked out by
hand below from the built-in catalog's rates (USD per 1M tokens).
"""

from __future__ import annotations

from decimal import Decimal

import httpx
import openai
import pytest

from tokenward.proxy.demo import send_recorded
from tokenward.proxy.simulator import RECORD_HEADER

CHAT = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"
CHAT_STREAM = "tests/models/cassettes/test_openai/test_run_stream_sync_streams_real_model.yaml#0"
CACHE_WRITE = "tests/models/cassettes/test_openai_prompt_cache/test_openai_chat_prompt_cache_e2e.yaml#0"
RESPONSES = "tests/models/cassettes/test_openai_responses/test_openai_responses_system_prompt.yaml#0"
RESPONSES_STREAM = "tests/models/cassettes/test_openai_responses/test_openai_responses_stream.yaml#0"
EMBED_404 = "tests/cassettes/test_embeddings/TestOpenAI.test_embed_error.yaml#0"
DEEPSEEK = "tests/models/cassettes/test_deepseek/test_deepseek_deferred_capability_with_thinking.yaml#0"
OPENROUTER_STREAM = "tests/models/cassettes/test_openrouter/test_openrouter_web_search_tool_usage_stream.yaml#0"
GEMINI_COMPAT = "tests/models/cassettes/test_openai/test_compatible_api_with_tool_calls_without_id.yaml#0"
AZURE = "tests/providers/cassettes/test_azure/test_azure_provider_call.yaml#0"


@pytest.fixture
def sdk():
    clients = []

    def make(proxy, **kw):
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test-key", max_retries=0, **kw)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def tokens(row):
    return (
        row["input_tokens"],
        row["cached_input_tokens"],
        row["cache_write_tokens"],
        row["output_tokens"],
        row["reasoning_tokens"],
    )


def test_sync_call_is_metered_and_priced(start_proxy, sample, sdk):
    proxy = start_proxy()
    reply = send_recorded(sdk(proxy), sample[CHAT])
    assert reply.usage.prompt_tokens == 8 and reply.usage.completion_tokens == 10
    (row,) = proxy.rows(1)
    assert row["endpoint"] == "chat_completions" and row["stream"] is False
    assert row["requested_model"] == "gpt-4o" and row["served_model"] == "gpt-4o-2024-08-06"
    assert row["outcome"] == "ok" and row["http_status"] == 200
    assert tokens(row) == (8, 0, 0, 10, 0)
    assert row["usage_source"] == "reported"
    # gpt-4o: $2.50 in, $10.00 out per 1M: 8 * 2.5 + 10 * 10 = 120 -> $0.000120
    assert row["cost_usd"] == Decimal("0.000120")
    # 10 output tokens x $10 = $0.0001 of it is output; nothing was cached, so nothing saved
    assert (row["output_cost_usd"], row["cache_savings_usd"]) == (Decimal("0.0001"), Decimal(0))
    assert row["price_status"] == "priced" and row["price_entry_id"] == "openai/gpt-4o"
    assert row["price_resolved_by"] == "snapshot"
    assert row["principal"].startswith("fp-") and "sk-test-key" not in str(row)
    assert row["key_id"] == row["principal"]  # passthrough: the key's fingerprint is its id
    assert row["latency_ms"] > 0 and row["ttfb_ms"] > 0


def test_sync_stream_with_usage_asked(start_proxy, sample, sdk):
    proxy = start_proxy()
    events = send_recorded(sdk(proxy), sample[CHAT_STREAM])
    assert events[-1].usage.prompt_tokens == 53  # the client asked for usage and gets it
    (row,) = proxy.rows(1)
    assert row["stream"] is True and row["served_model"] == "gpt-4o-mini-2024-07-18"
    assert tokens(row) == (53, 0, 0, 15, 0)
    # gpt-4o-mini: $0.15 in, $0.60 out: 53 * 0.15 + 15 * 0.60 = 16.95 -> $0.00001695
    assert row["cost_usd"] == Decimal("0.00001695")


async def test_async_stream_without_usage_asked_is_still_metered(start_proxy, sample, simulator):
    proxy = start_proxy()
    recording = sample[CHAT_STREAM]
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test-key", max_retries=0)
    body = {k: v for k, v in recording.request["body"].items() if k not in ("stream_options",)}
    stream = await client.chat.completions.create(
        **{k: body[k] for k in ("model", "messages", "stream")},
        extra_body={k: v for k, v in body.items() if k not in ("model", "messages", "stream")},
        extra_headers={RECORD_HEADER: recording.id, "x-tokenward-upstream": "openai"},
    )
    events = [event async for event in stream]
    await client.close()
    # the client did not ask for usage: it sees no usage chunk, exactly as from the upstream directly
    assert all(event.usage is None for event in events)
    direct = httpx.post(f"{simulator.url}/openai/v1/chat/completions", json=body, headers={RECORD_HEADER: recording.id})
    assert len(events) == direct.text.count("data: {")
    # ...but tokenward asked upstream for it and metered it
    upstream_body = simulator.simulator.requests[-2]["body"]
    assert b'"stream_options":{"include_usage":true}' in upstream_body
    (row,) = proxy.rows(1)
    assert tokens(row) == (53, 0, 0, 15, 0) and row["usage_source"] == "reported"
    assert row["cost_usd"] == Decimal("0.00001695")


async def test_async_call_responses_api(start_proxy, sample):
    proxy = start_proxy()
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test-key", max_retries=0)
    body = dict(sample[RESPONSES].request["body"])
    reply = await client.responses.create(
        model=body.pop("model"),
        input=body.pop("input"),
        extra_body=body,
        extra_headers={RECORD_HEADER: RESPONSES},
    )
    await client.close()
    assert reply.usage.input_tokens == 42
    (row,) = proxy.rows(1)
    assert row["endpoint"] == "responses" and tokens(row) == (42, 0, 0, 8, 0)
    # gpt-4o: 42 * 2.50 + 8 * 10.00 = 185 -> $0.000185
    assert row["cost_usd"] == Decimal("0.000185")


def test_responses_stream(start_proxy, sample, sdk):
    proxy = start_proxy()
    events = send_recorded(sdk(proxy), sample[RESPONSES_STREAM])
    assert events[-1].type == "response.completed"
    (row,) = proxy.rows(1)
    assert row["stream"] is True and row["served_model"] == "gpt-4o-2024-08-06"
    assert tokens(row) == (255, 0, 0, 16, 0)
    # 255 * 2.50 + 16 * 10.00 = 797.5 -> $0.0007975
    assert row["cost_usd"] == Decimal("0.0007975")


def test_cache_write_priced_at_write_rate(start_proxy, sample, sdk):
    proxy = start_proxy()
    send_recorded(sdk(proxy), sample[CACHE_WRITE])
    (row,) = proxy.rows(1)
    assert tokens(row) == (4020, 0, 4012, 4, 0)
    # gpt-5.6-sol: uncached 8 * 5.00 + writes 4012 * 6.25 + output 4 * 30.00 = 25235 -> $0.025235
    assert row["cost_usd"] == Decimal("0.025235")


def test_deepseek_cache_hits_and_reasoning(start_proxy, sample, sdk):
    proxy = start_proxy()
    send_recorded(sdk(proxy), sample[DEEPSEEK])
    (row,) = proxy.rows(1)
    assert row["upstream"] == "deepseek" and row["served_model"] == "deepseek-v4-flash"
    assert tokens(row) == (563, 512, 0, 116, 60)
    # deepseek-v4-flash is priced by time of day at the request's start (peak: Mon-Fri 01:00-04:00 and
    # 06:00-10:00 UTC, twice the off-peak rates); the test runs whenever it runs, so both are worked out:
    # peak:     miss 51 * 0.44 + hit 512 * 0.014 + out 116 * 1.32 = 182.728 -> $0.000182728
    # off-peak: miss 51 * 0.22 + hit 512 * 0.007 + out 116 * 0.66 =  91.364 -> $0.000091364
    start = row["started_at"]
    peak = start.weekday() < 5 and (1 <= start.hour < 4 or 6 <= start.hour < 10)
    assert row["cost_usd"] == Decimal("0.000182728" if peak else "0.000091364")
    assert ('"window:peak' in row["cost_lines"].replace(" ", "")) == peak


def test_openrouter_stream_keeps_provider_cost_and_search(start_proxy, sample, sdk):
    proxy = start_proxy()
    send_recorded(sdk(proxy), sample[OPENROUTER_STREAM])
    (row,) = proxy.rows(1)
    assert tokens(row) == (8174, 0, 0, 30, 0) and row["web_search_requests"] == 1
    assert row["price_entry_id"] == "openai/gpt-4.1-mini" and row["price_resolved_by"] == "vendor_prefix"
    # gpt-4.1-mini: 8174 * 0.40 + 30 * 1.60 = 3317.6 -> $0.0033176; the search call has no price: listed, not $0
    assert row["cost_usd"] == Decimal("0.0033176")
    assert '"rate":null' in row["cost_lines"].replace(" ", "")
    assert row["provider_cost_usd"] == Decimal("0.0133176")


def test_gemini_compat_hidden_thinking_and_unpriced_model(start_proxy, sample, sdk):
    proxy = start_proxy()
    send_recorded(sdk(proxy), sample[GEMINI_COMPAT])
    (row,) = proxy.rows(1)
    # completion 12, prompt 35, total 109: the 62 tokens only in the total are thinking, billed as output
    assert tokens(row) == (35, 0, 0, 74, 62)
    assert row["price_status"] == "unpriced" and row["cost_usd"] is None


def test_upstream_error_is_relayed_and_recorded(start_proxy, sample, sdk):
    proxy = start_proxy()
    with pytest.raises(openai.NotFoundError):
        send_recorded(sdk(proxy), sample[EMBED_404])
    (row,) = proxy.rows(1)
    assert row["endpoint"] == "embeddings" and row["http_status"] == 404 and row["outcome"] == "upstream_error"
    assert row["usage_source"] == "none" and row["price_status"] == "not_billed" and row["cost_usd"] == 0


def test_azure_query_string_and_snapshot(start_proxy, sample, simulator, sdk):
    proxy = start_proxy()
    client = sdk(proxy, default_query={"api-version": "2024-12-01-preview"})
    send_recorded(client, sample[AZURE])
    assert simulator.simulator.requests[-1]["path"].endswith("?api-version=2024-12-01-preview")
    (row,) = proxy.rows(1)
    assert row["served_model"] == "gpt-4o-2024-11-20" and tokens(row) == (14, 0, 0, 9, 0)
    # 14 * 2.50 + 9 * 10.00 = 125 -> $0.000125
    assert row["cost_usd"] == Decimal("0.000125")
