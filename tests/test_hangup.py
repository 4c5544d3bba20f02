"""SIGHUP, which operators send to reload a config, neither kills a running proxy nor cuts its streams."""

from __future__ import annotations

import signal
import threading
import time
from decimal import Decimal

import httpx

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
