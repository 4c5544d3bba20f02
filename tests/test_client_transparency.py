"""What a real SDK sees through tokenward, against what it sees from the same upstream directly.

The ``openai`` and ``anthropic`` SDKs run once against :class:`~tests.raw_upstream.RawUpstream` (an
upstream scripted byte for byte, as the provider answers) and once through a real proxy in front of
it; each test compares the two (status, the headers the SDKs and their users read, SSE events one by
one, parsed objects, retries) and checks the request's one ledger row. Prices: the field cases' test
prices (tests/fixtures/field_case_prices.yaml, USD per 1M tokens): gpt-4o-mini 0.15 in / 0.60 out;
claude-sonnet-4 3.00 in, 0.30 cache read, 3.75 cache write (5m) / 6.00 (1h), 15.00 out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
import websockets

from tokenward.pricing.catalog import load_catalog

from .raw_upstream import json_reply

PRICES = Path(__file__).parent / "fixtures" / "field_case_prices.yaml"
HELLO = [{"role": "user", "content": "hello world"}]


@pytest.fixture
def proxy(raw_proxy):
    return raw_proxy("test", "test", catalog=load_catalog([PRICES], builtin=False), drain_s=2.0)


def reply(status: bytes, headers: bytes, body: bytes, content_type: bytes = b"application/json") -> bytes:
    """A whole HTTP/1.1 reply with ``headers`` (CRLF-terminated lines) and a content-length."""
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type + b"\r\n" + headers
        + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


def named(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


# --- WebSocket sessions (Realtime, the Responses API's WebSocket mode) ------------------------------


@pytest.mark.parametrize("connect", ["realtime", "responses"])
def test_a_websocket_session_is_refused_by_tokenward_with_its_row_not_sent_upstream_as_a_plain_get(
    proxy, raw_upstream, connect
):
    # tokenward relays no WebSocket. Before, the handshake went upstream as a plain GET (Upgrade and
    # Connection dropped as hop-by-hop, Sec-WebSocket-Key kept), the provider answered that with some
    # 4xx and the SDK said "server rejected WebSocket connection: HTTP 400", naming nothing. Now
    # tokenward refuses it itself, saying why, and nothing reaches the upstream.
    raw_upstream.script = lambda head, body: [
        json_reply(b'{"error":{"message":"no","type":"x","code":null}}', b"400 Bad Request")
    ]
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0)
    with pytest.raises(websockets.InvalidStatus) as refused:
        if connect == "realtime":
            with client.realtime.connect(model="gpt-realtime"):
                pass
        else:
            with client.beta.responses.connect(max_retries=0):
                pass
    response = refused.value.response
    assert response.status_code == 501
    error = json.loads(response.body)["error"]
    assert error["code"] == "websocket_not_supported" and error["type"] == "invalid_request_error"
    assert "WebSocket" in error["message"]
    assert raw_upstream.requests == []
    (row,) = proxy.rows(1)
    path = "/v1/realtime" if connect == "realtime" else "/v1/responses"
    assert (row["method"], row["path"], row["http_status"], row["outcome"]) == ("GET", path, 501, "rejected")
    assert row["price_status"] == "not_billed" and row["cost_usd"] == 0
