"""The request edge end to end: a real proxy, a real upstream that logs raw request lines, and an attacker.

The attacker is a second listener on loopback. tokenward holds an upstream key that travels in
``x-api-key`` to an upstream whose ``base_url`` has no path (the setup where gluing the raw path to
the base URL delivered the key to ``127.0.0.1:PORT``): no request may make it receive a byte.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings

from tests.conftest import read_rows
from tests.servers import CHAT_USAGE, Servers, api, chat_stream, raw_request
from tests.test_edge import paths
from tokenward.proxy.app import create_app
from tokenward.proxy.config import AuthConfig, Config, LedgerConfig, UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.server import running_in_thread
from tokenward.proxy.upstream import HttpxUpstream

SECRET = "sk-upstream-secret-0123456789"
KEY = "tw-edge-key-0123456789"


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    with Servers(api).running() as running:
        yield running


@contextmanager
def proxy_for(config: Config, **app_args: Any) -> Iterator[str]:
    with running_in_thread(create_app(config, **app_args)) as url:
        yield url


def edge_config(servers: Servers, ledger: Path, *, auth: str = "virtual_keys", **auth_args: Any) -> Config:
    return Config(
        upstreams=[
            UpstreamConfig(
                name="bare",  # no base path, key in x-api-key: the setup of the reported exploit
                base_url=servers.upstream_url,
                api_key_env="EDGE_SECRET",
                api_key_header="x-api-key",
                api_key_prefix="",
                provider="openai",
                default=True,
            ),
            UpstreamConfig(
                name="based",
                base_url=f"{servers.upstream_url}/base/v1",
                api_key_env="EDGE_SECRET",
                api_key_header="api-key",
                api_key_prefix="",
                provider="openai",
            ),
        ],
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        auth=AuthConfig(mode=auth, **auth_args),  # type: ignore[arg-type]
        virtual_keys=[VirtualKeyConfig(name="edge", key=KEY)],
    )


@pytest.fixture(scope="module")
def edge_proxy(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """virtual_keys mode, every unmetered endpoint allowed: the edge alone stands between client and host."""
    mp = pytest.MonkeyPatch()
    mp.setenv("EDGE_SECRET", SECRET)
    config = edge_config(servers, tmp_path_factory.mktemp("edge") / "ledger.duckdb", allow_unmetered=["*"])
    with proxy_for(config) as url:
        yield url
    mp.undo()


ATTACKS = [
    "/v1%2f@127.0.0.1:{port}/steal",
    "/v1%2F@127.0.0.1:{port}/steal",
    "/v1/@127.0.0.1:{port}/steal",
    "/v1/..%2f@127.0.0.1:{port}/steal",
    "/v1/../admin",
    "/v1/%2e%2e/%2e%2e/secret",
    "//v1/chat/completions",
    "/v1/./chat/completions",
    "/v1/x/../chat/completions",
    "/v1/%2e/chat/completions",
    "/v1/chat/completions/..",
    "/v1\\..\\admin",
    "/v1/ch%61t/completions",
]


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("upstream", ["bare", "based"])
def test_attacks_are_refused_before_any_byte_leaves(edge_proxy, servers, attack, upstream):
    before = len(servers.requests)
    target = attack.format(port=servers.attacker_port).encode()
    status, body = raw_request(
        edge_proxy,
        "POST",
        target,
        {"authorization": f"Bearer {KEY}", "content-type": "application/json", "x-tokenward-upstream": upstream},
        b'{"model": "gpt-4o-mini", "messages": []}',
    )
    error = json.loads(body)["error"]
    assert (status, error["code"], error["type"]) == (400, "invalid_path", "invalid_request_error")
    assert error["message"].startswith("The request path")
    assert len(servers.requests) == before  # not even the real upstream heard of it
    assert servers.attacker_connections == 0 and servers.attacker_bytes == b""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=paths)
def test_any_path_reaches_only_the_base_and_exactly_as_routed(edge_proxy, servers, raw):
    target = raw.replace("127.0.0.1:1", f"127.0.0.1:{servers.attacker_port}")
    before = len(servers.requests)
    query = "include%5B%5D=x%2A&y=*"
    status, body = raw_request(
        edge_proxy,
        "POST",
        f"{target}?{query}".encode(),
        {"authorization": f"Bearer {KEY}", "content-type": "application/json", "x-tokenward-upstream": "based"},
        b'{"model": "gpt-4o-mini", "messages": []}',
    )
    assert servers.attacker_connections == 0 and servers.attacker_bytes == b""
    if len(servers.requests) == before:  # refused: a 400 or 404 from tokenward, or the HTTP server's own 400
        if body == b"Invalid HTTP request received.":  # uvicorn refuses a backslash before tokenward sees it
            assert status == 400 and "\\" in target
            return
        assert (status, json.loads(body)["error"]["code"]) in ((400, "invalid_path"), (404, "not_found"))
        return
    (sent,) = servers.requests[before:]
    # the upstream got the base path plus exactly the bytes tokenward routed on, and the query as sent
    assert sent["target"] == "/base/v1" + target.removeprefix("/v1") + "?" + query
    assert sent["headers"]["api-key"] == SECRET and "authorization" not in sent["headers"]


def test_metered_and_unmetered_rows_name_the_path_that_was_sent(servers, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SECRET", SECRET)
    ledger = tmp_path / "ledger.duckdb"
    config = edge_config(servers, ledger, allow_unmetered=["*"])
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    body = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}'
    with proxy_for(config) as url:
        for target in (
            b"/v1/chat/completions",
            b"/v1/Chat/Completions",
            b"/v1/chat/completions/x",
            b"/v1/./chat/completions",
        ):
            raw_request(url, "POST", target, headers, body)
    rows = read_rows(ledger)
    assert [(r["path"], r["endpoint"], r["http_status"]) for r in rows] == [
        ("/v1/chat/completions", "chat_completions", 200),
        ("/v1/Chat/Completions", "chat_completions", 200),
        ("/v1/chat/completions/x", "passthrough", 404),  # a stored completion's id, not this key's: never sent
        ("/v1/./chat/completions", "unknown", 400),
    ]
    # both metered: the first from the reply's usage; the test upstream matches paths by case, so it echoed
    # the second without usage, and tokenward counted it (o200k: "hi" 1 + role 1 + 3 per message + 3 priming)
    assert [(r["input_tokens"], r["usage_source"]) for r in rows[:2]] == [(9, "reported"), (8, "estimated")]
    assert [s["target"] for s in servers.requests[-2:]] == ["/chat/completions", "/Chat/Completions"]


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_query_string_reaches_the_upstream_byte_for_byte(servers, tmp_path, client):
    query = "include%5B%5D=file_search_call.results%2A&include[]=message.output_text.logprobs&after=%2A&q=a+b%20c&x=~!$'()*,;:@/?"
    config = edge_config(servers, tmp_path / "ledger.duckdb", auth="passthrough")
    extra = {"upstream": HttpxUpstream(httpx.AsyncHTTPTransport())} if client == "httpx" else {}
    with proxy_for(config, **extra) as url:
        status, _ = raw_request(
            url,
            "GET",
            f"/v1/responses/resp_1?{query}".encode(),
            {"authorization": "Bearer sk-c", "x-tokenward-upstream": "based"},
        )
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-c", max_retries=0)
        sdk.models.list(extra_query={"after": "a*b", "tags[]": "x y"})
        sdk.close()
    assert status == 200
    assert servers.requests[-2]["target"] == f"/base/v1/responses/resp_1?{query}"
    assert servers.requests[-1]["target"] == "/models?after=a%2Ab&tags%5B%5D=x+y"  # as httpx (the SDK) encoded it


def test_head_and_options_are_forwarded(servers, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SECRET", SECRET)
    ledger = tmp_path / "ledger.duckdb"
    with proxy_for(edge_config(servers, ledger)) as url:  # default allow-list: GET models covers HEAD
        head = httpx.head(f"{url}/v1/models", headers={"authorization": f"Bearer {KEY}"})
        options = httpx.options(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"})
    assert (head.status_code, head.headers["x-upstream"], head.headers["content-length"], head.content) == (
        200,
        "head",
        "42",
        b"",
    )
    assert (options.status_code, options.headers["allow"], options.headers["x-upstream"]) == (
        204,
        "GET, POST, OPTIONS",
        "options",
    )
    assert [(s["method"], s["target"]) for s in servers.requests[-2:]] == [
        ("HEAD", "/models"),
        ("OPTIONS", "/chat/completions"),
    ]
    rows = read_rows(ledger)
    assert [(r["method"], r["endpoint"], r["http_status"], r["principal"]) for r in rows] == [
        ("HEAD", "passthrough", 200, "edge"),
        ("OPTIONS", "passthrough", 204, "edge"),
    ]


def mixed_config(servers: Servers, ledger: Path) -> Config:
    return Config(
        upstreams=[
            UpstreamConfig(
                name="openai", base_url=f"{servers.upstream_url}/openai/v1", provider="openai", default=True
            ),
            UpstreamConfig(name="claude", base_url=f"{servers.upstream_url}/anthropic/v1", provider="anthropic"),
        ],
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
    )


def test_anthropic_requests_reach_the_anthropic_upstream_without_naming_it(servers, tmp_path):
    ledger = tmp_path / "ledger.duckdb"
    with proxy_for(mixed_config(servers, ledger)) as url:
        claude = anthropic.Anthropic(base_url=url, api_key="sk-ant-client", max_retries=0)
        counted = claude.messages.count_tokens(model="claude-sonnet-4-5", messages=[{"role": "user", "content": "hi"}])
        models = claude.models.list()
        reply = claude.messages.create(
            model="claude-sonnet-4-5", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
        )
        claude.close()
        gpt = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-client", max_retries=0)
        gpt_models = gpt.models.list()
        gpt.close()
    assert counted.input_tokens == 17 and [m.id for m in models.data] == ["claude-sonnet-4-5"]
    assert reply.usage.output_tokens == 5 and [m.id for m in gpt_models.data] == ["gpt-4o-mini"]
    assert [s["target"] for s in servers.requests[-4:]] == [
        "/anthropic/v1/messages/count_tokens",
        "/anthropic/v1/models",
        "/anthropic/v1/messages",
        "/openai/v1/models",
    ]
    rows = read_rows(ledger)
    assert [(r["upstream"], r["endpoint"]) for r in rows] == [
        ("claude", "passthrough"),
        ("claude", "passthrough"),
        ("claude", "anthropic_messages"),
        ("openai", "passthrough"),
    ]
    assert (rows[2]["input_tokens"], rows[2]["output_tokens"]) == (20, 5)


def test_usage_chunk_is_hidden_from_a_gzip_stream(servers, tmp_path):
    ledger = tmp_path / "ledger.duckdb"
    config = mixed_config(servers, ledger)
    with proxy_for(config) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-client", max_retries=0)
        stream = client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "three primes"}],
            stream=True,
            extra_headers={"x-test-reply": "gzip"},
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)  # crashed on the usage chunk
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json={"model": "gpt-4o-mini", "messages": [], "stream": True},
            headers={"x-test-reply": "gzip", "accept-encoding": "gzip"},
        ) as raw:
            raw_bytes = raw.read()
            encoding = raw.headers.get("content-encoding")
        client.close()
    assert text == "2, 3, 5"
    sent = servers.requests[-1]
    assert sent["headers"]["accept-encoding"] == "identity"  # asked for identity: tokenward edits this stream
    assert json.loads(sent["body"])["stream_options"] == {"include_usage": True}
    # the upstream compressed anyway: the client gets the decoded events, minus the usage chunk
    assert encoding is None and raw_bytes == b"".join(chat_stream(asked=False))
    rows = read_rows(ledger)
    assert [(r["input_tokens"], r["output_tokens"], r["usage_source"]) for r in rows] == [(9, 3, "reported")] * 2
    # gpt-4o-mini: 9 * 0.15 + 3 * 0.60 = 3.15 per 1M -> $0.00000315
    assert rows[0]["cost_usd"] == Decimal("0.00000315")


def test_usage_on_a_chunk_with_choices_is_removed_and_the_chunk_kept(servers, tmp_path):
    ledger = tmp_path / "ledger.duckdb"
    body = {"model": "gpt-4o-mini", "messages": [], "stream": True}
    headers = {"x-test-reply": "finishing-usage"}
    with proxy_for(mixed_config(servers, ledger)) as url:
        via = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-client", max_retries=0)
        chunks = list(client.chat.completions.create(**body, extra_headers=headers))
        client.close()
    direct = httpx.post(f"{servers.upstream_url}/openai/v1/chat/completions", json=body, headers=headers)
    assert via.content == direct.content == b"".join(chat_stream(asked=False))
    assert [c.usage for c in chunks] == [None] * 3 and chunks[-1].choices[0].finish_reason == "stop"
    rows = read_rows(ledger)
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(CHAT_USAGE["prompt_tokens"], 3)] * 2


def test_stream_options_are_spliced_into_the_body_as_sent(servers, tmp_path):
    body = b'{ "model" : "gpt-4o-mini", "stream": true,\n  "stream_options": {"include_obfuscation": false},\n  "messages": [{"role": "user", "content": "caf\\u00e9 1.0e0"}], "temperature": 1.0 }'
    with proxy_for(mixed_config(servers, tmp_path / "ledger.duckdb")) as url:
        reply = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 200
    assert servers.requests[-1]["body"] == body.replace(
        b'"stream_options": {"include_obfuscation"', b'"stream_options": {"include_usage":true,"include_obfuscation"'
    )
