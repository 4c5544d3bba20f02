"""The access log: one line per request with the row's figures; a warning per upstream failure and refusal."""

from __future__ import annotations

import logging
import socket
import uuid
from decimal import Decimal

import httpx
import openai
import pytest

from tokenward.pricing.settings import BudgetSettings, PricingSettings
from tokenward.proxy.access_log import ACCESS_LOGGER, EVENTS_LOGGER, format_line
from tokenward.proxy.config import UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.simulator import FAULT_HEADER, RECORD_HEADER

from .test_ledger import make_row

CHAT = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"
CHAT_STREAM = "tests/models/cassettes/test_openai/test_run_stream_sync_streams_real_model.yaml#0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lines(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def test_one_line_per_request_with_the_rows_figures(start_proxy, sample, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    proxy = start_proxy()
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as client:
        body = dict(sample[CHAT].request["body"])
        client.chat.completions.create(
            model=body.pop("model"), messages=body.pop("messages"), extra_body=body, extra_headers={RECORD_HEADER: CHAT}
        )
        stream = dict(sample[CHAT_STREAM].request["body"])
        list(
            client.chat.completions.create(
                model=stream.pop("model"),
                messages=stream.pop("messages"),
                stream=stream.pop("stream"),
                extra_body=stream,
                extra_headers={RECORD_HEADER: CHAT_STREAM},
            )
        )
    rows = proxy.rows(2)
    access = lines(caplog, ACCESS_LOGGER)
    assert len(access) == 2
    call, streamed = access
    # 8 input tokens at $2.50/M + 10 output at $10.00/M (gpt-4o-2024-08-06) = $0.00002 + $0.0001
    assert call.startswith(
        "POST /v1/chat/completions 200 ok upstream=openai model=gpt-4o-2024-08-06 tokens_in=8 tokens_out=10 "
        "cost_usd=0.00012 latency_ms="
    )
    assert call.endswith(f"key={rows[0]['principal']} request_id={rows[0]['request_id']}")
    assert f"latency_ms={rows[0]['latency_ms']:.1f} " in call and "stream=true" not in call
    assert rows[0]["cost_usd"] == Decimal("0.00012")
    r = rows[1]
    assert f"tokens_in={r['input_tokens']} tokens_out={r['output_tokens']} " in streamed
    assert f"stream=true latency_ms={r['latency_ms']:.1f} ttfb_ms={r['ttfb_ms']:.1f} " in streamed
    assert lines(caplog, EVENTS_LOGGER) == []  # nothing went wrong: no warnings


def test_client_controlled_values_cannot_forge_lines(start_proxy, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    proxy = start_proxy()
    httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": "evil\nINFO fake line", "messages": []})
    httpx.get(f"{proxy.url}/nothing%0aINFO%20forged")
    proxy.rows(2)
    model_line, path_line = lines(caplog, ACCESS_LOGGER)
    assert "\n" not in model_line and 'model="evil\\nINFO fake line"' in model_line
    # the path is logged as received (still percent-encoded: the edge refuses encoded control bytes)
    assert "\n" not in path_line and path_line.startswith('GET "/nothing%0aINFO%20forged" 400 client_error')


def test_unpriced_and_unbilled_rows_say_so_instead_of_a_cost():
    unpriced = format_line(make_row("u", price_status="unpriced", cost_usd=None, served_model="mystery"))
    assert "model=mystery" in unpriced and "cost_usd=- price=unpriced" in unpriced
    refused = format_line(make_row("r", price_status="not_billed", cost_usd=Decimal(0), http_status=401))
    assert "cost_usd=0 price=not_billed" in refused


def test_upstream_failures_are_warned_once_each(start_proxy, simulator, caplog):
    caplog.set_level(logging.INFO)
    dead = UpstreamConfig(name="dead", base_url=f"http://127.0.0.1:{free_port()}/v1")
    slow = UpstreamConfig(name="slow", base_url=f"{simulator.url}/openai/v1", read_timeout_s=0.3)
    flaky = UpstreamConfig(name="flaky", base_url=f"{simulator.url}/openai/v1", retries=1, retry_backoff_s=0)
    broken = UpstreamConfig(name="openai", base_url=f"{simulator.url}/openai/v1", default=True)
    proxy = start_proxy(upstreams=[dead, slow, flaky, broken])
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}

    def send(upstream: str, fault: str = "") -> int:
        # "flaky" faults count per recording for the whole session: a body of its own for each here
        # (the simulator makes up the reply), so that other tests' counts do not interfere
        body = {**chat, "messages": [{"role": "user", "content": f"access log {upstream} {fault} {uuid.uuid4()}"}]}
        headers = {"x-tokenward-upstream": upstream}
        if fault:
            headers[FAULT_HEADER] = fault
        return httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers=headers, timeout=10).status_code

    assert send("dead") == 502
    assert send("slow", "hang") == 504
    assert send("flaky", "flaky:1:503") == 200  # one 503, retried
    assert send("flaky", "flaky:1:reset") == 200  # one connection reset after the request was sent
    assert send("openai", "flaky:1:500") == 500  # relayed as is
    with httpx.stream(
        "POST",
        f"{proxy.url}/v1/chat/completions",
        json={**chat, "stream": True},
        headers={RECORD_HEADER: CHAT_STREAM, FAULT_HEADER: "cut:2"},
    ) as reply:
        with pytest.raises(httpx.RemoteProtocolError):
            reply.read()  # broken off mid-stream
    rows = proxy.rows(7)  # six requests and the attempt that met the reset
    ids = {(r["upstream"], r["row_kind"], r["http_status"]): r["request_id"] for r in rows}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("tokenward")]
    by_request: dict[str, list[str]] = {}
    for record in warnings:
        text = record.getMessage()
        request = next(r["request_id"] for r in rows if r["row_kind"] == "request" and r["request_id"] in text)
        by_request.setdefault(request, []).append(f"{record.name}: {text}")
    (unreachable,) = by_request.pop(ids["dead", "request", 502])
    assert unreachable.startswith(
        f"{EVENTS_LOGGER}: request {ids['dead', 'request', 502]}: upstream dead unreachable (502): "
    )
    (timeout,) = by_request.pop(ids["slow", "request", 504])
    assert timeout.startswith(
        f"{EVENTS_LOGGER}: request {ids['slow', 'request', 504]}: upstream slow timed out (504): "
    )
    first, second = (r["request_id"] for r in rows if r["upstream"] == "flaky" and r["row_kind"] == "request")
    assert by_request.pop(first) == [
        f"{EVENTS_LOGGER}: request {first}: upstream flaky succeeded after 1 retries: upstream answered 503"
    ]
    attempt, recovered = by_request.pop(second)
    assert attempt.startswith(f"{EVENTS_LOGGER}: request {second}: upstream flaky attempt 1 failed (502): ")
    assert attempt.endswith("; retrying")
    assert recovered.startswith(f"{EVENTS_LOGGER}: request {second}: upstream flaky succeeded after 1 retries: ")
    answered = ids["openai", "request", 500]
    assert by_request.pop(answered) == [f"{EVENTS_LOGGER}: request {answered}: upstream openai answered 500"]
    # the stream broken off mid-reply is warned about by the relay, once
    ((cut_id, (cut,)),) = by_request.items()
    assert cut.startswith(f"tokenward.proxy: upstream broke off {cut_id} mid-reply")
    assert len(lines(caplog, ACCESS_LOGGER)) == 6  # one per request; the retried attempt is no request


def test_refusals_are_warned(start_proxy, simulator, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger=EVENTS_LOGGER)
    monkeypatch.setenv("SIM_KEY", "sk-upstream")
    upstream = UpstreamConfig(
        name="openai", base_url=f"{simulator.url}/openai/v1", default=True, provider="openai", api_key_env="SIM_KEY"
    )
    proxy = start_proxy(
        upstreams=[upstream],
        auth="virtual_keys",
        keys=[VirtualKeyConfig(name="agent", key="tw-agent-key-0001")],
        pricing=PricingSettings(unpriced="block"),
        budgets=[BudgetSettings(name="tiny", limit_usd=Decimal("0.01"), action="block")],
    )
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    good = {"authorization": "Bearer tw-agent-key-0001"}
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=chat).status_code == 401
    bad = {"authorization": "Bearer tw-wrong-key-9999"}
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=chat, headers=bad).status_code == 401
    # worst case: 16384 output tokens at $10/M = $0.16 > $0.01
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=chat, headers=good).status_code == 429
    unpriced = {**chat, "model": "no-such-model"}
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=unpriced, headers=good).status_code == 400
    rows = proxy.rows(4)
    events = lines(caplog, EVENTS_LOGGER)
    assert len(events) == 4
    assert events[0].startswith(f"request {rows[0]['request_id']} refused (401, key anonymous, model -): You didn't")
    assert "Incorrect API key provided: tw-w***9999" in events[1] and "tw-wrong-key-9999" not in events[1]
    assert events[2].startswith(
        f"request {rows[2]['request_id']} refused (429, key agent, model gpt-4o): Budget 'tiny'"
    )
    assert events[3].startswith(f"request {rows[3]['request_id']} refused (400, key agent, model no-such-model): ")
    assert "has no price for model 'no-such-model'" in events[3]
