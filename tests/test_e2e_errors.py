"""Bad input and failing upstreams: OpenAI-shaped errors, right statuses, one ledger row each."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest

from tokenward.proxy.config import UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.simulator import FAULT_HEADER, RECORD_HEADER

CHAT = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"
CHAT_STREAM = "tests/models/cassettes/test_openai/test_run_stream_sync_streams_real_model.yaml#0"


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == code and error["message"]
    assert "Traceback" not in response.text
    return error


def test_malformed_json_is_400_and_recorded(start_proxy):
    proxy = start_proxy()
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        content=b'{"model": "gpt-4o", "messages": [',
        headers={"content-type": "application/json", "x-request-id": "client-42"},
    )
    assert_openai_error(reply, 400, "invalid_json")
    not_object = httpx.post(f"{proxy.url}/v1/chat/completions", content=b"[1, 2]")
    assert_openai_error(not_object, 400, "invalid_json")
    rows = proxy.rows()
    assert [(r["outcome"], r["http_status"], r["price_status"], r["cost_usd"]) for r in rows] == [
        ("client_error", 400, "not_billed", 0),
        ("client_error", 400, "not_billed", 0),
    ]
    assert rows[0]["client_request_id"] == "client-42"
    assert reply.headers["x-tokenward-request-id"] == rows[0]["request_id"]


def test_unknown_virtual_key_is_401(start_proxy, simulator, sample, monkeypatch):
    monkeypatch.setenv("SIM_OPENAI_KEY", "sk-upstream-secret")
    upstream = UpstreamConfig(
        name="openai",
        base_url=f"{simulator.url}/openai/v1",
        default=True,
        provider="openai",
        api_key_env="SIM_OPENAI_KEY",
    )
    proxy = start_proxy(
        upstreams=[upstream], auth="virtual_keys", keys=[VirtualKeyConfig(name="team-a", key="tw-team-a-secret-key")]
    )
    bad = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="tw-not-a-key-1234", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "invalid_api_key"
    bad.close()
    missing = httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": "gpt-4o"})
    assert_openai_error(missing, 401, "missing_api_key")
    good = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="tw-team-a-secret-key", max_retries=0)
    body = dict(sample[CHAT].request["body"])
    good.chat.completions.create(model=body.pop("model"), messages=body.pop("messages"), extra_body=body)
    good.close()
    # the upstream got tokenward's upstream key, never the virtual key
    sent = simulator.simulator.requests[-1]["headers"]
    assert sent["authorization"] == "Bearer sk-upstream-secret"
    rows = proxy.rows()
    assert [(r["outcome"], r["http_status"], r["principal"]) for r in rows] == [
        ("unauthorized", 401, "anonymous"),
        ("unauthorized", 401, "anonymous"),
        ("ok", 200, "team-a"),
    ]
    assert rows[2]["input_tokens"] == 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_upstream_is_502(start_proxy):
    dead = UpstreamConfig(name="dead", base_url=f"http://127.0.0.1:{free_port()}/v1", default=True)
    proxy = start_proxy(upstreams=[dead])
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": "gpt-4o", "messages": []})
    error = assert_openai_error(reply, 502, "upstream_unreachable")
    assert "dead" in error["message"]
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["http_status"], row["upstream"], row["input_tokens"]) == (
        "upstream_unreachable",
        502,
        "dead",
        0,
    )


def test_upstream_timeout_is_504(start_proxy, simulator):
    slow = UpstreamConfig(name="openai", base_url=f"{simulator.url}/openai/v1", default=True, read_timeout_s=0.3)
    proxy = start_proxy(upstreams=[slow])
    started = time.monotonic()
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": "gpt-4o", "messages": []},
        headers={RECORD_HEADER: CHAT, FAULT_HEADER: "hang"},
        timeout=10,
    )
    assert time.monotonic() - started < 5
    assert_openai_error(reply, 504, "upstream_timeout")
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["http_status"], row["usage_source"]) == ("upstream_timeout", 504, "none")


def test_upstream_reset_is_502(start_proxy, simulator):
    proxy = start_proxy()
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": "gpt-4o", "messages": []},
        headers={RECORD_HEADER: CHAT, FAULT_HEADER: "reset"},
    )
    assert_openai_error(reply, 502, "upstream_unreachable")
    (row,) = proxy.rows(1)
    assert row["outcome"] == "upstream_unreachable" and row["cost_usd"] == 0


def test_unknown_upstream_header_is_400(start_proxy):
    proxy = start_proxy()
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions", json={"model": "gpt-4o"}, headers={"x-tokenward-upstream": "nope"}
    )
    assert_openai_error(reply, 400, "unknown_upstream")
    assert proxy.rows()[0]["outcome"] == "client_error"


def test_client_disconnect_mid_stream_still_records_usage(start_proxy, sample):
    proxy = start_proxy()
    body = sample[CHAT_STREAM].request["body"]
    with httpx.stream(
        "POST",
        f"{proxy.url}/v1/chat/completions",
        json=body,
        headers={RECORD_HEADER: CHAT_STREAM, FAULT_HEADER: "delay:100"},
    ) as reply:
        first = next(reply.iter_raw())
        assert first.startswith(b"data: ")
    # the client hung up after the first event; tokenward read on and got the usage report
    (row,) = proxy.rows(1)
    assert row["outcome"] == "client_disconnected" and row["usage_source"] == "reported"
    assert (row["input_tokens"], row["output_tokens"]) == (53, 15)


def test_upstream_cut_mid_stream_bills_no_error_text(start_proxy, sample):
    proxy = start_proxy()
    body = sample[CHAT_STREAM].request["body"]
    with httpx.stream(
        "POST",
        f"{proxy.url}/v1/chat/completions",
        json=body,
        headers={RECORD_HEADER: CHAT_STREAM, FAULT_HEADER: "cut:3"},
    ) as reply:
        received = b"".join(reply.iter_raw())
    assert received.count(b"data: ") == 3
    (row,) = proxy.rows(1)
    assert row["outcome"] == "upstream_failed" and row["usage_source"] == "partial"
    assert row["input_tokens"] > 0 and row["output_tokens"] >= 1
