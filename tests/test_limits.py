"""Limits a client cannot push past: body size (413), body and head time (408), head size (431),
keep-alive, connections (503), JSON of any depth or shape (400), and the memory a large body costs.

Real uvicorn servers (in a thread, or ``tokenward serve`` in a subprocess for memory), raw
sockets for the slow cases, the simulator as upstream, and the ledger rows each refusal leaves.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.errors import ProxyError
from tokenward.proxy.limits import BodyLimits, body_stream, decoded_size, read_body
from tokenward.proxy.simulator import RECORD_HEADER

CHAT = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"
CHAT_BODY = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
MIB = 1024 * 1024


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def read_reply(sock: socket.socket, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (or ``timeout``); and whether it closed."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data, True
            data += chunk
    except TimeoutError:
        return data, False
    except ConnectionResetError:
        return data, True


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def error_of(reply: bytes) -> dict:
    return json.loads(reply.partition(b"\r\n\r\n")[2])["error"]


def head(path: str, length: int | None = None, extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: tokenward", "content-type: application/json"]
    if length is not None:
        lines.append(f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


# --- body size: 413 -------------------------------------------------------------------------------


def test_declared_body_over_the_limit_is_413_before_it_is_read(start_proxy, simulator):
    proxy = start_proxy(server={"max_body_mib": 1})
    before = simulator.simulator.received
    with socket.create_connection(address(proxy.url)) as sock:
        sock.sendall(head("/v1/chat/completions", 2 * MIB))  # announced, never sent
        reply, closed = read_reply(sock)
    assert status_of(reply) == 413 and closed  # the unread body makes the connection unusable
    error = error_of(reply)
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "2,097,152 bytes" in error["message"] and "server.max_body_mib" in error["message"]
    [row] = proxy.rows(1)
    assert (row["endpoint"], row["outcome"], row["http_status"]) == ("chat_completions", "client_error", 413)
    assert simulator.simulator.received == before  # nothing went upstream


def test_chunked_body_growing_past_the_limit_is_413(start_proxy):
    proxy = start_proxy(server={"max_body_mib": 0.25})

    def chunks():
        for _ in range(8):
            yield b"x" * 65536  # 512 KiB in all, no Content-Length

    reply = httpx.post(f"{proxy.url}/v1/chat/completions", content=chunks())
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert reply.headers["connection"] == "close"
    [row] = proxy.rows(1)
    assert (row["outcome"], row["http_status"]) == ("client_error", 413)


def test_body_at_the_limit_is_served(start_proxy, simulator):
    proxy = start_proxy(server={"max_body_mib": 1})
    compact = json.dumps(CHAT_BODY)
    body = compact[:-1] + " " * (MIB - len(compact)) + "}"  # exactly 1 MiB: the limit is inclusive
    assert len(body) == MIB
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", content=body, headers={RECORD_HEADER: CHAT})
    assert reply.status_code == 200
    assert len(simulator.simulator.requests[-1]["body"]) == MIB


def test_upload_limit_applies_to_other_endpoints(start_proxy, simulator):
    proxy = start_proxy(server={"max_body_mib": 0.25, "max_upload_mib": 1})
    files = {"file": ("batch.jsonl", b"y" * (512 * 1024), "application/jsonl")}
    ok = httpx.post(f"{proxy.url}/v1/files", files=files, data={"purpose": "batch"})
    assert ok.status_code == 200  # 512 KiB: over max_body_mib, but streamed through under max_upload_mib
    assert ok.json()["fields"]["file"]["bytes"] == 512 * 1024
    before = simulator.simulator.received
    files = {"file": ("big.jsonl", b"y" * (2 * MIB), "application/jsonl")}
    refused = httpx.post(f"{proxy.url}/v1/files", files=files, data={"purpose": "batch"})
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
    assert simulator.simulator.received == before
    rows = proxy.rows(2)
    assert [(r["endpoint"], r["outcome"], r["http_status"]) for r in rows] == [
        ("passthrough", "ok", 200),
        ("passthrough", "client_error", 413),
    ]


def test_streamed_upload_growing_past_the_limit_is_413(start_proxy):
    proxy = start_proxy(server={"max_upload_mib": 0.5})

    def chunks():
        for _ in range(16):
            yield b"z" * 65536  # 1 MiB, chunked

    reply = httpx.post(f"{proxy.url}/v1/files", content=chunks(), headers={"content-type": "application/jsonl"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    [row] = proxy.rows(1)
    assert (row["endpoint"], row["outcome"], row["http_status"]) == ("passthrough", "client_error", 413)


# --- body time: 408 -------------------------------------------------------------------------------


def trickle(sock: socket.socket, data: bytes, gap: float, until: float) -> None:
    """Send ``data`` a byte at a time, ``gap`` seconds apart, until it is sent or ``until`` passes."""
    for i in range(len(data)):
        if time.monotonic() > until:
            return
        try:
            sock.sendall(data[i : i + 1])
        except OSError:
            return
        time.sleep(gap)


def test_a_body_sent_a_byte_at_a_time_is_408(start_proxy):
    proxy = start_proxy(server={"body_timeout_s": 0.5, "body_min_kib_s": 64})
    body = json.dumps(CHAT_BODY).encode()
    with socket.create_connection(address(proxy.url)) as sock:
        sock.sendall(head("/v1/chat/completions", len(body)))
        started = time.monotonic()
        trickle(sock, body, 0.05, started + 3)  # 20 bytes/s: the body would take ~3 s
        reply, closed = read_reply(sock)
        took = time.monotonic() - started
    assert status_of(reply) == 408 and closed
    assert error_of(reply)["code"] == "request_timeout"
    assert 0.5 <= took < 2.5  # 0.5 s plus a few bytes' worth of time at 64 KiB/s
    [row] = proxy.rows(1)
    assert (row["endpoint"], row["outcome"], row["http_status"]) == ("chat_completions", "client_error", 408)


def test_a_fast_body_with_pauses_is_served(start_proxy):
    # 2 s, not 0.5: a 0.3 s pause within 0.5 s left a loaded machine (the proxy shares this process) 0.2 s
    proxy = start_proxy(server={"body_timeout_s": 2.0, "body_min_kib_s": 64})
    body = json.dumps(CHAT_BODY).encode()
    with socket.create_connection(address(proxy.url)) as sock:
        sock.sendall(head("/v1/chat/completions", len(body), f"{RECORD_HEADER}: {CHAT}\r\n"))
        sock.sendall(body[:10])
        time.sleep(0.3)  # one pause, within the 2 s every body gets
        sock.sendall(body[10:])
        sock.settimeout(10)
        reply = sock.recv(65536)
    assert status_of(reply) == 200


def test_a_slow_streamed_upload_is_408(start_proxy):
    proxy = start_proxy(server={"body_timeout_s": 0.5, "body_min_kib_s": 64})
    with socket.create_connection(address(proxy.url)) as sock:
        sock.sendall(head("/v1/files", 1000))
        trickle(sock, b"u" * 1000, 0.05, time.monotonic() + 3)
        reply, closed = read_reply(sock)
    assert status_of(reply) == 408 and closed
    [row] = proxy.rows(1)
    assert (row["endpoint"], row["http_status"]) == ("passthrough", 408)


async def test_read_body_counts_only_time_spent_waiting_for_the_client():
    limits = BodyLimits(max_bytes=MIB, timeout_s=0.2, min_rate=1024)
    messages = [{"type": "http.request", "body": b"a" * 100, "more_body": True}] * 5
    messages.append({"type": "http.request", "body": b"", "more_body": False})

    async def receive():
        await asyncio.sleep(0.1)  # 0.1 s a message: 0.6 s in all, but each earns 100/1024 s
        return messages.pop(0)

    assert await read_body(receive, [], limits) == b"a" * 500
    late = [{"type": "http.request", "body": b"b", "more_body": True}] * 10

    async def slow():
        await asyncio.sleep(0.1)
        return late.pop(0)

    with pytest.raises(ProxyError) as info:
        await read_body(slow, [], limits)
    assert (info.value.status, info.value.code) == (408, "request_timeout")


async def test_read_body_and_body_stream_report_a_disconnect():
    async def gone():
        return {"type": "http.disconnect"}

    with pytest.raises(ProxyError) as info:
        await read_body(gone, [], BodyLimits())
    assert (info.value.status, info.value.code) == (499, "client_disconnected")
    with pytest.raises(ProxyError) as info:
        [chunk async for chunk in body_stream(gone, [], BodyLimits())]
    assert info.value.status == 499


# --- JSON of any depth or shape: 400, never 500 ---------------------------------------------------

BLOCKING = [BudgetSettings(name="all", limit_usd=1000, period="month", action="block")]


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "gpt-4o", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",  # deep where the head is
        b'{"model": "gpt-4o", "extra": ' + b'{"a":' * 10_000 + b"1" + b"}" * 10_000 + b"}",  # deep, skipped
        b"[" * 10_000 + b"]" * 10_000,
        b'{"model": "gpt-4o", "stream": true, "stream_options": {"x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}}",
    ],
    ids=["deep-messages", "deep-unknown-member", "deep-array", "deep-stream-options"],
)
def test_json_nested_10_000_deep_is_400_invalid_json_with_a_row(start_proxy, body):
    proxy = start_proxy(budgets=BLOCKING)  # the budget bound decodes the body too
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "invalid_json" and "Traceback" not in reply.text
    [row] = proxy.rows(1)
    assert (row["outcome"], row["http_status"], row["endpoint"]) == ("client_error", 400, "chat_completions")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    value=json_values,
    model=st.one_of(json_values, st.just("gpt-4o")),
    where=st.sampled_from(["messages", "input", "stream_options", "tools", "max_tokens", "n", "metadata"]),
)
def test_any_json_shape_is_answered_without_a_500(proxy_for_shapes, value, model, where):
    body = {"model": model, where: value, "stream": where == "stream_options"}
    reply = httpx.post(f"{proxy_for_shapes.url}/v1/chat/completions", json=body)
    assert reply.status_code != 500, reply.text
    assert "Traceback" not in reply.text


@pytest.mark.parametrize("raw", [b"", b"  ", b"[]", b'"text"', b"1e999", b"nul", b"\xff\xfe{}", b'{"model": 1e999}'])
def test_bodies_that_are_no_json_object_are_400(start_proxy, raw):
    proxy = start_proxy(budgets=BLOCKING)
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", content=raw)
    assert reply.status_code in (400, 404), reply.text  # 404: the simulator has no recording for a valid object
    if reply.status_code == 400:
        assert reply.json()["error"]["code"] == "invalid_json"


@pytest.fixture(scope="module")
def proxy_for_shapes(tmp_path_factory, simulator):
    from .conftest import ProxyFactory

    factory = ProxyFactory(tmp_path_factory.mktemp("shapes"), simulator)
    yield factory(budgets=BLOCKING)
    factory.stop_all()


# --- request heads, keep-alive and connections (below the app: no ledger rows) --------------------


def test_a_head_sent_a_byte_at_a_time_is_408_and_closed(start_proxy):
    proxy = start_proxy(server={"header_timeout_s": 0.5})
    with socket.create_connection(address(proxy.url)) as sock:
        started = time.monotonic()
        trickle(sock, head("/v1/chat/completions", 10), 0.05, started + 3)
        reply, closed = read_reply(sock)
        took = time.monotonic() - started
    assert status_of(reply) == 408 and closed and 0.5 <= took < 1.5
    assert error_of(reply)["code"] == "request_timeout"
    assert "server.header_timeout_s" in error_of(reply)["message"]
    assert proxy.rows() == []  # no request ever arrived


def test_a_connection_that_sends_nothing_is_closed_quietly(start_proxy):
    proxy = start_proxy(server={"header_timeout_s": 0.3})
    with socket.create_connection(address(proxy.url)) as sock:
        started = time.monotonic()
        reply, closed = read_reply(sock, timeout=5)
    assert (reply, closed) == (b"", True) and time.monotonic() - started < 2


def test_a_head_over_the_size_limit_is_431(start_proxy):
    proxy = start_proxy(server={"max_header_kib": 8})
    with socket.create_connection(address(proxy.url)) as sock:
        sock.sendall(head("/v1/chat/completions", 2, "x-padding: " + "p" * 9000 + "\r\n"))
        reply, closed = read_reply(sock)
    assert status_of(reply) == 431 and closed
    assert error_of(reply)["code"] == "request_header_too_large"
    with socket.create_connection(address(proxy.url)) as sock:  # a head that never ends is cut off too
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nx-endless: " + b"e" * 20_000)
        reply, closed = read_reply(sock)
    assert status_of(reply) == 431 and closed


def anthropic_head(length: int, extra: str = "") -> bytes:
    """An Anthropic SDK's request head: ``/v1/messages`` with ``anthropic-version`` and ``x-api-key``."""
    return head("/v1/messages", length, "anthropic-version: 2023-06-01\r\nx-api-key: sk-ant-test\r\n" + extra)


def document_of(reply: bytes) -> dict:
    return json.loads(reply.partition(b"\r\n\r\n")[2])


def anthropic_error(message: str, code: str) -> dict:
    """Anthropic's error document for a 4xx (https://docs.anthropic.com/en/api/errors, 2026-12-02)."""
    return {"type": "error", "error": {"type": "invalid_request_error", "message": message, "param": None, "code": code}}


def test_head_refusals_answer_an_anthropic_client_in_anthropic_s_shape(start_proxy):
    """408 and 431 come before the app, and were in OpenAI's shape whoever asked; the Anthropic SDK reads
    ``{"type": "error", "error": {...}}``."""
    proxy = start_proxy(server={"max_header_kib": 8, "header_timeout_s": 0.5})
    with socket.create_connection(address(proxy.url)) as sock:  # a whole head over the limit
        sock.sendall(anthropic_head(2, "x-padding: " + "p" * 9000 + "\r\n"))
        reply, closed = read_reply(sock)
    assert status_of(reply) == 431 and closed
    assert document_of(reply) == anthropic_error(
        "The request head is larger than server.max_header_kib allows.", "request_header_too_large"
    )
    with socket.create_connection(address(proxy.url)) as sock:  # a head that never ends
        sock.sendall(anthropic_head(2)[:-2] + b"x-endless: " + b"e" * 20_000)
        reply, closed = read_reply(sock)
    assert status_of(reply) == 431 and closed
    document = document_of(reply)
    assert document["type"] == "error" and document["error"]["code"] == "request_header_too_large"
    with socket.create_connection(address(proxy.url)) as sock:  # a head whose blank line never comes
        sock.sendall(anthropic_head(10)[:-2])
        reply, closed = read_reply(sock)
    assert status_of(reply) == 408 and closed
    assert document_of(reply) == anthropic_error(
        "The request head did not arrive within 0.5 s (server.header_timeout_s).", "request_timeout"
    )
    assert proxy.rows() == []  # no request ever arrived


def test_idle_keep_alive_connections_close_and_crlf_trickles_do_not_keep_them(start_proxy):
    proxy = start_proxy(server={"keep_alive_s": 0.4, "header_timeout_s": 0.8})
    request = b"GET /healthz HTTP/1.1\r\nhost: tokenward\r\n\r\n"
    with socket.create_connection(address(proxy.url)) as sock:
        sock.sendall(request)
        sock.settimeout(5)
        assert status_of(sock.recv(65536)) == 200
        started = time.monotonic()
        reply, closed = read_reply(sock, timeout=5)
        assert closed and reply == b"" and 0.3 < time.monotonic() - started < 2
    with socket.create_connection(address(proxy.url)) as sock:
        sock.sendall(request)
        sock.settimeout(5)
        assert status_of(sock.recv(65536)) == 200
        started = time.monotonic()
        trickle(sock, b"\r\n" * 40, 0.1, started + 4)  # resets uvicorn's keep-alive timer each time
        reply, closed = read_reply(sock, timeout=5)
        assert closed and time.monotonic() - started < 3


def test_connections_beyond_the_limit_get_503(start_proxy):
    proxy = start_proxy(server={"max_connections": 2, "header_timeout_s": 5})
    first = socket.create_connection(address(proxy.url))
    second = socket.create_connection(address(proxy.url))
    try:
        # the proxy counts the two once its loop has accepted them: ask until it has (not a fixed 0.2 s)
        deadline = time.monotonic() + 10
        while True:
            with socket.create_connection(address(proxy.url)) as third:
                third.sendall(b"GET /healthz HTTP/1.1\r\nhost: tokenward\r\nconnection: close\r\n\r\n")
                reply, _ = read_reply(third, timeout=5)
            if status_of(reply) == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status_of(reply) == 503
        # was uvicorn's text/plain "Service Unavailable": now an error document an SDK can read
        assert error_of(reply) == {
            "message": "tokenward has as many connections open as server.max_connections allows: try again shortly.",
            "type": "server_error",
            "param": None,
            "code": "too_many_connections",
        }
        with socket.create_connection(address(proxy.url)) as third:  # an Anthropic client: Anthropic's shape
            third.sendall(b"GET /v1/messages HTTP/1.1\r\nhost: tokenward\r\nconnection: close\r\n\r\n")
            reply, _ = read_reply(third, timeout=5)
        assert status_of(reply) == 503 and document_of(reply)["error"]["type"] == "api_error"
    finally:
        first.close()
        second.close()
    deadline = time.monotonic() + 10  # served again once the proxy has seen the two close
    while (status := httpx.get(f"{proxy.url}/healthz").status_code) != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status == 200


# --- a real `tokenward serve`: memory of a maximum-size body, escaped log lines --------------------


def memory_mib(pid: int) -> tuple[float, float]:
    """Resident and peak resident memory of a process, in MiB (Linux /proc)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


@pytest.fixture
def served(tmp_path, simulator):
    """``tokenward serve`` in its own process, with a blocking budget and the access log on."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to read peak memory")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "tokenward.yaml"
    config.write_text(
        f"""
server: {{port: {port}}}
ledger: {{path: ledger.duckdb, flush_interval_s: 0.05}}
upstreams: [{{name: openai, base_url: "{simulator.url}/openai/v1", provider: openai, default: true}}]
budgets: [{{name: all, limit_usd: 100000, period: month, action: block}}]
"""
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenward.proxy", "serve", "--config", str(config), "--access-log"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # uvicorn's access log goes to stdout
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, "proxy did not start"
        time.sleep(0.1)
    yield url, process
    if process.poll() is None:
        process.terminate()
        process.communicate(timeout=30)


def test_a_maximum_size_body_costs_at_most_three_times_its_size(served):
    url, process = served
    with httpx.Client(timeout=120) as client:
        assert (
            client.post(f"{url}/v1/chat/completions", json=CHAT_BODY, headers={RECORD_HEADER: CHAT}).status_code == 200
        )
        words = "lorem ipsum dolor sit amet, consectetur adipiscing elit. "
        text = (words * (32 * MIB // len(words)))[: 32 * MIB - 200]
        body = json.dumps({"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": text}]})
        assert 32 * MIB - 200 < len(body) <= 32 * MIB  # just under server.max_body_mib's default
        Path(f"/proc/{process.pid}/clear_refs").write_text("5")  # restart the peak from the current size
        before, _ = memory_mib(process.pid)
        reply = client.post(f"{url}/v1/chat/completions", content=body, headers={RECORD_HEADER: CHAT})
        _, peak = memory_mib(process.pid)
    assert reply.status_code == 200
    grew = peak - before
    print(f"peak RSS grew {grew:.0f} MiB for a {len(body) / MIB:.0f} MiB body")
    assert grew <= 3 * len(body) / MIB  # the bound the issue asks for; measured ~2x (bench_body_memory.py)


def dense(values: bytes, size: int) -> bytes:
    """A chat body of about ``size`` bytes whose member ``x`` is a list of ``values`` repeated."""
    head = b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "x": ['
    count = (size - len(head) - 2) // (len(values) + 1)
    return head + b",".join([values] * count) + b"]}"


def test_the_decoded_size_of_a_body_is_estimated_on_the_high_side():
    # 10,000 empty objects with commas: 30,000 - 1 bytes; each dict 232 and each comma 8 on top of the bytes
    body = b",".join([b"{}"] * 10_000)
    assert decoded_size(body) == len(body) + 10_000 * 232 + 9_999 * 8
    assert decoded_size(b'["ab","cd"]') == 11 + 72 + 4 * 29 + 8


def test_a_maximum_size_body_of_tiny_values_is_413_and_costs_little(served, tmp_path):
    url, process = served
    empty_objects = dense(b"{}", 32 * MIB - 100)  # 11M dicts: ~2.5 GB once decoded
    short_strings = dense(b'"ab"', 32 * MIB - 100)  # 6.7M strings: ~390 MB
    tokens = b'{"model": "text-embedding-3-small", "input": [' + b",".join([b"12345"] * 1_000_000) + b"]}"
    with httpx.Client(timeout=120) as client:
        Path(f"/proc/{process.pid}/clear_refs").write_text("5")
        before, _ = memory_mib(process.pid)
        replies = [
            client.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            for body in (empty_objects, short_strings)
        ]
        _, peak = memory_mib(process.pid)
        embedding = client.post(f"{url}/v1/embeddings", content=tokens, headers={"content-type": "application/json"})
    assert [r.status_code for r in replies] == [413, 413]
    assert {r.json()["error"]["code"] for r in replies} == {"request_too_complex"}
    assert peak - before <= 3 * 32  # before: +801 MiB for the empty objects, +456 for the strings
    # a 6 MB embeddings request of a million token ids (~40 MB decoded) is not refused as too complex
    assert embedding.json().get("error", {}).get("code") != "request_too_complex"
    assert len(tokens) > 1 * MIB


LOGGING_AS_SERVE = """
import logging
from litestar import Litestar
from tokenward.proxy.server import _uvicorn_config
from tokenward.reports.sanitize import escape_log_lines
logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")  # as `tokenward serve`
_uvicorn_config(Litestar([]), "127.0.0.1", 0, "info", True)  # uvicorn's own handlers, as `run` builds them
escape_log_lines()
logging.getLogger("tokenward.proxy").warning("model %s refused", "gpt\\r\\nFORGED root line")
logging.getLogger("uvicorn.error").warning("client said %s", "hi\\nFORGED uvicorn line\\u202e")
logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "1.2.3.4:5", "GET", "/x\\r\\nFORGED access", "1.1", 200)
"""


def test_log_lines_escape_control_characters_from_clients():
    done = subprocess.run([sys.executable, "-c", LOGGING_AS_SERVE], capture_output=True, text=True, timeout=60)
    lines = (done.stdout + done.stderr).splitlines()
    assert len(lines) == 3 and all(line.startswith(("WARNING", "INFO")) for line in lines), lines  # no forged line
    assert any(line.endswith("model gpt\\x0d\\x0aFORGED root line refused") for line in lines), lines
    assert any(line.endswith("client said hi\\x0aFORGED uvicorn line\\u202e") for line in lines), lines
    assert any('"GET /x\\x0d\\x0aFORGED access HTTP/1.1" 200' in line for line in lines), lines


def test_limits_are_validated_where_they_are_configured(tmp_path):
    from tokenward.proxy.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("upstreams: [{name: u, base_url: 'http://127.0.0.1:1/v1'}]\nserver: {max_body_mib: 0}\n")
    with pytest.raises(ConfigError, match=r"server\.max_body_mib"):
        load_config(path)
    path.write_text("upstreams: [{name: u, base_url: 'http://127.0.0.1:1/v1'}]\nserver: {max_connections: 0}\n")
    with pytest.raises(ConfigError, match=r"server\.max_connections"):
        load_config(path)


def test_the_dashboard_login_form_is_held_to_a_small_body_and_the_body_timeout(start_proxy):
    """Anyone may post the login form: a large or slow body there is refused like one to /v1 (was: read whole)."""
    proxy = start_proxy(server={"body_timeout_s": 0.5, "body_min_kib_s": 64})
    form = {"content-type": "application/x-www-form-urlencoded"}
    declared = httpx.post(f"{proxy.url}/dashboard/login", content=b"token=" + b"a" * 20_000, headers=form)
    assert (declared.status_code, declared.json()["error"]["code"]) == (413, "request_too_large")
    chunked = httpx.post(f"{proxy.url}/dashboard/login", content=iter([b"token=", b"a" * 10_000, b"a" * 10_000]))
    assert (chunked.status_code, chunked.json()["error"]["code"]) == (413, "request_too_large")
    wrong = httpx.post(f"{proxy.url}/dashboard/login", data={"token": "not-an-admin-key"})
    assert wrong.status_code == 401 and "That is not an admin credential." in wrong.text
    with socket.create_connection(address(proxy.url)) as sock:
        lines = ["POST /dashboard/login HTTP/1.1", "host: tokenward", f"content-type: {form['content-type']}"]
        sock.sendall(("\r\n".join([*lines, "content-length: 100"]) + "\r\n\r\n").encode())
        started = time.monotonic()
        trickle(sock, b"token=" + b"a" * 94, 0.05, started + 3)
        reply, closed = read_reply(sock)
        took = time.monotonic() - started
    assert status_of(reply) == 408 and closed and error_of(reply)["code"] == "request_timeout"
    assert 0.5 <= took < 2.5


def test_a_request_watches_its_connection_without_a_task_and_hears_it_close():
    import threading

    import uvicorn

    from tokenward.proxy.config import ServerConfig
    from tokenward.proxy.limits import CONNECTION_SCOPE_KEY, uvicorn_options
    from tokenward.proxy.relay import DisconnectWatch

    watching, finished = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    async def app(scope, receive, send):
        more = True
        while more:  # the whole body first, as the forwarder reads it before it watches
            more = (await receive()).get("more_body", False)
        before = len(asyncio.all_tasks())
        watch = DisconnectWatch(receive, scope.get(CONNECTION_SCOPE_KEY))
        fallback = DisconnectWatch(receive)  # what another ASGI server gets: a task waiting in receive()
        seen["tasks added"] = len(asyncio.all_tasks()) - before
        fallback.close()
        seen["gone while connected"] = watch.gone()
        watching.set()
        seen["pending"] = await asyncio.wait_for(asyncio.shield(watch.pending), 5)
        seen["gone after"] = watch.gone()
        watch.close()
        finished.set()

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_level="warning", **uvicorn_options(ServerConfig()))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        client = socket.create_connection(("127.0.0.1", port), timeout=10)
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        assert watching.wait(10)
        client.close()  # the client leaves before any reply
        assert finished.wait(10)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    # the connection's own watch adds no task (the fallback adds its one); the close resolves it
    assert seen == {
        "tasks added": 1,
        "gone while connected": False,
        "pending": {"type": "http.disconnect"},
        "gone after": True,
    }


FREED_BUT_KEPT = """
import re
from tokenward.proxy.limits import give_back_free_memory

def private_mb():
    return int(re.search(r"RssAnon:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) // 1024

blocks = [bytes(1000) + bytes([i % 256]) for i in range(40_000)]  # 40 MB of 1 KB blocks from glibc's heap
keep = blocks[-1]
del blocks  # freed, but the last block pins the heap's top: glibc keeps the pages without a trim
before = private_mb()
print(give_back_free_memory(), before - private_mb())
"""


def test_free_memory_is_given_back_to_the_os():
    """What start-up frees (the catalog's YAML, ~1.5 MB) glibc keeps until ``malloc_trim``; the serving app calls it."""
    found = subprocess.run([sys.executable, "-c", FREED_BUT_KEPT], capture_output=True, text=True, check=True)
    trimmed, released_mb = found.stdout.split()
    assert trimmed == "True" and int(released_mb) >= 35
