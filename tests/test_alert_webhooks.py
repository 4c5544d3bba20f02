"""Webhooks to real HTTP receivers: a signature the receiver can check by the README's steps, redirects not followed."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tokenward.pricing.settings import BudgetSettings
from tokenward.reports.alerts import AlertSettings, WebhookSettings

from .test_alerts import cost_row, run_check, seed

SECRET = "whsec-test-0123456789"
README = Path(__file__).resolve().parents[1] / "README.md"


class Receiver:
    """A real HTTP server in a thread: keeps every request (headers, exact body) and answers ``status``."""

    def __init__(self, status: int = 200, location: str | None = None) -> None:
        self.requests: list[tuple[dict[str, str], bytes, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's hook name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                owner.requests.append(({k.lower(): v for k, v in self.headers.items()}, body, self.path))
                self.send_response(status)
                if location is not None:
                    self.send_header("location", location)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


def _budget():
    return BudgetSettings(name="hooked", limit_usd=10, period="total", thresholds=[50], notify=["ops"]).to_budget()


def _readme_verify():
    """The README's steps, as the README writes them: how a receiver checks a webhook came from tokenward."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    (steps,) = [b for b in blocks if "def verify(" in b]
    space: dict = {}
    exec(steps, space)  # noqa: S102 - the README's own code
    return space["verify"]


verify = _readme_verify()


def test_a_signed_webhook_is_verifiable_by_the_documented_steps(tmp_path, receiver, monkeypatch):
    """Before, a webhook carried no signature: a receiver could not tell tokenward's alert from anyone's post."""
    monkeypatch.setenv("TW_HOOK_SECRET", SECRET)
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "6")])
    hook = WebhookSettings(name="ops", url=f"{receiver.url}/hook", secret_env="TW_HOOK_SECRET")
    settings = AlertSettings(webhooks=[hook], retries=0)
    before = time.time()
    sent = run_check(path, [_budget()], settings, "2026-11-10T10:00:00+00:00")
    assert [(d.target, d.ok) for _, deliveries in sent for d in deliveries] == [("ops", True)]
    [(headers, body, where)] = receiver.requests
    assert where == "/hook" and headers["content-type"] == "application/json"
    assert verify(SECRET, headers, body, now=time.time())
    assert before - 1 <= int(headers["x-tokenward-timestamp"]) <= time.time() + 1
    figures = json.loads(body)["tokenward"]
    assert (figures["budget"], figures["spent_usd"], figures["limit_usd"]) == ("hooked", "6", "10")
    # a changed byte, another secret, or a replay from long ago fail the same check
    assert not verify(SECRET, headers, body.replace(b'"6"', b'"0"'), now=time.time())
    assert not verify("another-secret", headers, body, now=time.time())
    assert not verify(SECRET, headers, body, now=time.time() + 3600)


def test_a_webhook_whose_secret_is_not_set_is_not_sent_unsigned(tmp_path, receiver, monkeypatch):
    monkeypatch.delenv("TW_HOOK_SECRET", raising=False)
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "6")])
    hook = WebhookSettings(name="ops", url=f"{receiver.url}/hook", secret_env="TW_HOOK_SECRET")
    sent = run_check(path, [_budget()], AlertSettings(webhooks=[hook], retries=0), "2026-11-10T10:00:00+00:00")
    [(_, [delivery])] = sent
    assert not delivery.ok and "TW_HOOK_SECRET" in delivery.error
    assert receiver.requests == []


def test_a_receiver_that_redirects_to_an_internal_address_is_not_followed(tmp_path):
    """A 307 to another host (here a loopback port standing for an internal service) is a failure, not a hop."""
    internal = Receiver()
    redirecting = Receiver(status=307, location=f"{internal.url}/admin/delete-everything")
    try:
        path = tmp_path / "l.duckdb"
        seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "6")])
        hook = WebhookSettings(name="ops", url=f"{redirecting.url}/hook")
        settings = AlertSettings(webhooks=[hook], retries=1, backoff_s=0.01)
        [(_, [delivery])] = run_check(path, [_budget()], settings, "2026-11-10T10:00:00+00:00")
        assert not delivery.ok and delivery.attempts == 2 and "307" in delivery.error
        assert len(redirecting.requests) == 2 and internal.requests == []
    finally:
        internal.close()
        redirecting.close()
