"""What real clients read from tokenward's own replies: the ``anthropic`` and ``openai`` SDKs, Claude Code's requests.

The Anthropic SDK and Claude Code read an error as ``{"type": "error", "error": {"type", "message"}}``
with ``error.type`` from Anthropic's vocabulary (``rate_limit_error``, ``authentication_error``, ...);
OpenAI's SDK reads ``{"error": {"message", "type", "param", "code"}}``. tokenward answers a request in
Anthropic's dialect with both at once, and every refusal still gets its one ledger row.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from aiohttp import web

from tests import test_isolation as isolation_tests
from tests.conftest import Proxy
from tests.object_store import ObjectStore
from tests.raw_upstream import RawUpstream
from tests.servers import Servers, api, chat_stream
from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.app import create_app
from tokenward.proxy.config import AuthConfig, Config, LedgerConfig, UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.server import running_in_thread

KEY = "tw-claude-code-0123456789"
CLAUDE = {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    with Servers(api).running() as running:
        yield running


@contextmanager
def start(servers: Servers, ledger: Path, **config: Any) -> Iterator[Proxy]:
    config = {
        "upstreams": [
            UpstreamConfig(
                name="openai", base_url=f"{servers.upstream_url}/openai/v1", provider="openai", default=True
            ),
            UpstreamConfig(
                name="anthropic",
                base_url=f"{servers.upstream_url}/anthropic/v1",
                provider="anthropic",
                models=["claude-*"],
            ),
        ],
        "ledger": LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        **config,
    }
    app = create_app(Config(**config))
    with running_in_thread(app) as url:
        yield Proxy(url, app, ledger)


def anthropic_error(kind: str, message: str, code: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message, "param": None, "code": code}}


def test_a_budget_refusal_reaches_the_anthropic_sdk_as_anthropics_rate_limit_error_and_is_not_retried(
    servers, tmp_path
):
    """Before: ``{"error": {"type": "insufficient_quota", ...}}``: the SDK's ``err.type`` named no Anthropic type."""
    budget = BudgetSettings(name="tiny", limit_usd="0.000001", period="day", action="block")
    with start(servers, tmp_path / "l.duckdb", budgets=[budget]) as proxy:
        sent = len(servers.requests)
        with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-client") as claude:  # 2 retries by default
            with pytest.raises(anthropic.RateLimitError) as refused:
                claude.messages.create(**CLAUDE)
        (row,) = proxy.rows(1)
    error = refused.value
    assert error.type == "rate_limit_error" and error.api_message.startswith("Budget 'tiny'")
    assert error.body == anthropic_error("rate_limit_error", error.api_message, "budget_exceeded")
    assert error.response.headers["x-should-retry"] == "false"  # so the SDK tried once: one row, nothing sent
    assert servers.requests[sent:] == []
    assert (row["endpoint"], row["http_status"], row["outcome"], row["cost_usd"]) == (
        "anthropic_messages",
        429,
        "rejected",
        0,
    )


def test_an_unknown_key_reaches_claude_codes_async_client_as_an_authentication_error(servers, tmp_path):
    """Claude Code (the async SDK, ``anthropic-beta`` header) tells a user to log in on ``authentication_error``."""

    async def ask() -> anthropic.AuthenticationError:
        async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="tw-nobody-000000", max_retries=0) as claude:
            with pytest.raises(anthropic.AuthenticationError) as refused:
                await claude.beta.messages.count_tokens(
                    model="claude-sonnet-4-5",
                    messages=[{"role": "user", "content": "hi"}],
                    betas=["claude-code-20250219"],
                )
            return refused.value

    auth = AuthConfig(mode="virtual_keys")
    with start(servers, tmp_path / "l.duckdb", auth=auth, virtual_keys=[VirtualKeyConfig(name="cc", key=KEY)]) as proxy:
        error = asyncio.run(ask())
        (row,) = proxy.rows(1)
    assert error.type == "authentication_error" and error.body["type"] == "error"
    assert error.body["error"]["code"] == "invalid_api_key" and error.body["error"]["message"] == error.api_message
    assert (row["path"], row["http_status"], row["outcome"]) == ("/v1/messages/count_tokens", 401, "unauthorized")


@pytest.mark.parametrize(
    ("path", "headers", "anthropic_shape"),
    [
        ("/v1/messages", {"x-api-key": "sk-ant-client"}, True),
        ("/v1/messages", {"authorization": "Bearer sk-client"}, True),  # the path is Anthropic's
        ("/v1/messages", {"authorization": "Bearer oauth-token", "anthropic-beta": "oauth-2025-04-20"}, True),
        # Anthropic's OpenAI-compatible endpoint through its SDK's headers: Anthropic's SDK reads the reply
        ("/v1/chat/completions", {"authorization": "Bearer sk-client", "anthropic-version": "2023-06-01"}, True),
        ("/v1/chat/completions", {"authorization": "Bearer sk-client"}, False),
        ("/v1/responses", {"authorization": "Bearer sk-client"}, False),
    ],
)
def test_bad_json_is_refused_in_the_shape_of_the_dialect_the_client_speaks(
    servers, tmp_path, path, headers, anthropic_shape
):
    with start(servers, tmp_path / "l.duckdb") as proxy:
        reply = httpx.post(
            f"{proxy.url}{path}", content=b'{"model": ', headers={**headers, "content-type": "application/json"}
        )
        (row,) = proxy.rows(1)
    assert reply.status_code == 400 and reply.headers["content-type"] == "application/json"
    document = reply.json()
    error = document["error"]
    assert error["code"] == "invalid_json" and error["param"] is None and error["message"]
    if anthropic_shape:
        assert document == anthropic_error("invalid_request_error", error["message"], "invalid_json")
    else:
        assert document == {
            "error": {
                "message": error["message"],
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_json",
            }
        }
    assert (row["http_status"], row["outcome"]) == (400, "client_error")


def test_the_openai_sdk_still_reads_code_and_message_from_an_anthropic_shaped_refusal(servers, tmp_path):
    """A request with an Anthropic header through the OpenAI SDK gets both shapes: ``code`` and ``message`` read as before."""
    budget = BudgetSettings(name="tiny", limit_usd="0.000001", period="day", action="block")
    with start(servers, tmp_path / "l.duckdb", budgets=[budget]) as proxy:
        with openai.OpenAI(
            base_url=f"{proxy.url}/v1", api_key="sk-client", default_headers={"anthropic-version": "2023-06-01"}
        ) as client:
            with pytest.raises(openai.RateLimitError) as refused:
                client.chat.completions.create(model="claude-sonnet-4-5", messages=[{"role": "user", "content": "hi"}])
        rows = proxy.rows(1)
    error = refused.value
    assert error.code == "budget_exceeded" and error.type == "rate_limit_error" and len(rows) == 1
    assert json.loads(error.response.content)["type"] == "error"


def two_gzip_members(first: bytes, second: bytes) -> bytes:
    """One gzip body of two members (RFC 1952 2.2): ``gzip -c a b``, or two writes of a member-per-flush writer."""
    return gzip.compress(first) + gzip.compress(second)


@pytest.mark.parametrize("first", [b"", b"  \n"])
def test_a_gzip_body_whose_second_member_names_another_keys_file_is_refused(tmp_path, monkeypatch, first):
    """Before: only the first member was decoded and checked (empty: nothing to check); the body went on as sent.

    The upstream (aiohttp here; Go's and Python's gzip readers alike) joins every member, so it made Bob
    a vector store holding Alice's file: Bob's ``file_search`` then read Alice's document.
    """
    monkeypatch.setenv("OBJECTS_SECRET", isolation_tests.SECRET)
    with ObjectStore().running() as store, isolation_tests.proxy(store, tmp_path / "l.duckdb") as url:
        with isolation_tests.gpt(url, isolation_tests.ALICE) as alice:
            alice_file = isolation_tests.upload(alice, "alice.jsonl")
        document = {"name": "notes", "file_ids": [alice_file]}
        body = two_gzip_members(first, json.dumps(document).encode())
        assert json.loads(gzip.decompress(body)) == document  # what any gzip reader makes of it

        def create(key: str) -> httpx.Response:
            headers = {"content-type": "application/json", "content-encoding": "gzip", "authorization": f"Bearer {key}"}
            return httpx.post(f"{url}/v1/vector_stores", content=body, headers=headers)

        sent = len(store.requests)
        refused = create(isolation_tests.BOB)
        assert refused.status_code == 404 and store.requests[sent:] == []  # bob's never left
        assert refused.json()["error"]["message"] == f"No such File object: {alice_file}"
        created = create(isolation_tests.ALICE)
        assert created.status_code == 200 and store.vector_store_files[created.json()["id"]] == [alice_file]


def raw_deflate_with_a_zlib_nibble(data: bytes) -> bytes:
    """``data`` as a raw deflate stream whose first byte's low nibble is 8: a stored block with a padding bit set.

    Raw deflate (RFC 1951 3.2.4) ignores the bits after a stored block's 3-bit header; zlib's first byte
    names method 8 in that nibble (RFC 1950 2.2). Not a zlib header (0x08 0x11 is no multiple of 31), so
    tokenward (and zlib's own header check) reads it as raw deflate; aiohttp, seeing the 8, reads it as zlib.
    """
    encoder = zlib.compressobj(level=0, wbits=-15)
    stream = encoder.compress(data) + encoder.flush(zlib.Z_FULL_FLUSH) + encoder.flush()
    assert stream[0] == 0x00 and (0x08 << 8 | stream[1]) % 31 != 0
    return bytes([stream[0] | 0x08]) + stream[1:]


@pytest.mark.parametrize("coding", ["deflate", "gzip", "br", "zstd"])
def test_a_body_isolation_checked_is_sent_as_the_json_it_checked(tmp_path, monkeypatch, coding):
    """Before: a passthrough body isolation read was checked decoded but sent as the client compressed it.

    Two decoders then read one body: tokenward's (whose reading was checked) and the upstream's. They differ
    (here a raw deflate stream aiohttp takes for zlib: the upstream answered 500 and made nothing). Now the
    upstream gets the checked JSON itself, without Content-Encoding, with its own Content-Length.
    """
    import brotli
    import zstandard

    monkeypatch.setenv("OBJECTS_SECRET", isolation_tests.SECRET)
    document = json.dumps({"name": "notes"}).encode()
    encode = {
        "deflate": raw_deflate_with_a_zlib_nibble,
        "gzip": gzip.compress,
        "br": brotli.compress,
        "zstd": zstandard.ZstdCompressor().compress,
    }[coding]
    with ObjectStore().running() as store, isolation_tests.proxy(store, tmp_path / "l.duckdb") as url:
        reply = httpx.post(
            f"{url}/v1/vector_stores",
            content=encode(document),
            headers={
                "content-type": "application/json",
                "content-encoding": coding,
                "authorization": f"Bearer {isolation_tests.BOB}",
            },
        )
        assert reply.status_code == 200, reply.text
        created = store.objects[reply.json()["id"]]
        sent = store.headers[-1]
    assert created["name"] == "notes" and "content-encoding" not in sent
    assert sent["content-length"] == str(len(document))


@pytest.mark.parametrize("coding", ["deflate", "gzip"])
def test_bytes_after_a_compressed_body_are_refused_not_left_unread(servers, tmp_path, coding):
    """A metered body is forwarded decoded: before, what followed the first stream was dropped unread and unsaid."""
    document = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}).encode()
    body = (gzip.compress if coding == "gzip" else zlib.compress)(document) + b"trailing bytes"
    with start(servers, tmp_path / "l.duckdb") as proxy:
        sent = len(servers.requests)
        reply = httpx.post(
            f"{proxy.url}/v1/chat/completions",
            content=body,
            headers={
                "authorization": "Bearer sk-client",
                "content-type": "application/json",
                "content-encoding": coding,
            },
        )
        (row,) = proxy.rows(1)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_content_encoding"
    assert servers.requests[sent:] == [] and (row["http_status"], row["outcome"]) == (400, "client_error")


def test_a_metered_body_in_two_gzip_members_is_read_and_sent_whole(servers, tmp_path):
    """Before: the first member alone was read (here half a JSON document): 400 ``invalid_json`` for a valid body."""
    document = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "three primes"}]}).encode()
    with start(servers, tmp_path / "l.duckdb") as proxy:
        sent = len(servers.requests)
        reply = httpx.post(
            f"{proxy.url}/v1/chat/completions",
            content=two_gzip_members(document[:20], document[20:]),
            headers={
                "authorization": "Bearer sk-client",
                "content-type": "application/json",
                "content-encoding": "gzip",
            },
        )
        (row,) = proxy.rows(1)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "2, 3, 5"
    (forwarded,) = servers.requests[sent:]
    assert forwarded["body"] == document and "content-encoding" not in forwarded["headers"]
    # the upstream's usage (tests/servers.py CHAT_USAGE): gpt-4o-mini 9 x 0.15 + 3 x 0.60 = 3.15 / 1M
    assert (row["outcome"], row["input_tokens"], row["output_tokens"]) == ("ok", 9, 3)
    assert row["cost_usd"] == Decimal("0.00000315")


@pytest.mark.parametrize("window_bits", [9, 12, 15])
def test_a_deflate_body_with_a_small_window_is_read_as_the_zlib_stream_it_is(servers, tmp_path, window_bits):
    """Before: only a first byte of 0x78 (a 32 KiB window) was read as zlib; 0x18 or 0x48 were tried as raw deflate.

    A zlib stream's first byte names its window (RFC 1950 2.2): embedded encoders use 512 B to 4 KiB.
    """
    document = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "three primes"}]}).encode()
    encoder = zlib.compressobj(wbits=window_bits)
    with start(servers, tmp_path / "l.duckdb") as proxy:
        sent = len(servers.requests)
        reply = httpx.post(
            f"{proxy.url}/v1/chat/completions",
            content=encoder.compress(document) + encoder.flush(),
            headers={
                "authorization": "Bearer sk-client",
                "content-type": "application/json",
                "content-encoding": "deflate",
            },
        )
        (row,) = proxy.rows(1)
    assert reply.status_code == 200 and [r["body"] for r in servers.requests[sent:]] == [document]
    # gpt-4o-mini 9 x 0.15 + 3 x 0.60 = 3.15 / 1M
    assert (row["outcome"], row["cost_usd"]) == ("ok", Decimal("0.00000315"))


def test_a_client_that_leaves_before_the_last_chunk_arrives_is_recorded_as_gone_not_ok(tmp_path, monkeypatch):
    """The openai SDK closes a stream after its first chunk; the rest (finish, usage, ``[DONE]``) arrives in one read.

    Before: that read held the terminal event, so the row was recorded ``ok`` before tokenward looked
    at the connection: a reply the client never got counted as delivered. Now the row says
    ``client_disconnected``, with the usage the upstream reported (the provider bills it all the same).
    """
    from tokenward.proxy import limits

    left = threading.Event()
    lost = limits.ClientConnection.connection_lost

    def noticed(self: limits.ClientConnection) -> None:
        lost(self)
        left.set()  # tokenward has seen the client go

    monkeypatch.setattr(limits.ClientConnection, "connection_lost", noticed)
    first, *rest = chat_stream(asked=True)

    async def chat(request: web.Request, body: bytes) -> web.StreamResponse:
        reply = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await reply.prepare(request)
        await reply.write(first)
        while not left.is_set():  # the rest comes once the client has gone
            await asyncio.sleep(0.01)
        await reply.write(b"".join(rest))  # one read: the finishing chunk, the usage, [DONE]
        await reply.write_eof()
        return reply

    with Servers(chat).running() as upstream, start(upstream, tmp_path / "l.duckdb") as proxy:
        with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-client", max_retries=0) as client:
            stream = client.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "three primes"}], stream=True
            )
            assert next(iter(stream)).choices[0].delta.role == "assistant"
            stream.close()
            assert left.wait(30)
        (row,) = proxy.rows(1)
    assert (row["outcome"], row["error"]) == ("client_disconnected", "client disconnected during the stream")
    # as reported (tests/servers.py CHAT_USAGE): gpt-4o-mini 9 x 0.15 + 3 x 0.60 = 3.15 / 1M
    assert (row["usage_source"], row["input_tokens"], row["output_tokens"]) == ("reported", 9, 3)
    assert row["cost_usd"] == Decimal("0.00000315")


def test_an_anthropic_reply_that_breaks_before_it_starts_is_a_502_api_error_with_its_row(servers, tmp_path):
    """The upstream's JSON body breaks off (a middlebox writes its own page into the chunked body)."""
    upstream = RawUpstream()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    part = b'{"id":"msg_1","type":"message","role":"assistant","content":['
    upstream.script = lambda h, b: [
        head,
        b"%x\r\n%s\r\n" % (len(part), part),
        0.3,
        b"<html>bad gateway</html>\r\n",
        5.0,
    ]
    with upstream.running():
        claude_upstream = UpstreamConfig(
            name="claude", base_url=f"{upstream.url}/v1", provider="anthropic", default=True
        )
        with start(servers, tmp_path / "l.duckdb", upstreams=[claude_upstream]) as proxy:
            with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-client", max_retries=0) as claude:
                with pytest.raises(anthropic.InternalServerError) as failed:
                    claude.messages.create(**CLAUDE)
            (row,) = proxy.rows(1)
    error = failed.value
    assert error.status_code == 502 and error.type == "api_error" and error.body["type"] == "error"
    # before its body started (upstream_failed) or while tokenward read its head (upstream_unreachable): the
    # upstream answered and may bill it, so the cost is unknown, never $0
    assert error.body["error"]["code"] in ("upstream_failed", "upstream_unreachable")
    assert (row["http_status"], row["price_status"], row["cost_usd"]) == (502, "usage_unknown", None)
