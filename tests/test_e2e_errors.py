"""Bad input and failing upstreams: OpenAI-shaped errors, right statuses, one ledger row each."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest

from tokenward.proxy.config import UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.simulator import FAULT_HEADER, RECORD_HEADER

from .servers import post_then_leave

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
    port = free_port()
    dead = UpstreamConfig(name="dead", base_url=f"http://127.0.0.1:{port}/v1", default=True)
    proxy = start_proxy(upstreams=[dead])
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": "gpt-4o", "messages": []})
    error = assert_openai_error(reply, 502, "upstream_unreachable")
    # the key holder hears what happened, not where the upstream lives (an internal host, say)
    assert error["message"] == "Upstream 'dead': cannot connect to upstream"
    (row,) = proxy.rows(1)
    assert row["error"].startswith("Upstream 'dead': cannot connect to upstream: ") and f"127.0.0.1:{port}" in row["error"]
    assert (row["price_status"], row["cost_usd"]) == ("not_billed", 0)  # refused: it never reached the provider
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
    assert (row["price_status"], row["cost_usd"]) == ("usage_unknown", None)  # it may have been billed


def test_upstream_reset_is_502(start_proxy, simulator):
    proxy = start_proxy()
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": "gpt-4o", "messages": []},
        headers={RECORD_HEADER: CHAT, FAULT_HEADER: "reset"},
    )
    assert_openai_error(reply, 502, "upstream_unreachable")
    (row,) = proxy.rows(1)
    # the upstream read the request before hanging up: it may bill it, so the cost is unknown, not $0
    assert (row["outcome"], row["price_status"], row["cost_usd"]) == ("upstream_unreachable", "usage_unknown", None)


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
    received = b""
    with pytest.raises(httpx.RemoteProtocolError):  # the stream breaks off, as it did upstream
        with httpx.stream(
            "POST",
            f"{proxy.url}/v1/chat/completions",
            json=body,
            headers={RECORD_HEADER: CHAT_STREAM, FAULT_HEADER: "cut:3"},
        ) as reply:
            for piece in reply.iter_raw():
                received += piece
    assert received.count(b"data: ") == 3
    (row,) = proxy.rows(1)
    assert row["outcome"] == "upstream_failed" and row["usage_source"] == "partial"
    assert row["input_tokens"] > 0 and row["output_tokens"] >= 1


def test_retries_on_overload_then_success(start_proxy, simulator, sample):
    upstream = UpstreamConfig(
        name="openai",
        base_url=f"{simulator.url}/openai/v1",
        default=True,
        provider="openai",
        retries=2,
        retry_backoff_s=0.01,
    )
    proxy = start_proxy(upstreams=[upstream])
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=sample[CHAT].request["body"],
        headers={RECORD_HEADER: CHAT, FAULT_HEADER: "flaky:2:503"},
    )
    assert reply.status_code == 200
    rows = proxy.rows(1)
    # 503 replies are not billed: no attempt rows, one request row noting the retries
    assert [(r["row_kind"], r["outcome"], r["input_tokens"]) for r in rows] == [("request", "ok", 8)]
    assert rows[0]["error"] == "succeeded after 2 retries: upstream answered 503; upstream answered 503"


def test_retried_attempt_that_may_be_billed_gets_its_own_row(start_proxy, simulator, sample):
    upstream = UpstreamConfig(
        name="openai",
        base_url=f"{simulator.url}/openai/v1",
        default=True,
        provider="openai",
        retries=1,
        retry_backoff_s=0.01,
    )
    proxy = start_proxy(upstreams=[upstream])
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=sample[CHAT_STREAM].request["body"],
        headers={RECORD_HEADER: CHAT_STREAM, FAULT_HEADER: "flaky:1:reset"},
    )
    assert reply.status_code == 200 and reply.text.count("data: ") == sample[CHAT_STREAM].response["sse"].count(
        "data: "
    )
    rows = proxy.rows(2)
    request = next(r for r in rows if r["row_kind"] == "request")
    attempt = next(r for r in rows if r["row_kind"] == "attempt")
    assert (request["outcome"], request["input_tokens"], request["output_tokens"]) == ("ok", 53, 15)
    assert attempt["parent_request_id"] == request["request_id"] == reply.headers["x-tokenward-request-id"]
    assert (attempt["request_id"], attempt["price_status"], attempt["cost_usd"]) == (
        request["request_id"] + "-a1",
        "usage_unknown",
        None,
    )


def test_retries_exhausted_relays_the_last_error(start_proxy, simulator, sample):
    upstream = UpstreamConfig(
        name="openai",
        base_url=f"{simulator.url}/openai/v1",
        default=True,
        provider="openai",
        retries=1,
        retry_backoff_s=0.01,
    )
    proxy = start_proxy(upstreams=[upstream])
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=sample[CHAT].request["body"],
        headers={RECORD_HEADER: CHAT, FAULT_HEADER: "flaky:5:429"},
    )
    assert reply.status_code == 429 and reply.json()["error"]["message"] == "simulated overload"
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["http_status"], row["price_status"]) == ("upstream_error", 429, "not_billed")


def test_client_that_leaves_before_the_reply_is_recorded_as_disconnected(start_proxy, simulator):
    slow = UpstreamConfig(name="openai", base_url=f"{simulator.url}/openai/v1", default=True, read_timeout_s=1.0)
    proxy = start_proxy(upstreams=[slow])
    seen = simulator.simulator.requests  # the last 1000, in a session-wide simulator: compare the last one
    last = seen[-1] if seen else None
    post_then_leave(  # the client leaves once the request is at the upstream, before its 1 s timeout
        f"{proxy.url}/v1/chat/completions",
        lambda: bool(seen) and seen[-1] is not last,
        json={"model": "gpt-4o", "messages": []},
        headers={RECORD_HEADER: CHAT, FAULT_HEADER: "hang"},
    )
    (row,) = proxy.rows(1)
    # nobody received the 504 tokenward would have sent: the row says the client left
    assert row["outcome"] == "client_disconnected" and "upstream timed out" in row["error"]
    assert row["price_status"] == "usage_unknown"


def test_other_methods_on_metered_paths_and_unknown_paths(start_proxy, simulator):
    proxy = start_proxy()
    listed = httpx.get(f"{proxy.url}/v1/chat/completions?limit=1")  # stored completions: passed through
    assert listed.status_code == 404 and simulator.simulator.requests[-1]["method"] == "GET"
    assert simulator.simulator.requests[-1]["path"] == "/openai/v1/chat/completions?limit=1"
    missing = httpx.post(f"{proxy.url}/wp-admin/setup.php")
    assert_openai_error(missing, 404, "not_found")
    root = httpx.get(f"{proxy.url}/v1")
    assert_openai_error(root, 404, "not_found")
    rows = proxy.rows(3)
    assert [(r["method"], r["path"], r["endpoint"], r["outcome"]) for r in rows] == [
        ("GET", "/v1/chat/completions", "passthrough", "upstream_error"),
        ("POST", "/wp-admin/setup.php", "unknown", "client_error"),
        ("GET", "/v1", "unknown", "client_error"),
    ]


def test_empty_body_and_unknown_upstream_messages(start_proxy):
    proxy = start_proxy()
    empty = assert_openai_error(httpx.post(f"{proxy.url}/v1/chat/completions"), 400, "invalid_json")
    assert empty["message"] == "The request body is empty: send a JSON object."
    unknown = httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": "m"}, headers={"x-tokenward-upstream": "x"})
    assert "configured: " in assert_openai_error(unknown, 400, "unknown_upstream")["message"]
    assert "openai" in unknown.json()["error"]["message"]


@pytest.mark.parametrize("model", [None, 5, ""])
def test_a_request_naming_no_model_is_told_so_not_that_model_none_has_no_price(start_proxy, simulator, model):
    # under a blocking budget (or unpriced: block) a body without a string `model` was refused with
    # "tokenward has no price for model None ... ask your admin to add a price": no price can fix it
    from decimal import Decimal

    from tokenward.pricing.settings import BudgetSettings

    cap = BudgetSettings(name="cap", limit_usd=Decimal("1"), period="total", action="block")
    blocking = start_proxy(budgets=[cap])
    strict = start_proxy(
        upstreams=[
            UpstreamConfig(
                name="openai", base_url=f"{simulator.url}/openai/v1", default=True, provider="openai", unpriced="block"
            )
        ]
    )
    body = {"messages": [{"role": "user", "content": "hi"}]}
    if model is not None:
        body["model"] = model
    before = simulator.simulator.received
    for proxy, why in ((blocking, "budget 'cap' refuses"), (strict, "requests for unpriced models are blocked")):
        reply = httpx.post(f"{proxy.url}/v1/chat/completions", json=body)
        error = assert_openai_error(reply, 400, "missing_model")
        assert error["message"].startswith("The request names no model") and why in error["message"]
        assert "None" not in error["message"]
        (row,) = proxy.rows(1)
        assert (row["outcome"], row["http_status"], row["price_status"]) == ("client_error", 400, "not_billed")
    assert simulator.simulator.received == before  # neither reached the provider
