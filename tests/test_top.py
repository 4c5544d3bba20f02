"""``tokenward top`` in a real pty (pexpect) against a real proxy: the figures appear and refresh.

Costs from the built-in catalog: CHAT (gpt-4o, 8 in at $2.50 + 10 out at $10.00 per 1M) = $0.000120;
CACHE_WRITE (gpt-5.6-sol, 8 uncached at $5 + 4012 writes at $6.25 + 4 out at $30) = $0.025235.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.cli import main
from tokenward.proxy.demo import send_recorded

from .test_dashboard import CACHE_WRITE, CHAT, client_for, dashboard_proxy

pexpect = pytest.importorskip("pexpect", reason="pexpect is not installed")

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][A-Z0-9]|\x1b[=>]")


def tokenward_command() -> str:
    found = shutil.which("tokenward", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("the tokenward script is not installed next to this Python")
    return found


class Screen:
    """Everything a child process printed to its pty, without escape sequences."""

    def __init__(self, child) -> None:
        self.child = child
        self.text = ""

    def wait_for(self, *needles: str, timeout: float = 15.0) -> str:
        """Read until the output since the last call holds every needle; returns that output."""
        start = len(self.text)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.text += ANSI.sub("", self.child.read_nonblocking(65536, timeout=0.2))
            except pexpect.TIMEOUT:
                pass
            fresh = self.text[start:]
            if all(n in fresh for n in needles):
                return fresh
        raise AssertionError(f"never saw {needles!r}; last output:\n{self.text[-3000:]}")


def test_top_shows_figures_and_refreshes(tmp_path, simulator, sample, monkeypatch):
    monkeypatch.setenv("TW_ADMIN_TOKEN", "adm-top-0123456789")
    budgets = [BudgetSettings(name="daily-cap", limit_usd=Decimal("0.10"), period="day")]
    with dashboard_proxy(tmp_path, simulator, budgets=budgets, admin_token_env="TW_ADMIN_TOKEN") as proxy:
        with client_for(proxy, "sk-client") as client:
            send_recorded(client, sample[CHAT])
            send_recorded(client, sample[CACHE_WRITE])
            proxy.flush()
            env = {**os.environ, "TERM": "xterm-256color", "TOKENWARD_ADMIN_TOKEN": "adm-top-0123456789"}
            child = pexpect.spawn(
                tokenward_command(),
                ["top", "--url", proxy.url, "--interval", "0.5", "--tz", "UTC"],
                env=env,
                dimensions=(45, 110),
                encoding="utf-8",
                codec_errors="replace",
                # a parent that ignores Ctrl-C (nohup, some CI runners): inherited across exec,
                # so `top` must take SIGINT back to quit on it
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
            )
            try:
                screen = Screen(child)
                # 0.000120 + 0.025235 = 0.025355; the budget is 25.355% used (shown to one place)
                first = screen.wait_for("today $0.025355", "daily-cap", "25.4%", "gpt-5.6-sol", "$0.025235", "req/s")
                assert "budgets" in first and "█" in first and "last requests" in first
                # the next request is on screen within a few refreshes: 0.025355 + 0.000120 = 0.025475
                send_recorded(client, sample[CHAT])
                screen.wait_for("today $0.025475", "25.5%")
                child.sendintr()
                child.expect(pexpect.EOF, timeout=10)
            finally:
                child.close(force=True)
            assert child.exitstatus == 0


def test_top_once_and_credential_errors(tmp_path, simulator, sample, monkeypatch):
    monkeypatch.setenv("TW_ADMIN_TOKEN", "adm-top-0123456789")
    with dashboard_proxy(tmp_path, simulator, admin_token_env="TW_ADMIN_TOKEN") as proxy:
        with client_for(proxy, "sk-client") as client:
            send_recorded(client, sample[CHAT])
        proxy.flush()
        runner = CliRunner()
        ok = runner.invoke(
            main,
            ["top", "--url", proxy.url, "--once", "--token", "adm-top-0123456789", "--tz", "UTC"],
            env={"COLUMNS": "80"},
        )
        assert ok.exit_code == 0, ok.output
        assert "today $0.00012 " in ok.output and "no budgets configured" in ok.output
        assert max(len(line) for line in ok.output.splitlines()) <= 80
        refused = runner.invoke(main, ["top", "--url", proxy.url, "--once", "--token", "wrong"])
        assert refused.exit_code == 1 and "HTTP 401: That is not an admin credential." in refused.output
        assert "--token" not in refused.output  # a token was given: it is the wrong one
        # without one, the proxy's advice is a header or /dashboard's form: top says how it sends one
        bare = runner.invoke(main, ["top", "--url", proxy.url, "--once"], env={"TOKENWARD_ADMIN_TOKEN": None})
        assert bare.exit_code == 1 and "HTTP 401: Admin credential required" in bare.output
        assert "Give `tokenward top` one with --token or TOKENWARD_ADMIN_TOKEN." in bare.output
    gone = runner.invoke(main, ["top", "--url", proxy.url, "--once", "--token", "x"])
    assert gone.exit_code == 1 and "cannot reach the proxy" in gone.output
    bad_zone = runner.invoke(main, ["top", "--once", "--tz", "Mars/Olympus"])
    assert bad_zone.exit_code == 2 and "unknown time zone" in bad_zone.output
