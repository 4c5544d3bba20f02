"""The ASGI front: /v1 straight to the forwarder, the rest to Litestar, errors in OpenAI's shape either way."""

from __future__ import annotations

import httpx

from tokenward.proxy.front import Front, front
from tokenward.proxy.simulator import RECORD_HEADER

CHAT = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"
CHAT_BODY = {"messages": [{"content": "hello", "role": "user"}], "model": "gpt-4o", "n": 1, "stream": False}


def test_only_a_tokenward_app_gets_a_front(start_proxy):
    proxy = start_proxy()
    served = front(proxy.app)
    assert isinstance(served, Front) and served.forwarder is proxy.app.state.forwarder
    assert served.state.recorder is proxy.app.state.recorder

    async def plain(scope, receive, send):  # pragma: no cover - never called
        pass

    assert front(plain) is plain


def test_api_requests_and_tokenward_routes_are_served_as_before(start_proxy):
    proxy = start_proxy()
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT_BODY, headers={RECORD_HEADER: CHAT})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == 8
    assert reply.headers["x-tokenward-request-id"]
    assert httpx.get(f"{proxy.url}/healthz").json()["status"] == "ok"  # Litestar's route
    standing = httpx.get(f"{proxy.url}/v1/tokenward/budget")  # tokenward's own route under /v1: Litestar's, no row
    assert standing.status_code == 200 and standing.json()["budgets"] == [] and standing.json()["limited_by"] is None
    assert standing.headers["cache-control"] == "no-store"
    outside = httpx.get(f"{proxy.url}/v2/models")  # Litestar's api route: the 404, recorded
    assert outside.status_code == 404 and outside.json()["error"]["code"] == "not_found"
    bad = httpx.post(f"{proxy.url}/v1/chat//completions", json=CHAT_BODY)  # an empty segment: the forwarder refuses it
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_path"
    traced = httpx.request("TRACE", f"{proxy.url}/v1/models")  # not an API method: the forwarder's 405, recorded
    assert traced.status_code == 405 and traced.json()["error"]["code"] == "method_not_allowed"
    rows = proxy.rows(4)
    assert sorted((r["endpoint"], r["http_status"]) for r in rows) == [
        ("chat_completions", 200),
        ("unknown", 400),
        ("unknown", 404),
        ("unknown", 405),
    ]


def test_a_failure_inside_tokenward_is_a_500_in_openai_shape(start_proxy):
    proxy = start_proxy()

    async def broken(request):
        raise RuntimeError("a bug")

    proxy.app.state.forwarder.handle = broken
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT_BODY)
    assert reply.status_code == 500
    assert reply.headers["content-type"] == "application/json"
    assert reply.json() == {
        "error": {
            "message": "tokenward failed to handle the request",
            "type": "server_error",
            "param": None,
            "code": "proxy_error",
        }
    }
    assert "Traceback" not in reply.text
