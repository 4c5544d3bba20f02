"""kill -9, then a restart: while a reader (``tokenward report``, ``top``, a notebook) holds the DuckDB file, and with an alert not yet sent.

Real processes: a counting upstream (in this process), ``tokenward serve`` killed with SIGKILL, and a
second process holding the ledger file read-only across the restart, as a report does.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import threading
import time
from decimal import Decimal

import httpx

from .crashkit import COMPLETION_TOKENS, PROMPT_TOKENS, CountingUpstream, ProxyProcess, ledger_rows
from .test_alerts import smtp  # noqa: F401 - the fixture
from .test_crash import free_port

# gpt-4o-mini at openai: 8 tokens in at $0.15, 5 out at $0.60 per 1M = $0.0000042 a request
COST = (PROMPT_TOKENS * Decimal("0.15") + COMPLETION_TOKENS * Decimal("0.60")) / 1_000_000

# flush_interval_s 60: every row of this run is still in the write-ahead log at the kill
CONFIG = """upstreams:
  - {{name: openai, base_url: '{url}', default: true, provider: openai}}
server: {{port: {port}, drain_after_disconnect_s: 0}}
ledger: {{path: ledger.duckdb, flush_interval_s: 60}}
budgets:
  - {{name: cap, limit_usd: 0.01, period: total, action: block}}
guard: {{default_max_output_tokens: 5}}
"""
HOLD = (
    "import duckdb, sys\n"
    "conn = duckdb.connect(sys.argv[1], read_only=True)\n"
    "print(conn.execute('SELECT count(*) FROM requests').fetchone()[0], flush=True)\n"
    "sys.stdin.read()\n"  # held until the test closes stdin
)


def _chat(url: str, request_id: str, *, stream: bool, wait: float | None = None) -> httpx.Response:
    headers = {"authorization": "Bearer sk-client", "x-request-id": request_id}
    if wait is not None:
        headers["x-test-wait"] = str(wait)
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def _left_at_the_kill(url: str, request_id: str) -> None:
    try:
        _chat(url, request_id, stream=False, wait=30)
    except httpx.HTTPError:  # the proxy is killed with this request at the upstream
        pass


def _spent(url: str) -> Decimal:
    answer = httpx.get(f"{url}/v1/tokenward/budget", headers={"authorization": "Bearer sk-client"}, timeout=10)
    assert answer.status_code == 200, answer.text
    (cap,) = [b for b in answer.json()["budgets"] if b["name"] == "cap"]
    assert cap["held_usd"] == "0"
    return Decimal(cap["spent_usd"])


def test_a_restart_after_kill_while_a_reader_holds_the_file_counts_every_logged_row(tmp_path):
    """Six requests end and two are at the upstream when the proxy is killed; all eight rows are in its log only.

    A reader holds the file through the restart, so the log cannot be moved in: the proxy must still
    start (the file's schema is current) and its books must count the log: 6 x $0.0000042 plus the
    worst case each request at the upstream held (its ``usage_unknown`` row). Before, the restart
    waited 10 s for the reader and gave up (exit 1); a reader arriving after that check made the
    books fail on the log's decimal strings (``Decimal + str``) and the proxy exit.
    """
    port = free_port()
    config = tmp_path / "tokenward.yaml"
    with CountingUpstream(wait_s=0.01) as upstream:
        config.write_text(CONFIG.format(url=upstream.url, port=port))
        proxy = ProxyProcess(config, port).start()
        for number in range(6):
            reply = _chat(proxy.url, f"done-{number}", stream=number % 2 == 1)
            assert reply.status_code == 200, reply.text
        at_upstream = [f"held-{n}" for n in range(2)]
        clients = [threading.Thread(target=_left_at_the_kill, args=(proxy.url, rid)) for rid in at_upstream]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 20
        while not set(at_upstream) <= set(upstream.received) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(at_upstream) <= set(upstream.received)
        proxy.kill()
        reader = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(tmp_path / "ledger.duckdb")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        try:
            assert reader.stdout is not None and reader.stdout.readline().strip() == "0"  # nothing moved in yet
            proxy.start()  # before, it waited 10 s for the reader and exited 1
            spent_after_restart = _spent(proxy.url)
        finally:
            reader.communicate("", timeout=30)
        proxy.stop()  # graceful: the log goes into the file now that the reader is gone
        for client in clients:
            client.join(60)
    rows = ledger_rows(tmp_path / "ledger.duckdb")
    by_client = collections.Counter(r["client_request_id"] for r in rows)
    assert by_client == collections.Counter([f"done-{n}" for n in range(6)] + at_upstream)  # one row each
    held = [r for r in rows if r["client_request_id"] in at_upstream]
    assert {(r["outcome"], r["price_status"], r["cost_usd"]) for r in held} == {("interrupted", "usage_unknown", None)}
    assert all(r["reserved_usd"] > 0 for r in held)
    done = [r for r in rows if r["client_request_id"].startswith("done-")]
    assert {r["cost_usd"] for r in done} == {COST}
    assert spent_after_restart == 6 * COST + sum(r["reserved_usd"] for r in held)


UNPRICED = """upstreams:
  - {{name: openai, base_url: '{url}', default: true, provider: openai}}
server: {{port: {port}, drain_after_disconnect_s: 0}}
ledger: {{path: ledger.duckdb, flush_interval_s: 1.0}}
alerts:
  evaluate_every_s: {every}
  admins: [ops@example.com]
  retries: 1
  smtp: {{host: 127.0.0.1, port: {smtp}, security: none, sender: tokenward@test}}
"""


def _unpriced_subjects(inbox, count: int) -> list[str]:
    return sorted(str(m["Subject"]) for m in inbox.wait_for(count, timeout=30))


def test_a_model_without_a_price_seen_just_before_a_kill_is_still_mailed_to_the_admins_once(tmp_path, smtp):  # noqa: F811
    """One request for a model with no price, then SIGKILL before the first check (60 s after start).

    The restarted proxy (checking every second) must mail the admins about that model: its row is
    in the ledger (or the log), though this process never saw the model. Before, the proxy's
    checks knew only the models this process had recorded, and the mail was never sent. Then a
    second restart and a second such model: one mail more, the first not sent again.
    """
    inbox, smtp_port = smtp
    port = free_port()
    config = tmp_path / "tokenward.yaml"
    with CountingUpstream(wait_s=0.01) as upstream:
        config.write_text(UNPRICED.format(url=upstream.url, port=port, every=60, smtp=smtp_port))
        proxy = ProxyProcess(config, port).start()
        body = {"model": "mystery-model-1", "messages": [{"role": "user", "content": "hi"}]}
        reply = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers={"authorization": "Bearer sk"})
        assert reply.status_code == 200, reply.text
        proxy.kill()  # its first check was 60 s away
        assert inbox.messages == []
        config.write_text(UNPRICED.format(url=upstream.url, port=port, every=1, smtp=smtp_port))
        proxy.start()
        try:
            assert _unpriced_subjects(inbox, 1) == [
                "[tokenward] no price for model mystery-model-1 (openai): 1 request(s) recorded without a cost"
            ]
            proxy.stop()
            proxy.start()
            body["model"] = "mystery-model-2"
            reply = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers={"authorization": "Bearer sk"})
            assert reply.status_code == 200, reply.text
            subjects = _unpriced_subjects(inbox, 2)
        finally:
            proxy.stop()
    assert len(inbox.messages) == 2 and [s.split(" (")[0] for s in subjects] == [
        "[tokenward] no price for model mystery-model-1",
        "[tokenward] no price for model mystery-model-2",
    ]
