"""Alerts under faults: evaluators that overlap, a SIGKILL mid-delivery, receivers that hang.

Real processes (``tokenward budgets check`` as subprocesses), a real SMTP server (aiosmtpd) that
is slow or kills the sender at the worst moment, and real HTTP receivers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller

from tokenward.pricing.settings import BudgetSettings
from tokenward.reports.alerts import Alert, AlertSettings, Notifier, SmtpSettings, WebhookSettings
from tokenward.reports.ledger import DuckLedger

from .test_alerts import Inbox, cost_row, free_port, run_check, seed, settings_for, smtp  # noqa: F401 - smtp: fixture

CHECK_AT = "2026-11-10T10:00:00+00:00"


class SlowInbox(Inbox):
    """An SMTP server that takes ``delay_s`` to accept each message."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.receiving = threading.Event()

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's hook name
        self.receiving.set()
        await asyncio.sleep(self.delay_s)
        return await super().handle_DATA(server, session, envelope)


class KillingInbox(Inbox):
    """Keeps the message, then SIGKILLs the sending process before answering 250: accepted, never recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.victim: int | None = None

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's hook name
        reply = await super().handle_DATA(server, session, envelope)
        if self.victim is not None:
            os.kill(self.victim, signal.SIGKILL)
            self.victim = None
            await asyncio.sleep(0.5)  # the sender is gone before it can read the reply
        return reply


def write_config(folder: Path, smtp_port: int, *, smtp_timeout_s: float = 30, retries: int = 0) -> Path:
    """A config with one $100 total budget (thresholds 50/80/100, no forecast) mailing lead@example.com."""
    folder.mkdir(exist_ok=True)
    config = folder / "tokenward.yaml"
    config.write_text(
        'upstreams: [{name: a, base_url: "http://upstream.invalid"}]\n'
        "budgets:\n"
        "  - {name: research, limit_usd: 100, scope: {team: research}, period: total, notify: [lead@example.com]}\n"
        "alerts:\n"
        f"  retries: {retries}\n"
        "  backoff_s: 0.01\n"
        f"  smtp: {{host: 127.0.0.1, port: {smtp_port}, security: none, sender: tokenward@test, "
        f"timeout_s: {smtp_timeout_s}}}\n",
        encoding="utf-8",
    )
    return config


def check_command(config: Path, ledger: Path | str) -> list[str]:
    tokenward = str(Path(sys.executable).parent / "tokenward")
    return [tokenward, "budgets", "check", "--config", str(config), "--db", str(ledger), "--at", CHECK_AT]


def home(path: Path) -> dict[str, str]:
    return {**os.environ, "HOME": str(path)}


@pytest.mark.parametrize("engine", ["duckdb", "postgres"])
def test_two_checks_at_once_against_a_slow_mail_server_mail_each_threshold_once(engine, tmp_path, request):
    """Two evaluators (replicas, a cron'd ``budgets check``) overlap while a mail is in flight."""
    inbox = SlowInbox(delay_s=6.0)
    server = Controller(inbox, hostname="127.0.0.1", port=free_port())
    server.start()
    try:
        rows = [cost_row("a", "2026-11-10T09:00:00+00:00", "85.00")]  # 85 %: past 50 and 80
        if engine == "duckdb":
            ledger: Path | str = tmp_path / "l.duckdb"
            seed(ledger, rows)
        else:
            from .test_pg_ledger import pg

            ledger = request.getfixturevalue("pg_url")
            pg(tmp_path, ledger).write_rows(rows)
        # as on two hosts: a Postgres ledger's local files (report copy in ~/.cache, spool beside the config)
        homes = [tmp_path / "one", tmp_path / "two"]
        configs = [write_config(home_dir, server.port) for home_dir in homes]
        first = subprocess.Popen(
            check_command(configs[0], ledger), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=home(homes[0])
        )
        assert inbox.receiving.wait(30)  # the first one has claimed, and the mail server is taking its time
        second = subprocess.run(
            check_command(configs[1], ledger), capture_output=True, text=True, timeout=60, env=home(homes[1])
        )
        out, err = first.communicate(timeout=60)
        assert first.returncode == 0 and second.returncode == 0, (err, second.stderr)
        time.sleep(0.5)
        # one mail names 50 % and 80 %; the second evaluator leaves the claim in flight alone
        assert [m["Subject"] for m in inbox.messages] == [
            "[tokenward] budget research: 85.00% of $100.00 (crossed 50%, 80%)"
        ]
        assert second.stdout.strip() == "no alerts due"
        assert first.returncode == 0 and "(email lead@example.com: ok)" in out.decode()
    finally:
        server.stop()


SKEWED_CLOCK = """
import time

_real = time.time
time.time = lambda: _real() + {skew_s}  # this host's clock runs {skew_s} s ahead
"""


def test_a_replica_whose_clock_runs_ahead_does_not_take_over_a_lease_in_flight(tmp_path, request):
    """Replicas' clocks 2 minutes apart: the database's clock decides when a delivery lease runs out.

    The first evaluator leases the claim for 35 s (one attempt at the 30 s SMTP timeout, 5 s
    margin) by its own clock; a second one whose clock ran 120 s ahead took that lease for run
    out at once and mailed the same thresholds a second time.
    """
    from .test_pg_ledger import pg

    inbox = SlowInbox(delay_s=6.0)
    server = Controller(inbox, hostname="127.0.0.1", port=free_port())
    server.start()
    try:
        ledger = request.getfixturevalue("pg_url")
        pg(tmp_path, ledger).write_rows([cost_row("a", "2026-11-10T09:00:00+00:00", "85.00")])
        homes = [tmp_path / "one", tmp_path / "two"]
        configs = [write_config(home_dir, server.port) for home_dir in homes]
        skewed = tmp_path / "skewed"
        skewed.mkdir()
        (skewed / "sitecustomize.py").write_text(SKEWED_CLOCK.format(skew_s=120), encoding="utf-8")
        ahead = {**home(homes[1]), "PYTHONPATH": str(skewed)}
        probe = subprocess.run(
            [sys.executable, "-c", "import time; print(time.time())"],
            env=ahead,
            text=True,
            capture_output=True,
            check=True,
        )
        assert float(probe.stdout) - time.time() > 110  # the second replica's clock is 2 minutes ahead
        first = subprocess.Popen(
            check_command(configs[0], ledger), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=home(homes[0])
        )
        assert inbox.receiving.wait(30)  # the first replica's mail is in flight, under its lease
        second = subprocess.run(
            check_command(configs[1], ledger), capture_output=True, text=True, timeout=60, env=ahead
        )
        out, err = first.communicate(timeout=60)
        assert first.returncode == 0 and second.returncode == 0, (err, second.stderr)
        assert [m["Subject"] for m in inbox.messages] == [
            "[tokenward] budget research: 85.00% of $100.00 (crossed 50%, 80%)"
        ]
        assert second.stdout.strip() == "no alerts due"
        assert "(email lead@example.com: ok)" in out.decode()
    finally:
        server.stop()


def test_sigkill_after_the_mail_server_accepted_resends_once_with_the_same_message_id(tmp_path):
    """The README promises at least once: a crash between 250 and the record resends, once, recognisably."""
    inbox = KillingInbox()
    server = Controller(inbox, hostname="127.0.0.1", port=free_port())
    server.start()
    try:
        ledger = tmp_path / "l.duckdb"
        seed(ledger, [cost_row("a", "2026-11-10T09:00:00+00:00", "55.00")])
        config = write_config(tmp_path, server.port, smtp_timeout_s=1)
        victim = subprocess.Popen(check_command(config, ledger), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        inbox.victim = victim.pid
        victim.communicate(timeout=60)
        assert victim.returncode == -signal.SIGKILL
        assert len(inbox.messages) == 1
        # the dead process's claim is still leased for its delivery (1 s timeout, 5 s margin): not yet
        started = time.monotonic()
        soon = subprocess.run(check_command(config, ledger), capture_output=True, text=True, timeout=60)
        assert soon.stdout.strip() == "no alerts due" and len(inbox.messages) == 1
        time.sleep(max(0.0, 6.5 - (time.monotonic() - started)))
        later = subprocess.run(check_command(config, ledger), capture_output=True, text=True, timeout=60)
        assert "lead@example.com (email lead@example.com: ok)" in later.stdout, later.stdout + later.stderr
        mails = inbox.wait_for(2)
        assert [m["Subject"] for m in mails] == ["[tokenward] budget research: 55.00% of $100.00 (crossed 50%)"] * 2
        assert mails[0]["Message-ID"] == mails[1]["Message-ID"]  # the receiver can drop the duplicate
        again = subprocess.run(check_command(config, ledger), capture_output=True, text=True, timeout=60)
        assert again.stdout.strip() == "no alerts due" and len(inbox.messages) == 2
    finally:
        server.stop()


class DrippingReceiver:
    """A server that never finishes its answer, sending a little every 0.3 s (so no read ever times out).

    ``http``: 200 with a 1000-byte body, one byte at a time; ``smtp``: a greeting of endless
    ``220-`` continuation lines.
    """

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            self.requests += 1
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with conn:
            if self.protocol == "http":
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\ncontent-type: text/plain\r\n\r\n")
            for _ in range(1000):
                if self.stop.is_set():
                    return
                try:
                    conn.sendall(b"x" if self.protocol == "http" else b"220-still here\r\n")
                except OSError:
                    return
                time.sleep(0.3)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("channel", ["webhook", "email"])
def test_a_receiver_that_never_finishes_is_given_up_after_its_timeout(channel, tmp_path):
    """A receiver that trickles its answer must not hold every other alert for minutes (or forever)."""
    dripping = DrippingReceiver("http" if channel == "webhook" else "smtp")
    inbox = Inbox()
    server = Controller(inbox, hostname="127.0.0.1", port=free_port())
    server.start()
    try:
        if channel == "webhook":
            hook = WebhookSettings(name="ops", url=f"http://127.0.0.1:{dripping.port}/hook", timeout_s=1)
            settings = AlertSettings(
                smtp=SmtpSettings(host="127.0.0.1", port=server.port, security="none", sender="tokenward@test"),
                webhooks=[hook],
                retries=1,
                backoff_s=0.01,
            )
            targets = ("ops", "lead@example.com")
        else:  # an SMTP server that drips its greeting
            settings = AlertSettings(
                smtp=SmtpSettings(
                    host="127.0.0.1", port=dripping.port, security="none", sender="tokenward@test", timeout_s=1
                ),
                retries=1,
                backoff_s=0.01,
            )
            targets = ("lead@example.com",)
        alert = Alert("b", "2026-11-10", "threshold", 50, "[tokenward] b: 50%", "text", "<p>x</p>", targets)
        started = time.monotonic()
        deliveries = asyncio.run(Notifier(settings).send(alert))
        took = time.monotonic() - started
        # two attempts of at most 1 s each (and the 0.01 s backoff), not 300 s of dripping
        assert took < 4, took
        assert deliveries[0].ok is False and deliveries[0].attempts == 2
        assert "TimeoutError" in (deliveries[0].error or "")
        assert dripping.requests == 2
        if channel == "webhook":
            assert deliveries[1].ok and [m["To"] for m in inbox.wait_for(1)] == ["lead@example.com"]
    finally:
        dripping.close()
        server.stop()


def test_a_rolling_threshold_crossed_again_while_mail_is_down_is_not_taken_for_delivered(tmp_path, smtp):  # noqa: F811
    """The first crossing reached lead@; at the second (after re-arming) the mail server is down."""
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    budget = BudgetSettings(
        name="last-2h", limit_usd=1, period="rolling", rolling_hours=2, thresholds=[50], notify=["lead@example.com"]
    ).to_budget()
    seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "0.60")])
    assert len(run_check(path, [budget], settings_for(port), "2026-11-10T10:00:00+00:00")) == 1
    assert run_check(path, [budget], settings_for(port), "2026-11-10T11:01:00+00:00") == []  # 0 %: re-armed
    seed(path, [cost_row("b", "2026-11-10T11:05:00+00:00", "0.55")])
    down = run_check(path, [budget], settings_for(free_port()), "2026-11-10T11:06:00+00:00")
    assert [(a.kind, d[0].ok) for a, d in down] == [("threshold", False)]
    state = DuckLedger(path).state
    assert [(c.key.threshold, c.status) for c in state.claims(kind="threshold")] == [(50, "pending")]
    back = run_check(path, [budget], settings_for(port), "2026-11-10T11:10:00+00:00")
    assert [(a.targets, d[0].ok) for a, d in back] == [(("lead@example.com",), True)]
    assert [m["Subject"] for m in inbox.wait_for(2)] == [
        "[tokenward] budget last-2h: 60.00% of $1.00 (crossed 50%)",
        "[tokenward] budget last-2h: 55.00% of $1.00 (crossed 50%)",
    ]
    assert run_check(path, [budget], settings_for(port), "2026-11-10T11:15:00+00:00") == []


def engine_state(engine: str, tmp_path: Path, request):
    """The state store of ``engine`` (``sqlite``: beside a DuckDB ledger; ``postgres``: the test cluster's)."""
    if engine == "sqlite":
        return DuckLedger(tmp_path / "l.duckdb").state
    from .test_pg_ledger import pg

    return pg(tmp_path, request.getfixturevalue("pg_url")).state


@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
def test_leases_and_re_arming_in_each_state_store(engine, tmp_path, request):
    import datetime as dt

    from tokenward.reports.ledger.state import AlertKey, DeliveryRecord

    state = engine_state(engine, tmp_path, request)
    at = dt.datetime(2026, 11, 10, 10, tzinfo=dt.UTC)
    key = AlertKey("team", at, "threshold", 50)
    assert state.claim([key], {"payload": {"limit_usd": "100"}}, at) == [key]
    # one holder at a time; the holder renews; another takes over once the lease has run out
    assert state.lease([key], "one", 600.0) == [key]
    assert state.lease([key], "two", 600.0) == []
    assert state.lease([key], "one", -1.0) == [key]  # renewed, to a lease that has run out already
    assert state.lease([key], "two", 600.0) == [key]
    state.record_delivery(DeliveryRecord(key, "email", "lead@example.com", True, 1, None, at))
    state.set_status(key, "sent")  # ends the lease; a sent claim is never leased again
    assert state.lease([key], "three", -1.0) == []
    # re-arming for an edited limit: the claim made at $100 is kept at $100, forgotten at $200
    state.rearm("team", at, [], False, limit="100")
    assert state.claimed("team", at) == {("threshold", 50)}
    state.rearm("team", at, [], False, limit="200")
    assert state.claimed("team", at) == set() and state.delivered(key) == set()


class RefusingInbox(Inbox):
    """Answers RCPT for one address with 550 (a permanent refusal), counting how often it was asked."""

    def __init__(self, refused: str) -> None:
        super().__init__()
        self.refused = refused
        self.refusals = 0

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):  # noqa: N802 - aiosmtpd's hook name
        if address == self.refused:
            self.refusals += 1
            return "550 5.1.1 no such user"
        envelope.rcpt_tos.append(address)
        return "250 OK"


def test_a_recipient_the_mail_server_refuses_for_good_is_not_asked_again_at_every_evaluation(tmp_path):
    inbox = RefusingInbox("gone@example.com")
    server = Controller(inbox, hostname="127.0.0.1", port=free_port())
    server.start()
    try:
        path = tmp_path / "l.duckdb"
        seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "55.00")])
        budget = BudgetSettings(
            name="team", limit_usd=100, period="total", notify=["gone@example.com", "lead@example.com"]
        ).to_budget()
        settings = AlertSettings(
            smtp=SmtpSettings(host="127.0.0.1", port=server.port, security="none", sender="tokenward@test"),
            admins=["ops@example.com"],
            retries=3,
            backoff_s=0.01,
        )
        sent = run_check(path, [budget], settings, "2026-11-10T10:00:00+00:00")
        assert [(a.kind, [(d.target, d.ok, d.attempts) for d in ds]) for a, ds in sent] == [
            ("threshold", [("gone@example.com", False, 1), ("lead@example.com", True, 1)]),  # a 550 is not retried
            ("delivery_failed", [("ops@example.com", True, 1)]),
        ]
        assert "550" in (sent[0][1][0].error or "")
        state = DuckLedger(path).state
        assert [(c.key.kind, c.status) for c in state.claims()] == [
            ("threshold", "failed"),
            ("delivery_failed", "sent"),
        ]
        for minute in range(1, 4):  # later evaluations leave the refused address alone
            assert run_check(path, [budget], settings, f"2026-11-10T10:0{minute}:00+00:00") == []
        assert inbox.refusals == 1
        assert sorted(m["To"] for m in inbox.messages) == ["lead@example.com", "ops@example.com"]
    finally:
        server.stop()


class Receiver:
    """A real HTTP webhook receiver (the stdlib's server, in a thread) answering each POST with the next of ``statuses``."""

    def __init__(self, statuses: list[int]) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        receiver = self
        self.statuses = statuses
        self.keys: list[str] = []

        class Hook(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's hook name
                self.rfile.read(int(self.headers["content-length"]))
                receiver.keys.append(self.headers["Idempotency-Key"])
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
        self.port = self.server.server_address[1]

    def __enter__(self) -> Receiver:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(("statuses", "posts", "status"), [([500, 500, 200], 3, "sent"), ([410], 1, "failed")])
def test_a_webhook_that_fails_is_retried_with_one_idempotency_key_or_left_when_gone(statuses, posts, status, tmp_path):
    """500 twice (both attempts of the first evaluation), then 200 at the next; a 410 is not asked again."""
    with Receiver(list(statuses)) as receiver:
        path = tmp_path / "l.duckdb"
        seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "55.00")])
        hook = WebhookSettings(name="ops", url=f"http://127.0.0.1:{receiver.port}/hook")
        settings = AlertSettings(webhooks=[hook], retries=1, backoff_s=0.01)
        budget = BudgetSettings(name="team", limit_usd=100, period="total", notify=["ops"]).to_budget()
        first = run_check(path, [budget], settings, "2026-11-10T10:00:00+00:00")
        assert [(d.ok, d.attempts) for _, ds in first for d in ds] == [(False, min(posts, 2))]
        for minute in range(1, 4):
            run_check(path, [budget], settings, f"2026-11-10T10:0{minute}:00+00:00")
        assert len(receiver.keys) == posts and len(set(receiver.keys)) == 1  # one key: the receiver can de-duplicate
        state = DuckLedger(path).state
        assert [c.status for c in state.claims(kind="threshold")] == [status]
