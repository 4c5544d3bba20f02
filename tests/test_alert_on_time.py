"""Alerts on time while a mail server is slow: real ``tokenward serve`` processes, a real SMTP server (aiosmtpd).

A long-running agent keeps spending while the mail of an earlier threshold hangs at the mail
server: the next threshold's mail must not wait for it (nor for the next scheduled check).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
from aiosmtpd.controller import Controller

from tokenward.pricing.settings import BudgetSettings

from .crashkit import CountingUpstream, ProxyProcess, free_port, write_config
from .test_alerts import Inbox

# gpt-4o-mini at $0.15 / $0.60 per 1M tokens; CountingUpstream bills 8 in, 5 out: $0.0000042 a request.
# Against $0.000008: the first request is 52.50 % (past 50 %), the second 105.00 % (past 100 %).
AGENT_BUDGET = """
budgets:
  - {name: agent, limit_usd: 0.000008, period: total, thresholds: [50, 100], notify: [lead@example.com]}
alerts:
  evaluate_every_s: 3600
  retries: 0
  smtp: {host: 127.0.0.1, port: %d, security: none, sender: tokenward@test, timeout_s: 120}
"""


class FirstMailHangs(Inbox):
    """Takes ``hang_s`` to answer the first message's DATA, later ones at once.

    The first mail is then accepted, or with ``accept_first=False`` refused for now (451): a
    sender that left meanwhile has not delivered it.
    """

    def __init__(self, hang_s: float, *, accept_first: bool = True) -> None:
        super().__init__()
        self.hang_s = hang_s
        self.accept_first = accept_first
        self.hanging = threading.Event()
        self.release = asyncio.Event()

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's hook name
        if not self.hanging.is_set():
            self.hanging.set()
            try:
                await asyncio.wait_for(self.release.wait(), self.hang_s)
            except TimeoutError:
                pass
            if not self.accept_first:
                return "451 4.3.0 try again later"
        return await super().handle_DATA(server, session, envelope)


def _chat(url: str) -> None:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-c"}, timeout=10)
    assert reply.status_code == 200, reply.text


def test_the_next_threshold_is_mailed_while_the_mail_of_the_last_one_hangs(tmp_path: Path) -> None:
    """50 % is crossed and its mail hangs 40 s at the mail server; then the agent crosses 100 %.

    Before, the scheduled check waited for every delivery it started, and the check brought
    forward by the crossing found it still running (one instance at a time) and was skipped:
    the 100 % mail waited for the hanging one and then for the next scheduled check, an hour here
    (60 s by default), while the agent kept spending past the limit.
    """
    inbox = FirstMailHangs(hang_s=40)
    smtp = Controller(inbox, hostname="127.0.0.1", port=free_port())
    smtp.start()
    port = free_port()
    with CountingUpstream() as upstream:
        proxy = ProxyProcess(write_config(tmp_path, upstream.url, port, AGENT_BUDGET % smtp.port), port).start()
        try:
            _chat(proxy.url)
            assert inbox.hanging.wait(15), proxy.log()  # the 50 % mail is at the mail server, unanswered
            _chat(proxy.url)
            crossed = time.monotonic()
            deadline = crossed + 15
            while not inbox.messages and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [m["Subject"] for m in inbox.messages] == [
                "[tokenward] budget agent: 105.00% of $0.000008 (crossed 100%)"
            ], proxy.log()
            assert time.monotonic() - crossed < 15
            smtp.loop.call_soon_threadsafe(inbox.release.set)  # the mail server answers the first mail
            mails = inbox.wait_for(2, timeout=15)
            assert sorted(m["Subject"] for m in mails) == [
                "[tokenward] budget agent: 105.00% of $0.000008 (crossed 100%)",
                "[tokenward] budget agent: 52.50% of $0.000008 (crossed 50%)",
            ]
        finally:
            proxy.stop()
            smtp.stop()
    assert len(inbox.messages) == 2


def test_a_proxy_stopped_while_a_mail_hangs_is_mailed_by_the_restarted_one_at_once(tmp_path: Path) -> None:
    """SIGTERM while the 50 % mail hangs at the mail server; the proxy is started again at once.

    Before, the stopped proxy's delivery kept its lease (every attempt at the 120 s timeout, plus
    5 s), and the restarted proxy's first check came one ``evaluate_every_s`` after its start (an
    hour here, 60 s by default): the mail waited for both. Now a stopped delivery gives its lease
    up, and a proxy checks its budgets as it starts.
    """
    inbox = FirstMailHangs(hang_s=60, accept_first=False)
    smtp = Controller(inbox, hostname="127.0.0.1", port=free_port())
    smtp.start()
    port = free_port()
    try:
        with CountingUpstream() as upstream:
            config = write_config(tmp_path, upstream.url, port, AGENT_BUDGET % smtp.port)
            first = ProxyProcess(config, port).start()
            try:
                _chat(first.url)
                assert inbox.hanging.wait(15), first.log()
            finally:
                first.stop()  # SIGTERM: a clean stop, with the mail still unanswered
            second = ProxyProcess(config, port).start()
            try:
                mails = inbox.wait_for(1, timeout=15)
                assert [m["Subject"] for m in mails] == [
                    "[tokenward] budget agent: 52.50% of $0.000008 (crossed 50%)"
                ], second.log()
            finally:
                second.stop()
    finally:
        smtp.loop.call_soon_threadsafe(inbox.release.set)
        smtp.stop()
    assert len(inbox.messages) == 1


class HangsUpAfterTheFirstMail(Inbox):
    """Keeps the first message, then drops the connection instead of answering 250; later ones answered."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's hook name
        reply = await super().handle_DATA(server, session, envelope)
        if not self.dropped:
            self.dropped += 1
            server.transport.abort()  # the mail is in, the reply never leaves
        return reply


def test_a_mail_server_that_hangs_up_before_its_reply_gets_the_mail_again_with_the_same_message_id(tmp_path):
    """The at-least-once choice: a mail whose 250 never arrived may not have been taken, so it is sent again.

    The receiver has it twice, with one ``Message-ID`` (a mail store or client drops the second);
    the delivery is recorded once, ok at the second attempt, and nothing is sent after that.
    """
    from .test_alerts import cost_row, run_check, seed, settings_for

    inbox = HangsUpAfterTheFirstMail()
    smtp = Controller(inbox, hostname="127.0.0.1", port=free_port())
    smtp.start()
    try:
        path = tmp_path / "l.duckdb"
        seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "6")])
        budget = BudgetSettings(name="b", limit_usd=10, period="total", thresholds=[50], notify=["lead@example.com"])
        [(_, [delivery])] = run_check(path, [budget.to_budget()], settings_for(smtp.port), "2026-11-10T10:00:00+00:00")
        assert delivery.ok and delivery.attempts == 2
        first, second = inbox.wait_for(2)
        assert first["Message-ID"] == second["Message-ID"] and first["Subject"] == second["Subject"]
        assert run_check(path, [budget.to_budget()], settings_for(smtp.port), "2026-11-10T10:01:00+00:00") == []
        assert len(inbox.wait_for(3, timeout=0.5)) == 2
    finally:
        smtp.stop()
