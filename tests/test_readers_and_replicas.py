"""What a reader of the DuckDB file cannot delay, and what a second proxy on it may not do.

Real processes: ``tokenward serve`` subprocesses, a reader holding the ledger open read-only in
another process, a counting upstream, a real SMTP server.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
from click.testing import CliRunner

from tokenward.proxy.cli import main

from .crashkit import CountingUpstream, ProxyProcess, write_config
from .test_alerts import free_port

HOLDER = """
import duckdb, sys, time
deadline = time.monotonic() + 30
while True:  # as any reader must: the proxy holds the file for the few ms of each move of its log
    try:
        conn = duckdb.connect(sys.argv[1], read_only=True)
        break
    except duckdb.IOException:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
conn.execute("SELECT count(*) FROM requests").fetchall()
print("holding", flush=True)
sys.stdin.readline()
"""


class Reader:
    """Another process holding the ledger open read-only (a notebook, a long report) until closed."""

    def __init__(self, path: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "holding":
            self.process.kill()
            self.process.communicate(timeout=10)
            raise AssertionError("the reader could not open the ledger")

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.close()
        self.process.wait(10)
        assert self.process.stdout is not None
        self.process.stdout.close()


def chat(url: str, key: str) -> httpx.Response:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=10)


KEYS = """
auth: {mode: virtual_keys}
virtual_keys:
  - {name: from-config, key: tw-config-key-0001}
"""


def test_revocation_takes_effect_within_seconds_while_a_reader_holds_the_ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("UPSTREAM_KEY", "sk-upstream")
    port = free_port()
    with CountingUpstream() as upstream:
        config = write_config(tmp_path, upstream.url, port, KEYS)
        text = config.read_text().replace("provider: openai}", "provider: openai, api_key_env: UPSTREAM_KEY}")
        config.write_text(text)
        proxy = ProxyProcess(config, port).start()
        try:
            created = CliRunner().invoke(main, ["keys", "create", "stored", "--config", str(config)])
            stored = created.output.splitlines()[0]
            deadline = time.monotonic() + 10
            while chat(proxy.url, stored).status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert chat(proxy.url, stored).status_code == 200
            assert chat(proxy.url, "tw-config-key-0001").status_code == 200
            reader = Reader(tmp_path / "ledger.duckdb")  # from now on no process can write the DuckDB file
            try:
                for name in ("stored", "from-config"):
                    result = CliRunner().invoke(main, ["keys", "revoke", name, "--config", str(config)])
                    assert result.exit_code == 0, result.output
                revoked_at = time.monotonic()
                while time.monotonic() - revoked_at < 30:
                    if chat(proxy.url, stored).status_code == 401 and chat(proxy.url, "tw-config-key-0001").status_code == 401:
                        break
                    time.sleep(0.2)
                took = time.monotonic() - revoked_at
                assert chat(proxy.url, stored).json()["error"]["code"] == "invalid_api_key"
                assert chat(proxy.url, "tw-config-key-0001").status_code == 401
                assert took < 10, took  # the proxy reloads keys every 5 s from the state store
            finally:
                reader.close()
        finally:
            proxy.stop()


BLOCKING = """
budgets:
  - {name: cap, limit_usd: 1, period: day, action: block}
"""


def test_a_second_proxy_with_blocking_budgets_on_one_duckdb_ledger_refuses_to_start(tmp_path):
    first_port, second_port = free_port(), free_port()
    config = write_config(tmp_path, "http://127.0.0.1:9/v1", first_port, BLOCKING)
    first = ProxyProcess(config, first_port).start()
    try:
        second = subprocess.run(
            [str(Path(sys.executable).parent / "tokenward"), "serve", "--config", str(config), "--port", str(second_port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 1
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert lines[-1].startswith("Error: another tokenward proxy (pid ")
        assert "give all replicas a shared Postgres ledger (ledger.url)" in lines[-1]
        assert "Traceback" not in second.stderr
    finally:
        first.stop()
    again = ProxyProcess(config, first_port).start()  # the lock went with the first process
    again.stop()


def test_without_blocking_budgets_two_proxies_may_share_a_ledger(tmp_path):
    ports = free_port(), free_port()
    with CountingUpstream() as upstream:
        config = write_config(tmp_path, upstream.url, ports[0])
        other = tmp_path / "other.yaml"
        other.write_text(config.read_text().replace(f"port: {ports[0]}", f"port: {ports[1]}"))
        proxies = [ProxyProcess(config, ports[0]).start(), ProxyProcess(other, ports[1]).start()]
        try:
            for proxy in proxies * 5:
                assert chat(proxy.url, "sk-client").status_code == 200
        finally:
            for proxy in proxies:
                proxy.stop()
    from .crashkit import ledger_rows

    rows = ledger_rows(tmp_path / "ledger.duckdb")
    assert len(rows) == 10 and len({r["request_id"] for r in rows}) == 10
    assert {r["key_id"] for r in rows} == {"fp-" + hashlib.sha256(b"sk-client").hexdigest()[:12]}
