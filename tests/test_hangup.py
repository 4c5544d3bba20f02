"""SIGHUP, which operators send to reload a config, neither kills a running proxy nor cuts its streams."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from decimal import Decimal

import httpx

from tokenward.proxy import server
from tokenward.proxy.simulator import FAULT_HEADER

from .conftest import read_rows
from .crashkit import CountingUpstream, ProxyProcess, free_port, ledger_rows, write_config

# crashkit's upstream bills 8 input and 5 output tokens; gpt-4o-mini lists $0.15 and $0.60 per 1M:
# 8 * 0.15 / 1e6 + 5 * 0.60 / 1e6 = 0.0000012 + 0.000003
COST = Decimal("0.0000042")


def test_sighup_is_logged_and_ignored_while_a_stream_is_open(tmp_path):
    port = free_port()
    with CountingUpstream() as upstream:
        proxy = ProxyProcess(write_config(tmp_path, upstream.url, port), port).start()
        try:
            replies: list[httpx.Response] = []
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            headers = {"authorization": "Bearer sk-client", "x-test-wait": "1.5", "x-request-id": "held"}

            def stream() -> None:
                replies.append(httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers=headers, timeout=30))

            client = threading.Thread(target=stream)
            client.start()
            deadline = time.monotonic() + 20
            while "held" not in upstream.received:  # the stream is at the upstream now
                assert time.monotonic() < deadline, proxy.log()
                time.sleep(0.02)
            assert proxy.process is not None
            proxy.process.send_signal(signal.SIGHUP)  # before: the process died here, the stream cut
            client.join(30)
            assert proxy.process.poll() is None, proxy.log()
            assert replies[0].status_code == 200 and replies[0].text.endswith("data: [DONE]\n\n")
            assert "SIGHUP received and ignored: tokenward does not reload its configuration" in proxy.log()
            after = httpx.post(
                f"{proxy.url}/v1/chat/completions",
                json={**body, "stream": False},
                headers={"authorization": "Bearer sk-client"},
            )
            assert after.status_code == 200
        finally:
            proxy.stop()
    rows = ledger_rows(tmp_path / "ledger.duckdb")
    assert sorted((r["outcome"], r["stream"], r["input_tokens"], r["output_tokens"]) for r in rows) == [
        ("ok", False, 8, 5),
        ("ok", True, 8, 5),
    ]
    assert [r["cost_usd"] for r in rows] == [COST, COST]


def test_a_stream_still_open_when_the_stop_grace_runs_out_is_recorded_interrupted(start_proxy, monkeypatch):
    # SIGTERM waits SHUTDOWN_GRACE_S (30 s) for requests in flight, then cancels them; such a row said
    # `proxy_error` ("relay failed: CancelledError"), as if tokenward had a bug, instead of `interrupted`
    monkeypatch.setattr(server, "SHUTDOWN_GRACE_S", 0.5)
    proxy = start_proxy()
    events: list[bytes] = []
    cut: list[BaseException] = []
    first = threading.Event()

    def stream() -> None:
        body = {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 40,
            "stream": True,
        }
        headers = {"authorization": "Bearer sk-client", FAULT_HEADER: "delay:400"}
        try:
            with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.encode())
                        first.set()
        except httpx.HTTPError as exc:
            cut.append(exc)

    client = threading.Thread(target=stream)
    client.start()
    assert first.wait(30)
    start_proxy.stop_all()  # what SIGTERM does: uvicorn's graceful stop, then the lifespan's flush
    client.join(30)
    assert cut and b"[DONE]" not in b"".join(events)  # the client saw the stream cut
    [row] = read_rows(proxy.ledger)
    assert row["outcome"] == "interrupted" and row["usage_source"] == "partial"
    assert row["error"].startswith("tokenward shut down while the reply was being relayed")
    # "hi" is 8 tokens; the output seen so far is estimated: gpt-4o-mini at $0.15 and $0.60 per 1M
    assert row["input_tokens"] == 8 and 0 < row["output_tokens"] < 40
    assert row["cost_usd"] == (8 * Decimal("0.15") + row["output_tokens"] * Decimal("0.60")) / 10**6


def test_a_request_still_at_the_upstream_when_the_stop_grace_runs_out_is_recorded_interrupted(
    start_proxy, simulator, monkeypatch
):
    monkeypatch.setattr(server, "SHUTDOWN_GRACE_S", 0.5)
    proxy = start_proxy()

    def ask() -> None:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        headers = {"authorization": "Bearer sk-client", FAULT_HEADER: "wait:20000", "x-hangup-test": marker}
        # the client gets uvicorn's plain-text 500 (the request was cancelled before any reply)
        httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers=headers, timeout=60)

    marker = uuid.uuid4().hex  # the simulator keeps its last 1,000 requests: their count stops growing
    client = threading.Thread(target=ask)
    client.start()
    deadline = time.monotonic() + 30
    # at the simulator now, which holds it 20 s
    while not any(r["headers"].get("x-hangup-test") == marker for r in list(simulator.simulator.requests)):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    start_proxy.stop_all()
    client.join(30)
    [row] = read_rows(proxy.ledger)
    assert (row["outcome"], row["price_status"]) == ("interrupted", "usage_unknown"), row["error"]
    assert row["error"].startswith("tokenward shut down while the request was in flight")
