"""The dashboard over real HTTP (auth, API, caching) and in a real headless Chromium (Playwright).

The proxy runs under uvicorn in front of the recorded-exchange simulator; requests go through
the real openai SDK. Expected dollar figures are worked out from the built-in catalog's rates:
  CHAT             gpt-4o       8 in * $2.50 + 10 out * $10.00 per 1M          = $0.000120
  RESPONSES_STREAM gpt-4o     255 in * $2.50 + 16 out * $10.00                 = $0.0007975
  CACHE_WRITE      gpt-5.6-sol 8 uncached * $5 + 4012 writes * $6.25 + 4 * $30 = $0.025235
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from click.testing import CliRunner

from tokenward.pricing.settings import BudgetSettings, GuardSettings
from tokenward.proxy.app import create_app
from tokenward.proxy.cli import main
from tokenward.proxy.config import AuthConfig, Config, LedgerConfig, ServerConfig, VirtualKeyConfig
from tokenward.proxy.demo import send_recorded
from tokenward.proxy.server import running_in_thread
from tokenward.reports.alerts import AlertSettings
from tokenward.reports.budget_check import usd
from tokenward.reports.cli_common import ledger_named
from tokenward.reports.keys import revoke_key

from .conftest import Proxy, upstreams_for
from .test_alerts import settings_for, smtp  # noqa: F401 - smtp is a fixture

CHAT = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"
RESPONSES_STREAM = "tests/models/cassettes/test_openai_responses/test_openai_responses_stream.yaml#0"
CACHE_WRITE = "tests/models/cassettes/test_openai_prompt_cache/test_openai_chat_prompt_cache_e2e.yaml#0"
ADMIN_KEY = "tw-admin-key-0001"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
CHROMIUM = os.environ.get("TOKENWARD_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch):
    monkeypatch.setenv("SIM_OPENAI_KEY", "sk-upstream")


@contextmanager
def dashboard_proxy(
    tmp_path: Path,
    simulator: Any,
    *,
    auth: str = "passthrough",
    keys: list[VirtualKeyConfig] | None = None,
    budgets: list[BudgetSettings] | None = None,
    admin_token_env: str | None = None,
    alerts: AlertSettings | None = None,
) -> Iterator[Proxy]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    ledger = tmp_path / "ledger.duckdb"
    config = Config(
        upstreams=upstreams_for(simulator.url, ["openai"], api_key_env="SIM_OPENAI_KEY"),
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        auth=AuthConfig(mode=auth),  # type: ignore[arg-type]
        virtual_keys=keys or [],
        budgets=budgets or [],
        server=ServerConfig(admin_token_env=admin_token_env),
        alerts=alerts or AlertSettings(),
        guard=GuardSettings(unpriced_hold_usd=Decimal("0.01")),  # an unpriced model passes a blocking budget
    )
    app = create_app(config)
    with running_in_thread(app) as url:
        yield Proxy(url, app, ledger)


def client_for(proxy: Proxy, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0)


def state(proxy: Proxy, **headers: str) -> httpx.Response:
    return httpx.get(f"{proxy.url}/dashboard/api/state", headers=headers, timeout=10)


def test_passthrough_without_token_serves_loopback_only(tmp_path, simulator, sample):
    with dashboard_proxy(tmp_path, simulator) as proxy:
        with client_for(proxy, "sk-client") as client:
            send_recorded(client, sample[CHAT])
        proxy.flush()
        local = state(proxy)
        assert local.status_code == 200
        body = local.json()
        (recent,) = body["live"]["recent"]
        assert (recent["served_model"], recent["input_tokens"]) == ("gpt-4o-2024-08-06", 8)
        assert Decimal(recent["cost_usd"]) == Decimal("0.000120")
        # uvicorn trusts X-Forwarded-For from 127.0.0.1 only: a client it names is not local
        remote = state(proxy, **{"x-forwarded-for": "203.0.113.9"})
        assert remote.status_code == 403 and remote.json()["error"]["code"] == "admin_loopback_only"
        page = httpx.get(f"{proxy.url}/dashboard", headers={"x-forwarded-for": "203.0.113.9"})
        assert page.status_code == 403 and "only to the proxy&#x27;s own machine" in page.text
        assert "<form" not in page.text
        # the page's assets hold no data and are public; the page itself is not framed or sniffed
        asset = httpx.get(f"{proxy.url}/dashboard/assets/dashboard.js", headers={"x-forwarded-for": "203.0.113.9"})
        assert asset.status_code == 200 and asset.headers["content-type"] == "text/javascript; charset=utf-8"
        assert httpx.get(f"{proxy.url}/dashboard/assets/..%2Fdashboard.py").status_code == 404
        ok = httpx.get(f"{proxy.url}/dashboard")
        assert ok.status_code == 200 and "script-src 'self'" in ok.headers["content-security-policy"]
        assert ok.headers["x-frame-options"] == "DENY"
        assert ok.headers["content-type"] == page.headers["content-type"] == "text/html; charset=utf-8"  # said once
        # looking at the dashboard writes no ledger rows
        assert len(proxy.rows()) == 1


def test_admin_token_header_and_login_cookie(tmp_path, simulator, monkeypatch):
    monkeypatch.setenv("TW_ADMIN_TOKEN", "adm-0123456789abcdef")
    with dashboard_proxy(tmp_path, simulator, admin_token_env="TW_ADMIN_TOKEN") as proxy:
        missing = state(proxy)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "admin_required"
        wrong = state(proxy, authorization="Bearer adm-wrong")
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_admin_credential"
        assert state(proxy, authorization="Bearer adm-0123456789abcdef").status_code == 200
        assert state(proxy, **{"x-api-key": "adm-0123456789abcdef"}).status_code == 200
        # the page without a credential is the login form, even from loopback
        form = httpx.get(f"{proxy.url}/dashboard")
        assert form.status_code == 401 and 'action="/dashboard/login"' in form.text
        bad = httpx.post(f"{proxy.url}/dashboard/login", data={"token": "nope"})
        assert bad.status_code == 401 and "not an admin credential" in bad.text and "set-cookie" not in bad.headers
        with httpx.Client(base_url=proxy.url) as browser:
            good = browser.post("/dashboard/login", data={"token": "adm-0123456789abcdef"})
            assert good.status_code == 303 and good.headers["location"] == "/dashboard"
            cookie = good.headers["set-cookie"].lower()
            assert "httponly" in cookie and "samesite=strict" in cookie and "path=/dashboard" in cookie
            assert "adm-0123456789abcdef" not in cookie  # a random session id, not the token
            assert browser.get("/dashboard/api/state").status_code == 200
            assert browser.get("/dashboard").status_code == 200
        assert state(proxy, cookie="tokenward_admin=forged").status_code == 401


def test_admin_role_keys_in_virtual_key_mode(tmp_path, simulator):
    keys = [
        VirtualKeyConfig(name="agent", key="tw-agent-key-0001", team="research"),
        VirtualKeyConfig(name="ops-admin", key=ADMIN_KEY, role="admin"),
    ]
    with dashboard_proxy(tmp_path, simulator, auth="virtual_keys", keys=keys) as proxy:
        user = state(proxy, authorization="Bearer tw-agent-key-0001")  # a real key, not an admin one: 403, not 401
        assert user.status_code == 403 and user.json()["error"] == {
            "message": "The virtual key 'agent' is not an admin key: the dashboard and its API need the admin token "
            "or a key with role: admin.",
            "type": "permission_error",
            "param": None,
            "code": "admin_role_required",
        }
        wrong = state(proxy, authorization="Bearer tw-agent-key-0002")  # no key at all: still 401
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_admin_credential"
        assert state(proxy, authorization=f"Bearer {ADMIN_KEY}").status_code == 200
        assert state(proxy).status_code == 401
        bad_zone = state(proxy, authorization=f"Bearer {ADMIN_KEY}")
        bad_zone = httpx.get(
            f"{proxy.url}/dashboard/api/state",
            params={"tz": "Mars/Olympus"},
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
        )
        assert bad_zone.status_code == 400 and bad_zone.json()["error"]["code"] == "invalid_parameter"
        bad_range = httpx.get(
            f"{proxy.url}/dashboard/api/state", params={"range": "1y"}, headers={"authorization": f"Bearer {ADMIN_KEY}"}
        )
        assert bad_range.status_code == 400 and "unknown range" in bad_range.json()["error"]["message"]


def _keys_cli(*args: str) -> str:
    result = CliRunner().invoke(main, ["keys", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _until(proxy: Proxy, done: Any, what: str) -> None:
    """Bring the stored-key reload (every 5 s) forward until ``done()`` holds (at most 20 s)."""
    deadline = time.monotonic() + 20
    while not done():
        assert time.monotonic() < deadline, f"not seen within 20 s: {what}"
        job = proxy.app.state.scheduler.get_job("keys")
        job.modify(next_run_time=dt.datetime.now(dt.UTC))
        time.sleep(0.05)


def test_revoking_an_admin_key_ends_its_dashboard_rights_and_stored_keys_can_be_admins(tmp_path, simulator):
    keys = [
        VirtualKeyConfig(name="agent", key="tw-agent-key-0001"),
        VirtualKeyConfig(name="ops-admin", key=ADMIN_KEY, role="admin"),
    ]
    with dashboard_proxy(tmp_path, simulator, auth="virtual_keys", keys=keys) as proxy:
        db = str(proxy.ledger)
        oncall = _keys_cli("create", "oncall", "--role", "admin", "--db", db).splitlines()[0]
        bot = _keys_cli("create", "bot", "--db", db).splitlines()[0]
        assert "admin" in _keys_cli("list", "--db", db)
        _until(proxy, lambda: state(proxy, authorization=f"Bearer {oncall}").status_code == 200, "oncall is admin")
        refused = state(proxy, authorization=f"Bearer {bot}")  # loaded with oncall, a plain virtual key
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_role_required"
        _keys_cli("revoke", "bot", "--db", db)  # a revoked key is no key: 401, as for a wrong one
        _until(proxy, lambda: state(proxy, authorization=f"Bearer {bot}").status_code == 401, "bot revoked")
        assert state(proxy, authorization=f"Bearer {bot}").json()["error"]["code"] == "invalid_admin_credential"
        with httpx.Client(base_url=proxy.url) as browser, httpx.Client(base_url=proxy.url) as second:
            assert browser.post("/dashboard/login", data={"token": ADMIN_KEY}).status_code == 303
            assert second.post("/dashboard/login", data={"token": oncall}).status_code == 303
            assert browser.get("/dashboard/api/state").status_code == 200
            # the operator revokes the leaked config key: not only /v1 refuses it, the dashboard does too
            configured = {"ops-admin": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}
            state_store = ledger_named(db, None).state
            assert revoke_key(state_store, "ops-admin", now=dt.datetime.now(dt.UTC), configured=configured)
            _until(proxy, lambda: state(proxy, authorization=f"Bearer {ADMIN_KEY}").status_code == 401, "revoked")
            assert state(proxy, **{"x-api-key": ADMIN_KEY}).status_code == 401
            gone = browser.get("/dashboard/api/state")  # the session it opened before is over
            assert gone.status_code == 401 and gone.json()["error"]["code"] == "admin_required"
            assert browser.get("/dashboard").status_code == 401  # the login form again
            relogin = browser.post("/dashboard/login", data={"token": ADMIN_KEY})
            assert relogin.status_code == 401 and "set-cookie" not in relogin.headers
            # the other admin and its session are untouched
            assert state(proxy, authorization=f"Bearer {oncall}").status_code == 200
            assert second.get("/dashboard/api/state").status_code == 200
            _keys_cli("revoke", "oncall", "--db", db)
            _until(proxy, lambda: second.get("/dashboard/api/state").status_code == 401, "oncall revoked")
            assert state(proxy, authorization=f"Bearer {oncall}").status_code == 401


def test_a_stored_admin_key_closes_the_loopback_dashboard_of_passthrough_mode(tmp_path, simulator):
    with dashboard_proxy(tmp_path, simulator) as proxy:
        assert state(proxy).status_code == 200  # no admin credential: loopback clients are let in
        admin = _keys_cli("create", "ops", "--role", "admin", "--db", str(proxy.ledger)).splitlines()[0]
        _until(proxy, lambda: state(proxy).status_code == 401, "an admin credential now exists")
        assert state(proxy).json()["error"]["code"] == "admin_required"
        assert state(proxy, authorization=f"Bearer {admin}").status_code == 200


def test_no_admin_configured_refuses_everyone(tmp_path, simulator, monkeypatch):
    keys = [VirtualKeyConfig(name="agent", key="tw-agent-key-0001")]
    with dashboard_proxy(tmp_path / "a", simulator, auth="virtual_keys", keys=keys) as proxy:
        refused = state(proxy, authorization="Bearer tw-agent-key-0001")
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_not_configured"
    # a token variable that is named but unset does not fall back to "loopback is fine"
    monkeypatch.delenv("TW_UNSET_TOKEN", raising=False)
    with dashboard_proxy(tmp_path / "b", simulator, admin_token_env="TW_UNSET_TOKEN") as proxy:
        refused = state(proxy)
        assert refused.status_code == 403 and "TW_UNSET_TOKEN is not set" in refused.json()["error"]["message"]


def test_many_pollers_share_one_ledger_read(tmp_path, simulator, sample):
    with dashboard_proxy(tmp_path, simulator) as proxy:
        with client_for(proxy, "sk-client") as client:
            send_recorded(client, sample[CACHE_WRITE])
            send_recorded(client, sample[CHAT])
        proxy.flush()

        async def poll_all() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=10) as http:
                return await asyncio.gather(*(http.get(f"{proxy.url}/dashboard/api/state") for _ in range(20)))

        replies = asyncio.run(poll_all())
        assert {r.status_code for r in replies} == {200}
        dashboard = proxy.app.state.dashboard
        assert dashboard.queries == 1  # 20 concurrent polls, one ledger session
        ledger = replies[-1].json()["ledger"]
        # 0.025235 + 0.000120 = 0.025355, read from the ledger, not from memory
        assert ledger["today"]["cost_usd"] == "0.025355000000" and ledger["today"]["requests"] == 2
        assert [(g["name"], g["cost_usd"]) for g in ledger["by_model"]] == [
            ("gpt-5.6-sol", "0.025235000000"),
            ("gpt-4o-2024-08-06", "0.000120000000"),
        ]
        again = state(proxy).json()
        assert dashboard.queries == 1 and again["ledger"]["stale"] is False


# ---- the real browser ---------------------------------------------------------------------------


@pytest.fixture
def chromium():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            yield browser
        finally:
            browser.close()


def expected_totals(rows: list[dict], zone: str) -> tuple[Decimal, Decimal]:
    """Cost today and this hour in ``zone``, from the ledger rows (for a run that straddles midnight)."""
    from zoneinfo import ZoneInfo

    now = dt.datetime.now(ZoneInfo(zone))
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    hour = now.replace(minute=0, second=0, microsecond=0)
    costs = [(r["started_at"], r["cost_usd"] or Decimal(0)) for r in rows]
    return sum((c for s, c in costs if s >= day), Decimal(0)), sum((c for s, c in costs if s >= hour), Decimal(0))


def test_dashboard_in_a_real_browser(tmp_path, simulator, sample, smtp, chromium):  # noqa: F811
    inbox, port = smtp
    keys = [
        VirtualKeyConfig(name="agent", key="tw-agent-key-0001", team="research"),
        VirtualKeyConfig(name="batch", key="tw-batch-key-0001", team="ops"),
        VirtualKeyConfig(name="ops-admin", key=ADMIN_KEY, role="admin"),
    ]
    budgets = [
        BudgetSettings(
            name="research-daily",
            limit_usd=Decimal("0.002"),
            scope={"team": "research"},
            period="day",
            thresholds=[50],
            notify=["ops@test"],
        ),
        BudgetSettings(name="all-monthly", limit_usd=Decimal("10"), period="month", action="block"),
    ]
    with dashboard_proxy(
        tmp_path, simulator, auth="virtual_keys", keys=keys, budgets=budgets, alerts=settings_for(port)
    ) as proxy:
        with client_for(proxy, "tw-agent-key-0001") as agent, client_for(proxy, "tw-batch-key-0001") as batch:
            send_recorded(agent, sample[CHAT])
            send_recorded(agent, sample[RESPONSES_STREAM])
            send_recorded(agent, sample[RESPONSES_STREAM])
            send_recorded(batch, sample[CACHE_WRITE])
            rows = proxy.rows(4)
            # research: 0.000120 + 2 x 0.0007975 = 0.001715 = 85.75% of $0.002 -> the 50% alert is mailed
            assert inbox.wait_for(1) and "research-daily" in inbox.messages[0]["subject"]
            assert sum(r["cost_usd"] for r in rows) == Decimal("0.02695")  # + 0.025235

            context = chromium.new_context(viewport={"width": 1400, "height": 1000}, timezone_id="Asia/Kolkata")
            page = context.new_page()
            errors: list[str] = []
            urls: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("request", lambda request: urls.append(request.url))
            page.goto(f"{proxy.url}/dashboard")
            # not logged in: the form; a user's key is refused, the admin key opens the dashboard
            page.fill("#token", "tw-agent-key-0001")
            page.click("button[type=submit]")
            assert page.inner_text("#login-message") == "That is not an admin credential."
            page.fill("#token", ADMIN_KEY)
            page.click("button[type=submit]")
            page.wait_for_selector("#status[data-state=live]")

            today, hour = expected_totals(rows, "Asia/Kolkata")
            page.wait_for_function(
                "([id, text]) => document.getElementById(id).textContent === text", arg=["today-cost", usd(today)]
            )
            assert page.inner_text("#hour-cost") == usd(hour)
            if today == Decimal("0.02695"):  # not straddling Kolkata's midnight: the hand-worked figure
                assert page.inner_text("#today-cost") == "$0.02695"
            assert page.inner_text("#today-requests") == "4 requests"

            def cells(selector: str) -> list[list[str]]:
                return page.eval_on_selector_all(
                    f"{selector} tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
                )

            by_model = {r[0]: r[2] for r in cells("#by-model")}
            assert by_model == {"gpt-5.6-sol": "$0.025235", "gpt-4o-2024-08-06": "$0.001715"}
            assert {r[0]: r[2] for r in cells("#by-key")} == {"batch": "$0.025235", "agent": "$0.001715"}
            assert {r[0]: r[2] for r in cells("#by-team")} == {"ops": "$0.025235", "research": "$0.001715"}

            budgets_shown = {r[0]: r for r in cells("#budgets")}
            research = budgets_shown["research-daily"]
            # spent column: 0.001715 and 0.02695, 6 places for both; limits 0.002 and 10 at 3 places
            assert research[1] == "team=research · day (UTC)" and research[2] == "85.75%"
            assert (research[3], research[4]) == ("$0.001715", "$0.002")
            monthly = budgets_shown["all-monthlyblocks"]
            assert (monthly[3], monthly[4]) == ("$0.026950", "$10.000")
            assert research[7] != "–" and research[7]  # runs out, limit reached, or not before reset

            recent = cells("#recent")
            assert [r[1] for r in recent] == ["batch", "agent", "agent", "agent"]
            assert [r[8] for r in recent] == ["$0.025235", "$0.000798", "$0.000798", "$0.000120"]  # 0.0007975 half-even

            page.wait_for_function("() => document.querySelectorAll('#alerts tbody tr').length > 0")
            # (a forecast alert may come too, depending on how much of the day has gone)
            page.wait_for_function(
                "() => [...document.querySelectorAll('#alerts td')].some(td => td.textContent === 'sent')"
            )
            (alert,) = [a for a in cells("#alerts") if a[2] == "crossed 50%"]
            assert alert[1:5] == ["research-daily", "crossed 50%", "sent", "email ops@test"]

            # a new request shows up without reloading: 0.02695 + 0.000120 = 0.02707
            send_recorded(agent, sample[CHAT])
            page.wait_for_function("() => document.querySelectorAll('#recent tbody tr').length === 5", timeout=10_000)
            assert page.eval_on_selector("#recent tbody tr", "tr => tr.className") == "new"  # highlighted
            rows = proxy.rows(5)
            today, _ = expected_totals(rows, "Asia/Kolkata")
            page.wait_for_function(
                "([id, text]) => document.getElementById(id).textContent === text",
                arg=["today-cost", usd(today)],
                timeout=15_000,
            )

            # what clients send is shown as text, never run as HTML
            hostile = '<img src=x onerror="window.__pwned=1">'
            # the simulator makes up a reply for a model it has no recording of; the row is unpriced
            agent.chat.completions.create(model=hostile, messages=[{"role": "user", "content": "hi"}])
            page.wait_for_function("() => document.querySelectorAll('#recent tbody tr').length === 6", timeout=10_000)
            assert page.inner_text("#recent tbody tr:first-child td:nth-child(3)").startswith(hostile)
            assert page.evaluate("window.__pwned") is None

            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            ARTIFACTS.mkdir(exist_ok=True)
            shutil.copy(shot, ARTIFACTS / "dashboard.png")
            assert shot.stat().st_size > 20_000
            context.close()
    assert errors == []
    # self-contained: every request the page made went to the proxy itself
    assert urls and all(u.startswith(proxy.url) or u.startswith("data:") for u in urls), urls
