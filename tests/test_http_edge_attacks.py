"""A key holder against the HTTP edge: bytes that mean one thing to tokenward and another to the upstream.

Each test runs a real proxy in ``virtual_keys`` mode (tokenward holds the provider key) in front of
a real aiohttp upstream on loopback (:class:`tests.servers.Servers`), driven by the real ``openai``
SDK or by raw bytes on a socket, and reads the real DuckDB ledger.

Prices (builtin catalog, USD per 1M tokens): ``gpt-4o-mini`` input 0.15, output 0.60; ``gpt-4o``
input 2.50, output 10.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.app import create_app
from tokenward.proxy.config import AuthConfig, Config, LedgerConfig, UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.server import running_in_thread

from .conftest import read_rows
from .servers import Servers, api

KEY = "tw-edge-attacker-0001"
PROVIDER_KEY = "sk-provider-secret-0001"


@pytest.fixture(autouse=True)
def provider_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_KEY", PROVIDER_KEY)


SHARED_FT = "ft:gpt-4o-mini:acme::a1"


@contextmanager
def proxy(upstream_url: str, ledger: Path, allow: tuple[str, ...] | None = None, **upstream: Any) -> Iterator[str]:
    """A proxy holding ``EDGE_KEY`` for the virtual key ``KEY``, under a $0.01 blocking budget.

    ``allow``: ``auth.allow_unmetered`` (default: the defaults); ``upstream``: more ``UpstreamConfig`` fields.
    :data:`SHARED_FT` is a fine-tune the operator shares with every key (``auth.shared_models``).
    """
    config = Config(
        upstreams=[UpstreamConfig(name="go", base_url=f"{upstream_url}/v1", provider="openai", api_key_env="EDGE_KEY",
                                  **upstream)],
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        auth=AuthConfig(mode="virtual_keys", shared_models=[SHARED_FT]) if allow is None
        else AuthConfig(mode="virtual_keys", allow_unmetered=allow, shared_models=[SHARED_FT]),
        virtual_keys=[VirtualKeyConfig(name="agent", key=KEY)],
        budgets=[BudgetSettings(name="cap", limit_usd=Decimal("0.01"), period="total", action="block")],
    )  # fmt: skip
    with running_in_thread(create_app(config)) as url:
        yield url


def keys_config(upstream_url: str, ledger: Path, *keys: VirtualKeyConfig) -> Config:
    """A ``virtual_keys`` proxy for ``keys`` in front of ``upstream_url`` (holding ``EDGE_KEY``), no budget."""
    return Config(
        upstreams=[UpstreamConfig(name="o", base_url=f"{upstream_url}/v1", provider="openai", api_key_env="EDGE_KEY")],
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        auth=AuthConfig(mode="virtual_keys"),
        virtual_keys=list(keys),
    )


def raw(url: str, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` as is; the reply's status and body (the proxy closes: ``Connection: close``)."""
    head, body = raw_reply(url, request)
    return int(head.split(b" ", 2)[1]), body


def raw_reply(url: str, request: bytes) -> tuple[bytes, bytes]:
    """Send ``request`` as is; the reply's head and body, read until the proxy closes (``Connection: close``)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


class GoUpstream:
    """Chat completions decoded as Go's ``encoding/json`` fills a struct (Ollama, LocalAI, Go relays).

    ``Unmarshal`` matches object keys to struct fields case-insensitively, and a later key that
    matches the same field overwrites the earlier one (https://pkg.go.dev/encoding/json#Unmarshal,
    checked 2026-12-01). It serves the model it read and writes all ``max_tokens`` of output.
    ``served`` collects ``(model, max_tokens)`` of each request it billed.
    """

    def __init__(self) -> None:
        self.served: list[tuple[str, int]] = []

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        fields: dict[str, Any] = {}
        for key, value in json.loads(body, object_pairs_hook=list):
            fields[key.lower()] = value
        model, output = fields["model"], fields["max_tokens"]
        self.served.append((model, output))
        usage = {"prompt_tokens": 8, "completion_tokens": output, "total_tokens": 8 + output}
        return web.json_response(
            {"id": "c-1", "object": "chat.completion", "model": model, "usage": usage,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}]}
        )  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        {"MODEL": "gpt-4o", "Max_Tokens": 4000},  # the model and the output limit the upstream reads
        {"Model": "gpt-4o"},
        {"MAX_TOKENS": 4000},
    ],
)
def test_a_member_spelled_in_another_case_is_refused_before_the_upstream_reads_it(tmp_path, extra):
    # The bound read model gpt-4o-mini and max_tokens 50 (about $0.0001, inside the $0.01 cap); a
    # case-insensitive upstream read the last spelling: gpt-4o writing 4000 tokens, 8 x 2.50 + 4000 x 10
    # = 40,020 -> $0.04002, four times the cap (before: admitted, and the row said $0.04002).
    upstream = GoUpstream()
    with Servers(upstream.handle).running() as servers:
        with proxy(servers.upstream_url, tmp_path / "l.duckdb") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(
                    model="gpt-4o-mini", max_tokens=50, messages=[{"role": "user", "content": "hi"}], extra_body=extra
                )
            plain = client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
            )
    error = refused.value.body
    assert error["code"] == "invalid_json"  # type: ignore[index]
    spelled = next(iter(extra))
    assert f"{spelled!r}" in error["message"] and f"{spelled.lower()!r}" in error["message"]  # type: ignore[index]
    assert upstream.served == [("gpt-4o-mini", 50)]  # only the plain request reached it
    assert plain.headers["x-tokenward-cost-usd"] == "0.0000312"  # 8 x 0.15 + 50 x 0.60 = 31.2 micro-USD
    rows = read_rows(tmp_path / "l.duckdb")
    assert [(r["http_status"], r["outcome"], r["cost_usd"]) for r in rows] == [
        (400, "client_error", Decimal(0)),
        (200, "ok", Decimal("0.0000312")),
    ]


def test_header_values_reach_the_upstream_as_the_client_sent_their_bytes(tmp_path):
    # OpenRouter shows X-Title as the app's name: "Café — notes" in UTF-8 arrived as "CafÃ© â\x80\x94 notes"
    # (decoded as latin-1, encoded again as UTF-8: 19 bytes became 25)
    title = "Café — notes".encode()
    with Servers().running() as servers:
        with proxy(servers.upstream_url, tmp_path / "l.duckdb") as url:
            status, _ = raw(
                url,
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                + b"\r\nX-Title: " + title + b"\r\nX-Latin: caf\xe9\r\nConnection: close\r\n\r\n",
            )  # fmt: skip
    assert status == 200
    headers = servers.requests[0]["headers"]
    assert headers["x-title"].encode("latin-1") == title == b"Caf\xc3\xa9 \xe2\x80\x94 notes"
    assert headers["x-latin"].encode("latin-1") == b"caf\xc3\xa9"  # not UTF-8: sent as the character it is in latin-1


def test_the_provider_key_is_the_only_credential_the_upstream_gets(tmp_path):
    # An upstream keyed by a header of its own (Gemini's x-goog-api-key, an API gateway's subscription key):
    # the client's header of that name went along, first, beside the provider key (two x-goog-api-key
    # headers: an upstream that reads the first bills the account the client chose)
    heard: list[list[tuple[bytes, bytes]]] = []

    async def handle(request: web.Request, body: bytes) -> web.StreamResponse:
        heard.append([(k.lower(), v) for k, v in request.raw_headers])
        return web.json_response({"object": "list", "data": []})

    with Servers(handle).running() as servers:
        with proxy(servers.upstream_url, tmp_path / "l.duckdb", api_key_header="x-goog-api-key",
                   api_key_prefix="") as url:  # fmt: skip
            status, _ = raw(
                url,
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                + b"\r\nX-Goog-Api-Key: client-own-key\r\nConnection: close\r\n\r\n",
            )  # fmt: skip
    assert status == 200
    credentials = [(name, value) for name, value in heard[0] if name in (b"x-goog-api-key", b"authorization")]
    assert credentials == [(b"x-goog-api-key", PROVIDER_KEY.encode())]


class GoContentUpstream:
    """Chat completions whose messages are decoded as Go's ``encoding/json`` does (see :class:`GoUpstream`).

    It bills the prompt it read: one token per 4 characters of each message's content.
    """

    def __init__(self) -> None:
        self.prompts: list[int] = []

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        document = json.loads(body)
        prompt = 0
        for message in document["messages"]:
            content = [value for key, value in message.items() if key.lower() == "content"][-1]
            prompt += len(content) // 4
        self.prompts.append(prompt)
        usage = {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}
        return web.json_response(
            {"id": "c-1", "object": "chat.completion", "model": document["model"], "usage": usage,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
        )  # fmt: skip


def test_a_message_member_spelled_in_another_case_is_refused_under_a_blocking_budget(tmp_path):
    # The bound counted "hi"; the upstream read "Content": 400,000 characters, 100,000 tokens at gpt-4o's
    # 2.50 -> $0.25 (plus 1 output token: $0.25001), 25 times the $0.01 cap (before: admitted, row $0.25001)
    upstream = GoContentUpstream()
    message = {"role": "user", "content": "hi", "Content": "word " * 80_000}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "ID": {"type": "string"}, "id": {"type": "string"}}}}}  # fmt: skip
    with Servers(upstream.handle).running() as servers:
        with proxy(servers.upstream_url, tmp_path / "l.duckdb") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model="gpt-4o", max_tokens=1, messages=[message])  # type: ignore[list-item]
            # a schema's properties are the client's to name: "ID" beside "id" passes
            plain = client.chat.completions.with_raw_response.create(
                model="gpt-4o", max_tokens=1, messages=[{"role": "user", "content": "hi " * 400}], tools=[tool]
            )  # type: ignore[list-item]
    assert refused.value.body["code"] == "invalid_json"  # type: ignore[index]
    assert "'content' twice, once as 'Content'" in refused.value.body["message"]  # type: ignore[index]
    assert upstream.prompts == [300]  # 1,200 characters // 4: only the plain request reached it
    assert plain.headers["x-tokenward-cost-usd"] == "0.00076"  # 300 x 2.50 + 1 x 10 = 760 micro-USD


class OverridingUpstream:
    """Models as an API front end that honours method overrides serves them.

    Google's API front ends take ``X-HTTP-Method-Override`` (google-api-client's ``MethodOverride``
    sends every method as a POST with it; https://github.com/googleapis/gax-java/pull/1465: "GCP
    services seem supporting it"), and method-override middleware (Rails, Laravel, Express, Go's iris)
    also reads ``X-HTTP-Method``, ``X-Method-Override`` and a ``_method`` parameter. ``deleted`` collects
    the models it deleted.
    """

    def __init__(self) -> None:
        self.deleted: list[str] = []

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        method = request.method
        for name in ("X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override"):
            method = request.headers.get(name, method)
        method = request.query.get("_method", method).upper()
        model = request.path.removeprefix("/v1/models/")
        if method == "DELETE":
            self.deleted.append(model)
            return web.json_response({"id": model, "object": "model", "deleted": True})
        return web.json_response({"id": model, "object": "model", "owned_by": "acme"})


@pytest.mark.parametrize(
    ("target", "header"),
    [
        ("/v1/models/ft:gpt-4o-mini:acme::a1", "X-HTTP-Method-Override: DELETE"),
        ("/v1/models/ft:gpt-4o-mini:acme::a1", "X-HTTP-Method: DELETE"),
        ("/v1/models/ft:gpt-4o-mini:acme::a1", "x-method-override: delete"),
        ("/v1/models/ft:gpt-4o-mini:acme::a1?_method=DELETE", None),
        ("/v1/models/ft:gpt-4o-mini:acme::a1?x=1&_method=delete", None),
    ],
)
def test_a_method_override_cannot_turn_an_allowed_get_into_a_delete(tmp_path, target, header):
    # The default allow_unmetered lets GET models/* pass and not DELETE models/* (deleting a fine-tuned
    # model, here one shared with every key so that it can be looked up); an upstream that honours the override deleted the operator's fine-tune (before: 200
    # {"deleted": true}, and the row said GET)
    upstream = OverridingUpstream()
    extra = f"{header}\r\n".encode() if header else b""
    request = (
        f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode()
        + extra
        + b"Connection: close\r\n\r\n"
    )
    with Servers(upstream.handle).running() as servers:
        with proxy(servers.upstream_url, tmp_path / "l.duckdb") as url:
            status, body = raw(url, request)
            looked_up, _ = raw(url, f"GET {target.split('?')[0]} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}"
                                    "\r\nConnection: close\r\n\r\n".encode())  # fmt: skip
    error = json.loads(body)["error"]
    assert (status, error["code"], error["type"]) == (400, "method_override_refused", "invalid_request_error")
    assert upstream.deleted == [] and len(servers.requests) == 1 and looked_up == 200
    rows = read_rows(tmp_path / "l.duckdb")
    assert [(r["method"], r["http_status"], r["outcome"]) for r in rows] == [
        ("GET", 400, "client_error"),
        ("GET", 200, "ok"),
    ]


@pytest.mark.parametrize("method", ["TRACE", "PROPFIND", "PURGE", "LINK"])
def test_a_method_the_api_does_not_take_is_refused_and_recorded(tmp_path, method):
    # Litestar answered these 405 with no ledger row: a request that reached tokenward and left no trace
    with Servers().running() as servers:
        with proxy(servers.upstream_url, tmp_path / "l.duckdb") as url:
            status, body = raw(
                url, f"{method} /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode()
            )  # fmt: skip
    error = json.loads(body)["error"]
    assert (status, error["code"], error["type"]) == (405, "method_not_allowed", "invalid_request_error")
    assert (
        error["message"]
        == f"Method {method} is not allowed: the API takes GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS."
    )
    assert servers.requests == []
    rows = read_rows(tmp_path / "l.duckdb")
    assert [(r["method"], r["path"], r["http_status"], r["outcome"]) for r in rows] == [
        (method, "/v1/models", 405, "client_error")
    ]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/files"])
def test_an_expect_100_continue_is_answered_by_tokenward_not_forwarded(tmp_path, path):
    # curl sends "Expect: 100-continue" with bodies over 1 MiB. tokenward answers it itself (it reads the
    # body); forwarded, the HTTP client waited for the upstream's own 100 before sending the body, and an
    # upstream that waits for the body instead held the request until the read timeout (before: 504 after
    # read_timeout_s, or a client stuck with a 100 Continue and nothing after it)
    from .raw_upstream import RawUpstream, json_reply

    chat = json.dumps({"id": "c-1", "object": "chat.completion", "model": "gpt-4o-mini",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}}).encode()  # fmt: skip
    upstream = RawUpstream()  # never sends a 100 Continue: it reads the body its Content-Length announces
    upstream.script = lambda head, body: [json_reply(chat)]
    body = b'{"model": "gpt-4o-mini", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Expect: 100-continue\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with upstream.running():
        with proxy(upstream.url, tmp_path / "l.duckdb", ("files",), read_timeout_s=5) as url:
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(head)
                interim = sock.recv(65536)
                sock.sendall(body)
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(chat)
    ((sent_head, sent_body),) = upstream.requests
    assert b"expect" not in sent_head.lower() and sent_body == body


def test_what_the_client_names_inside_its_own_shapes_is_not_a_clash():
    from tokenward.proxy.errors import ProxyError
    from tokenward.proxy.members import check_document

    passing = {
        "model": "claude-opus-4",
        "metadata": {"User": "a", "user": "b"},
        "tools": [{"name": "f", "input_schema": {"properties": {"ID": {}, "id": {}}}}],
        "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {"ID": 1, "id": 2}}]}],
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"A": 1, "a": 2}}},
    }
    check_document(passing)
    for document in (None, [], "text", 12):
        check_document(document)
    refused = [
        {"input": [{"role": "user", "content": "hi", "CONTENT": "x" * 100}]},  # Responses items are looked into
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "Text": "x"}]}]},
        {"model": "a", "Model": "b"},
    ]
    for document in refused:
        with pytest.raises(ProxyError) as error:
            check_document(document)
        assert error.value.code == "invalid_json" and error.value.status == 400


def test_a_nul_in_what_the_client_sends_keeps_its_row_on_postgres(tmp_path, pg_url):
    # Postgres text and jsonb cannot hold U+0000; DuckDB can. A key holder that put "\u0000" in its
    # request's user (or model) had each of its rows refused by Postgres and set aside in the quarantine
    # file: its spend missing from every report (before: 0 rows in requests, 1 quarantined)
    import psycopg

    upstream = GoUpstream()
    with Servers(upstream.handle).running() as servers:
        config = Config(
            upstreams=[UpstreamConfig(name="o", base_url=f"{servers.upstream_url}/v1", provider="openai",
                                      api_key_env="EDGE_KEY")],
            ledger=LedgerConfig(url=pg_url, spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05),
            auth=AuthConfig(mode="virtual_keys"),
            virtual_keys=[VirtualKeyConfig(name="agent", key=KEY)],
        )  # fmt: skip
        with running_in_thread(create_app(config)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            reply = client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini", max_tokens=50, user="eve\u0000", messages=[{"role": "user", "content": "hi"}]
            )
    assert reply.headers["x-tokenward-cost-usd"] == "0.0000312"
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute("SELECT principal, end_user, cost_usd FROM requests").fetchall()
    assert rows == [("agent", "eve\\x00", Decimal("0.0000312"))]
    assert not (tmp_path / "spool" / "quarantine.jsonl").exists()


def test_the_virtual_key_never_reaches_the_upstream_whatever_carries_it(tmp_path):
    # Google's SDKs send their key as x-goog-api-key or ?key=; a client that sent its virtual key that way
    # too (beside Authorization) had it forwarded: the provider, or a relay upstream, held a key that
    # spends through tokenward (before: KEY in two headers of the upstream's request, and in its URL)
    with Servers().running() as servers:
        with proxy(servers.upstream_url, tmp_path / "l.duckdb") as url:
            auth = f"Authorization: Bearer {KEY}\r\n"
            status, _ = raw(
                url,
                f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{auth}x-goog-api-key: {KEY}\r\nX-Debug: key={KEY};\r\n"
                "Connection: close\r\n\r\n".encode(),
            )
            refused = [
                raw(url, f"GET {target} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n".encode())
                for target in (f"/v1/models?key={KEY}", f"/v1/models/{KEY}")
            ]
    assert status == 200
    (sent,) = servers.requests
    assert KEY not in json.dumps(sent["headers"]) + sent["target"]
    assert sent["headers"]["authorization"] == f"Bearer {PROVIDER_KEY}" and "x-goog-api-key" not in sent["headers"]
    for status, body in refused:
        error = json.loads(body)["error"]
        assert (status, error["code"]) == (400, "key_in_url") and KEY not in error["message"]
    rows = read_rows(tmp_path / "l.duckdb")
    assert [(r["path"], r["http_status"]) for r in rows] == [
        ("/v1/models", 200),
        ("/v1/models", 400),
        ("/v1/models/***", 400),
    ]


def test_pipelined_requests_absolute_targets_and_redirects_stay_with_the_upstream_and_their_keys(tmp_path):
    # Held already (no fix): two requests in one packet are two rows, each with its own key; an
    # absolute-form target names a host tokenward ignores; an upstream's redirect to another host is
    # relayed, never followed, so the provider key goes nowhere else.
    other = "tw-edge-other-key-0002"

    async def handle(request: web.Request, body: bytes) -> web.StreamResponse:
        if request.path == "/v1/models/moved":
            raise web.HTTPTemporaryRedirect(f"http://127.0.0.1:{servers.attacker_port}/steal")
        return web.json_response({"object": "list", "data": []})

    with Servers(handle).running() as servers:
        config = keys_config(servers.upstream_url, tmp_path / "l.duckdb",
                             VirtualKeyConfig(name="a", key=KEY), VirtualKeyConfig(name="b", key=other))  # fmt: skip
        with running_in_thread(create_app(config)) as url:
            first = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n"
            second = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {other}\r\nConnection: close\r\n\r\n"
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall((first + second).encode())  # one packet
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
            absolute, _ = raw(
                url,
                f"GET http://127.0.0.1:{servers.attacker_port}/v1/models HTTP/1.1\r\nHost: 127.0.0.1:"
                f"{servers.attacker_port}\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode(),
            )
            status, _ = raw(
                url, f"GET /v1/models/moved HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode()
            )  # fmt: skip
    assert data.count(b"HTTP/1.1 200 OK") == 2 and absolute == 200 and status == 307
    assert [r["target"] for r in servers.requests] == ["/v1/models"] * 3 + ["/v1/models/moved"]
    assert servers.attacker_connections == 0 and servers.attacker_bytes == b""
    rows = read_rows(tmp_path / "l.duckdb")
    assert [(r["principal"], r["path"], r["http_status"]) for r in rows] == [
        ("a", "/v1/models", 200),
        ("b", "/v1/models", 200),
        ("a", "/v1/models", 200),
        ("a", "/v1/models/moved", 307),
    ]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_whole_reply_over_the_cap_is_relayed_as_it_arrives_and_not_metered(tmp_path, monkeypatch, framing):
    # A whole (not streamed) reply was read into memory before a byte went to the client, and held
    # twice: a 300 MiB body raised the proxy's peak RSS by 600 MiB, and a broken upstream that never
    # ends its body grew it until the kernel killed the proxy (every request in flight with it). Over
    # the cap (here 1 MiB, 256 MiB by default) the reply is relayed as it arrives; its usage is not
    # read, and its row says the provider may have billed it (before: read whole, "priced").
    from tokenward.proxy import relay

    from .raw_upstream import LAST_CHUNK, RawUpstream, chunk

    monkeypatch.setattr(relay, "MAX_WHOLE_BODY_BYTES", 1 << 20, raising=False)
    head = json.dumps({"id": "c-1", "object": "chat.completion", "model": "gpt-4o-mini", "usage": {
        "prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}, "choices": [{"index": 0, "message": {
        "role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}).encode()  # fmt: skip
    pieces = [head] + [b" " * (1 << 20)] * 3  # valid JSON: the object, then 3 MiB of spaces
    body = b"".join(pieces)
    if framing == "chunked":
        reply = [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
                 *(chunk(p) for p in pieces), LAST_CHUNK]  # fmt: skip
    else:
        reply = [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                 + str(len(body)).encode() + b"\r\n\r\n", *pieces]  # fmt: skip
    upstream = RawUpstream()
    upstream.script = lambda head, sent: list(reply)
    with upstream.running():
        with proxy(upstream.url, tmp_path / "l.duckdb") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            got = client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
            assert got.http_response.read() == body
    rows = read_rows(tmp_path / "l.duckdb")
    assert [(r["http_status"], r["outcome"], r["price_status"], r["cost_usd"]) for r in rows] == [
        (200, "ok", "usage_unknown", None)
    ]
    assert rows[0]["error"] == "a whole reply over 1048576 bytes: relayed, not metered"


class RewritingUpstream:
    """An upstream behind a front end that serves the URL a trusted header names (IIS URL Rewrite, Symfony).

    IIS's URL Rewrite and Symfony's ``Request`` (with the proxy it trusts) read ``X-Original-URL``
    or ``X-Rewrite-URL`` as the request's path. The account holds a file of another key
    (``file-of-b``): ``GET /v1/files`` lists it. ``served`` collects the path each request was served as.
    """

    def __init__(self) -> None:
        self.served: list[str] = []

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        path = request.headers.get("X-Original-URL") or request.headers.get("X-Rewrite-URL") or request.path
        self.served.append(path)
        if path.startswith("/v1/files"):
            return web.json_response({"object": "list", "data": [{"id": "file-of-b", "object": "file"}]})
        return web.json_response({"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model"}]})


@pytest.mark.parametrize("header", ["X-Original-URL", "X-Rewrite-URL", "x-original-url"])
def test_a_header_naming_another_path_cannot_turn_an_allowed_model_list_into_a_file_list(tmp_path, header):
    # The default allow_unmetered lets GET models pass and refuses files (403); an upstream whose front
    # end serves the path X-Original-URL names listed the account's files, another key's among them, to
    # a key that may list none (before: 200 with file-of-b, the row said GET /v1/models). The forwarding
    # headers of the hop to tokenward (X-Forwarded-Host, Forwarded, ...) did not stop at tokenward either.
    upstream = RewritingUpstream()
    forwarding = (
        f"{header}: /v1/files\r\nX-Forwarded-Host: evil.example\r\nX-Forwarded-Prefix: /evil\r\n"
        "X-Forwarded-Proto: http\r\nX-Forwarded-For: 10.0.0.7\r\nForwarded: host=evil.example;proto=http\r\n"
        "X-Real-IP: 10.0.0.7\r\nX-Original-Host: evil.example\r\n"
    )
    with Servers(upstream.handle).running() as servers:
        with proxy(servers.upstream_url, tmp_path / "l.duckdb") as url:
            status, body = raw(
                url,
                f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n{forwarding}"
                "Connection: close\r\n\r\n".encode(),
            )
            files, _ = raw(
                url, f"GET /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode()
            )  # fmt: skip
    assert status == 200 and json.loads(body)["data"] == [{"id": "gpt-4o-mini", "object": "model"}]
    assert files == 403  # the files list itself stays refused, as before
    assert upstream.served == ["/v1/models"]
    (sent,) = servers.requests
    assert sorted(sent["headers"]) == ["accept-encoding", "authorization", "host"]
    assert sent["headers"]["host"] == f"127.0.0.1:{servers.port}"
    rows = read_rows(tmp_path / "l.duckdb")
    assert [(r["method"], r["path"], r["http_status"]) for r in rows] == [
        ("GET", "/v1/models", 200),
        ("GET", "/v1/files", 403),
    ]


async def mints_secrets(request: web.Request, body: bytes) -> web.StreamResponse:
    """Realtime as the provider answers it: a client secret (``ek_...``) good for opening sessions straight at it."""
    if request.path == "/v1/realtime/calls":
        return web.Response(text="v=0\r\no=- 1 1 IN IP4 203.0.113.1\r\n", content_type="application/sdp", status=201)
    session = {"type": "realtime", "model": "gpt-realtime"}
    return web.json_response({"value": "ek_live_secret", "expires_at": 1_900_000_000, "session": session})


@pytest.mark.parametrize(
    "allow", [("*",), ("GET models", "realtime/*"), ("GET models", "POST realtime*", "POST realtime/client_secret?")]
)
def test_a_wildcard_does_not_let_a_key_mint_secrets_that_spend_past_tokenward(tmp_path, allow):
    # A Realtime client secret opens sessions at the provider for up to 2 hours with the account's quota, and
    # realtime/calls hands a WebRTC peer a media session there: none of that spend passes tokenward again. An
    # operator's "*" (or "realtime/*") let any key mint them (before: 200 with "ek_live_secret", one row of
    # $0 not_metered, and every Realtime minute it bought unmetered and outside the $0.01 cap)
    with Servers(mints_secrets).running() as servers:
        with proxy(servers.upstream_url, tmp_path / "l.duckdb", allow=allow) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            with pytest.raises(openai.PermissionDeniedError) as refused:
                client.realtime.client_secrets.create(session={"type": "realtime", "model": "gpt-realtime"})
            status, body = raw(
                url,
                f"POST /v1/Realtime/Calls HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
                "application/sdp\r\nContent-Length: 4\r\nConnection: close\r\n\r\nv=0\n".encode(),
            )
            listed = client.models.with_raw_response.list()  # the wildcard still lets everything else pass
    error = refused.value.body
    assert error["code"] == "endpoint_not_allowed"  # type: ignore[index]
    assert "'POST realtime/client_secrets'" in error["message"]  # type: ignore[index]
    assert (status, json.loads(body)["error"]["code"]) == (403, "endpoint_not_allowed")
    assert listed.status_code == 200
    assert [r["target"] for r in servers.requests] == ["/v1/models"]
    rows = read_rows(tmp_path / "l.duckdb")
    assert [(r["path"], r["http_status"], r["outcome"]) for r in rows] == [
        ("/v1/realtime/client_secrets", 403, "rejected"),
        ("/v1/Realtime/Calls", 403, "rejected"),
        ("/v1/models", 200, "ok"),
    ]


def test_an_entry_naming_a_realtime_secret_endpoint_exactly_lets_it_pass(tmp_path):
    with Servers(mints_secrets).running() as servers:
        allow = ("POST realtime/client_secrets", "realtime/calls")
        with proxy(servers.upstream_url, tmp_path / "l.duckdb", allow=allow) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            secret = client.realtime.client_secrets.create(session={"type": "realtime", "model": "gpt-realtime"})
            status, body = raw(
                url,
                f"POST /v1/realtime/calls HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
                "application/sdp\r\nContent-Length: 4\r\nConnection: close\r\n\r\nv=0\n".encode(),
            )
    assert secret.value == "ek_live_secret" and status == 201 and body.startswith(b"v=0")
    assert [r["target"] for r in servers.requests] == ["/v1/realtime/client_secrets", "/v1/realtime/calls"]


async def hop_replies(request: web.Request, body: bytes) -> web.StreamResponse:
    """The :func:`tests.servers.api` upstream, its replies naming ``X-Up-Hop`` in ``Connection``."""
    reply = await api(request, body)
    reply.headers["Connection"] = "keep-alive, X-Up-Hop"
    reply.headers["X-Up-Hop"] = "for tokenward only"
    reply.headers["X-Up-Kept"] = "1"
    return reply


def test_headers_named_in_connection_stop_at_tokenward_but_never_its_credential(tmp_path, monkeypatch):
    # RFC 9110 7.6.1: a header named in Connection is for that hop only, and a proxy removes it. tokenward
    # forwarded them both ways (before: x-secret-hop and x-other-hop reached the upstream, x-up-hop the
    # client). A client naming the credential, the body's length and type, or anthropic-version must not
    # make tokenward send the upstream a request it did not check: those stay.
    hops = "Connection: close, X-Secret-Hop, Authorization, Content-Type, Content-Length\r\nConnection: x-other-hop\r\n"
    chat = b'{"model":"gpt-4o-mini","max_tokens":50,"messages":[{"role":"user","content":"primes"}]}'
    with Servers(hop_replies).running() as servers:
        with proxy(servers.upstream_url, tmp_path / "l.duckdb") as url:
            listed = raw_reply(
                url,
                f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n{hops}X-Secret-Hop: a\r\n"
                "X-Other-Hop: b\r\nX-Kept: c\r\nAnthropic-Version: 2023-06-01\r\n\r\n".encode(),
            )
            metered = raw_reply(
                url,
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n{hops}"
                f"Content-Type: application/json\r\nContent-Length: {len(chat)}\r\nX-Secret-Hop: a\r\n\r\n".encode()
                + chat,
            )
        monkeypatch.setenv("EDGE_KEY", "")
        config = Config(
            upstreams=[UpstreamConfig(name="o", base_url=f"{servers.upstream_url}/v1", provider="openai")],
            ledger=LedgerConfig(path=str(tmp_path / "p.duckdb"), flush_interval_s=0.05),
        )  # passthrough: the client's own key is the credential, and its row's fingerprint
        with running_in_thread(create_app(config)) as url:
            own = raw_reply(
                url,
                f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-own-0001\r\n{hops}"
                "X-Other-Hop: b\r\n\r\n".encode(),
            )
    for head, _ in (listed, metered, own):
        assert head.startswith(b"HTTP/1.1 200") and b"x-up-kept: 1" in head.lower()
        assert b"x-up-hop" not in head.lower()
    models, chat_sent, passthrough = servers.requests
    assert models["headers"]["authorization"] == f"Bearer {PROVIDER_KEY}" and models["headers"]["x-kept"] == "c"
    assert models["headers"]["anthropic-version"] == "2023-06-01"
    assert chat_sent["headers"]["content-type"] == "application/json"
    assert json.loads(chat_sent["body"]) == json.loads(chat)  # the whole body, its length kept
    assert passthrough["headers"]["authorization"] == "Bearer sk-own-0001"
    for sent in servers.requests:
        assert "x-secret-hop" not in sent["headers"] and "x-other-hop" not in sent["headers"]
    # 9 prompt tokens at $0.15/1M + 3 completion tokens at $0.60/1M = $0.00000135 + $0.0000018
    (chat_row,) = [r for r in read_rows(tmp_path / "l.duckdb") if r["path"] == "/v1/chat/completions"]
    assert (chat_row["input_tokens"], chat_row["output_tokens"]) == (9, 3)
    assert chat_row["cost_usd"] == Decimal("0.00000315")
    (row,) = read_rows(tmp_path / "p.duckdb")
    assert row["principal"].startswith("fp-") and row["http_status"] == 200


@pytest.mark.parametrize(
    ("target", "header"),
    [
        ("/v1/models?userProject=other-project", ""),  # Google bills the project named, not the credential's
        ("/v1/models?%24userProject=other-project", ""),
        ("/v1/models?key=AIza-someone-elses", ""),  # a credential beside tokenward's
        ("/v1/models?access_token=ya29.other", ""),
        ("/v1/files?%24ct=application/x-www-form-urlencoded", ""),  # the body read by another media type
        ("/v1/chat/completions?alt=proto", ""),  # a protobuf reply: no usage the meter reads
        ("/v1/chat/completions?fields=choices", ""),  # a field mask: the usage left out
        ("/v1/chat/completions", "X-Goog-FieldMask: choices\r\n"),
    ],
)
def test_google_system_parameters_cannot_steer_billing_credentials_or_the_reply(tmp_path, target, header):
    # Google's API front ends (Gemini's, Vertex AI's OpenAI-compatible endpoints) read "system parameters" from
    # any request: before, each of these reached the upstream (200), billing another project, using another
    # credential, or answering in a shape whose usage tokenward cannot read
    chat = b'{"model":"gpt-4o-mini","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}'
    method = "POST" if "chat" in target or "files" in target else "GET"
    body = chat if method == "POST" else b""
    with Servers(api).running() as servers:
        with proxy(servers.upstream_url, tmp_path / "l.duckdb", allow=("GET models", "files")) as url:
            status, reply = raw(
                url,
                f"{method} {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n{header}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body,
            )
            header_dropped, _ = raw(
                url,
                f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nX-Goog-User-Project: other\r\n"
                "Connection: close\r\n\r\n".encode(),
            )
    assert (status, json.loads(reply)["error"]["code"]) == (400, "parameter_refused")
    assert header_dropped == 200
    (sent,) = servers.requests
    assert sent["target"] == "/v1/models" and "x-goog-user-project" not in sent["headers"]
    rows = read_rows(tmp_path / "l.duckdb")
    assert [r["http_status"] for r in rows] == [400, 200]


@pytest.mark.parametrize(
    ("framing", "status", "code"),
    [
        (b"HTTP/1.1\r\nTransfer-Encoding: gzip, chunked", 501, "unsupported_transfer_coding"),
        (b"HTTP/1.1\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked", 501, "unsupported_transfer_coding"),
        (b"HTTP/1.0\r\nTransfer-Encoding: chunked", 400, "invalid_framing"),
    ],
    ids=["gzip-chunked", "two-headers", "http-1.0"],
)
def test_a_transfer_coding_tokenward_does_not_apply_is_refused_not_passed_on_still_coded(
    tmp_path, framing, status, code
):
    # Before: the server undid "chunked" and nothing else, the header was dropped as hop-by-hop, and the
    # body went upstream still gzip-coded as if it were the content (an allowed moderation: 200, the 22 bytes
    # of gzip where the 2 bytes "{}" were meant; a metered one: 400 invalid_json for a valid body). RFC 9112
    # 6.1: 501 for a transfer coding the server does not understand; Transfer-Encoding in an HTTP/1.0
    # message is faulty framing.
    import gzip

    coded = gzip.compress(b"{}")
    body = f"{len(coded):x}\r\n".encode() + coded + b"\r\n0\r\n\r\n"
    with Servers(api).running() as servers, proxy(servers.upstream_url, tmp_path / "l.duckdb", ("*",)) as url:
        for path in (b"/v1/moderations", b"/v1/chat/completions"):
            head = b"POST " + path + b" " + framing + f"\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode()
            got, reply = raw(url, head + b"Content-Type: application/json\r\nConnection: close\r\n\r\n" + body)
            assert (got, json.loads(reply)["error"]["code"]) == (status, code)
        assert servers.requests == []
    rows = read_rows(tmp_path / "l.duckdb")
    assert [(r["path"], r["http_status"], r["outcome"]) for r in rows] == [
        ("/v1/moderations", status, "client_error"),
        ("/v1/chat/completions", status, "client_error"),
    ]


def test_a_trailer_field_is_not_a_header(tmp_path):
    # uvicorn appended a chunked body's trailer fields to the request's headers, the list tokenward reads:
    # a trailer naming the user (after the frontend's header) was the user billed (boss@example.com, the
    # last value read), and a trailer Authorization made a valid request 400 ambiguous_credentials. RFC 9110
    # 6.5.1: trailer fields are not merged into the header section; tokenward reads none.
    from tokenward.proxy.config import AttributionRule, AttributionSettings

    email = AttributionSettings(end_user=AttributionRule(header="X-OpenWebUI-User-Email"))
    document = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}).encode()
    body = f"{len(document):x}\r\n".encode() + document + b"\r\n0\r\n"
    with Servers(api).running() as servers:
        config = keys_config(servers.upstream_url, tmp_path / "l.duckdb",
                             VirtualKeyConfig(name="webui", key=KEY, attribution=email),
                             VirtualKeyConfig(name="other", key="tw-edge-other-key-0002"))  # fmt: skip
        with running_in_thread(create_app(config)) as url:
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                "X-OpenWebUI-User-Email: alice@example.com\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            ).encode()
            for trailer in (
                b"X-OpenWebUI-User-Email: boss@example.com",
                b"Authorization: Bearer tw-edge-other-key-0002",
            ):
                status, reply = raw(url, head + body + trailer + b"\r\n\r\n")
                assert status == 200, reply
        assert [r["body"] for r in servers.requests] == [document, document]
        assert all("x-openwebui-user-email" not in r["headers"] for r in servers.requests)
    rows = read_rows(tmp_path / "l.duckdb")
    # gpt-4o-mini, the upstream's usage (tests/servers.py): 9 x 0.15 + 3 x 0.60 = $0.00000315 each
    assert [(r["principal"], r["end_user"], r["http_status"], r["cost_usd"]) for r in rows] == [
        ("webui", "alice@example.com", 200, Decimal("0.00000315")),
        ("webui", "alice@example.com", 200, Decimal("0.00000315")),
    ]
