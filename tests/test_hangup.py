"""SIGHUP, which operators send to reload a config, neither kills a running proxy nor cuts its streams."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from decimal import Decimal

import anthropic
import httpx
import openai

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


def test_a_stream_still_open_when_the_stop_grace_runs_out_is_recorded_interrupted(start_proxy):
    # SIGTERM waits server.shutdown_grace_s (30 s) for requests in flight, then cancels them; such a row
    # said `proxy_error` ("relay failed: CancelledError"), as if tokenward had a bug, instead of `interrupted`
    proxy = start_proxy(server={"shutdown_grace_s": 0.5})
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


def test_a_request_still_at_the_upstream_when_the_stop_grace_runs_out_gets_a_json_503_in_its_dialect(
    start_proxy, simulator
):
    # before: the grace was a constant 30 s, and a request cancelled at its end got uvicorn's
    # plain-text 500 "Internal Server Error" (which no SDK can read); its row was right already
    proxy = start_proxy(server={"shutdown_grace_s": 0.5})
    errors: dict[str, Exception] = {}
    markers = {"openai": uuid.uuid4().hex, "anthropic": uuid.uuid4().hex}

    def ask_openai() -> None:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-client", max_retries=0, timeout=60)
        headers = {FAULT_HEADER: "wait:20000", "x-hangup-test": markers["openai"]}
        try:
            client.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=5, extra_headers=headers
            )
        except Exception as exc:
            errors["openai"] = exc

    def ask_anthropic() -> None:
        client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-client", max_retries=0, timeout=60)
        headers = {FAULT_HEADER: "wait:20000", "x-hangup-test": markers["anthropic"]}
        try:
            client.messages.create(
                model="claude-sonnet-4-5", max_tokens=5, messages=[{"role": "user", "content": "hi"}], extra_headers=headers
            )
        except Exception as exc:
            errors["anthropic"] = exc

    clients = [threading.Thread(target=ask_openai), threading.Thread(target=ask_anthropic)]
    for client in clients:
        client.start()
    deadline = time.monotonic() + 30
    # both at the simulator now, which holds them 20 s
    while not set(markers.values()) <= {r["headers"].get("x-hangup-test") for r in list(simulator.simulator.requests)}:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    stopped = time.monotonic()
    start_proxy.stop_all()
    for client in clients:
        client.join(30)
    assert time.monotonic() - stopped < 10  # the configured 0.5 s grace, not 30 s nor the upstream's 20 s
    said = (
        "tokenward shut down before the upstream's reply arrived (the stop's grace period, "
        "server.shutdown_grace_s, ran out); the provider may still bill this request."
    )
    oai = errors["openai"]
    assert isinstance(oai, openai.InternalServerError) and oai.status_code == 503
    assert oai.response.headers["content-type"] == "application/json"
    assert oai.body == {"message": said, "type": "server_error", "param": None, "code": "shutting_down"}
    ant = errors["anthropic"]
    assert isinstance(ant, anthropic.InternalServerError) and ant.status_code == 503
    assert ant.body == {
        "type": "error",
        "error": {"type": "api_error", "message": said, "param": None, "code": "shutting_down"},
    }
    rows = sorted(read_rows(proxy.ledger), key=lambda r: r["endpoint"])
    assert [(r["endpoint"], r["outcome"], r["price_status"]) for r in rows] == [
        ("anthropic_messages", "interrupted", "usage_unknown"),
        ("chat_completions", "interrupted", "usage_unknown"),
    ], [r["error"] for r in rows]
    assert all(r["error"].startswith("tokenward shut down while the request was in flight") for r in rows)
