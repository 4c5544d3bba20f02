"""Nothing that reveals spend answers anonymously when auth is on: ``/metrics`` and the budget headers."""

from __future__ import annotations

import datetime as dt
import hashlib
import time
from decimal import Decimal

import httpx
import pytest
from click.testing import CliRunner

from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.cli import main
from tokenward.proxy.config import UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.routes import MetricsAccess
from tokenward.proxy.simulator import RECORD_HEADER
from tokenward.reports.cli_common import ledger_named
from tokenward.reports.keys import revoke_key

CHAT = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"
KEYS = [
    VirtualKeyConfig(name="team-a", key="tw-team-a-secret"),
    VirtualKeyConfig(name="team-b", key="tw-team-b-secret"),
]


@pytest.fixture
def upstream(simulator, monkeypatch):
    monkeypatch.setenv("SIM_OPENAI_KEY", "sk-upstream")
    return [
        UpstreamConfig(
            name="openai",
            base_url=f"{simulator.url}/openai/v1",
            default=True,
            provider="openai",
            api_key_env="SIM_OPENAI_KEY",
        )
    ]


def metrics(proxy, token: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.get(f"{proxy.url}/metrics", headers=headers)


def chat(proxy, key: str) -> httpx.Response:
    return httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {key}", RECORD_HEADER: CHAT},
    )


def test_metrics_stay_open_in_passthrough_mode_without_a_token(start_proxy):
    proxy = start_proxy()
    reply = metrics(proxy)
    assert reply.status_code == 200 and "tokenward_requests" in reply.text


def test_a_configured_token_is_required_in_passthrough_mode(start_proxy, monkeypatch):
    monkeypatch.setenv("TW_METRICS_TOKEN", "metrics-secret-1")
    proxy = start_proxy(server={"metrics_token_env": "TW_METRICS_TOKEN"})
    anonymous = metrics(proxy)
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"].startswith("Bearer")
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    assert "tokenward_cost_usd" not in anonymous.text
    assert metrics(proxy, "metrics-secret-2").status_code == 401
    allowed = metrics(proxy, "metrics-secret-1")
    assert allowed.status_code == 200 and "tokenward_cost_usd" in allowed.text


def test_with_virtual_keys_metrics_need_the_token_not_just_any_key(start_proxy, upstream, monkeypatch):
    monkeypatch.setenv("TW_METRICS_TOKEN", "metrics-secret-1")
    proxy = start_proxy(upstreams=upstream, auth="virtual_keys", keys=KEYS)  # no token configured
    assert metrics(proxy).status_code == 401
    assert metrics(proxy, "tw-not-a-key").status_code == 401
    refused = metrics(proxy, "tw-team-a-secret")  # a valid key that is no admin key
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert "server.metrics_token_env" in refused.json()["error"]["message"]
    with_token = start_proxy(
        upstreams=upstream, auth="virtual_keys", keys=KEYS, server={"metrics_token_env": "TW_METRICS_TOKEN"}
    )
    assert metrics(with_token, "metrics-secret-1").status_code == 200
    assert metrics(with_token, "tw-team-a-secret").status_code == 401


def test_an_admin_key_may_read_metrics():
    admin = hashlib.sha256(b"tw-admin-secret").digest()
    access = MetricsAccess(open=False, token_sha256=None, admin_sha256=frozenset({admin}))
    assert access.refusal([(b"authorization", b"Bearer tw-admin-secret")]) is None
    assert access.refusal([(b"x-api-key", b"tw-admin-secret")]) is None
    assert access.refusal([(b"authorization", b"Bearer tw-team-a-secret")]).status == 401
    assert access.refusal([]).status == 401


def _keys_cli(*args: str) -> str:
    result = CliRunner().invoke(main, ["keys", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _until(proxy, done, what: str) -> None:
    """Bring the stored-key reload (every 5 s) forward until ``done()`` holds (at most 20 s)."""
    deadline = time.monotonic() + 20
    while not done():
        assert time.monotonic() < deadline, f"not seen within 20 s: {what}"
        proxy.app.state.scheduler.get_job("keys").modify(next_run_time=dt.datetime.now(dt.UTC))
        time.sleep(0.05)


def test_stored_admin_keys_and_the_admin_token_read_metrics_and_a_revoked_admin_key_does_not(
    start_proxy, upstream, monkeypatch
):
    # the operator's first week: `keys create --role admin` for the Prometheus scrape, as the README says
    monkeypatch.setenv("TW_ADMIN_TOKEN", "admin-token-1")
    keys = [*KEYS, VirtualKeyConfig(name="ops-admin", key="tw-ops-admin-secret", role="admin")]
    proxy = start_proxy(upstreams=upstream, auth="virtual_keys", keys=keys, server={"admin_token_env": "TW_ADMIN_TOKEN"})
    db = str(proxy.ledger)
    assert metrics(proxy, "tw-ops-admin-secret").status_code == 200
    assert metrics(proxy, "admin-token-1").status_code == 200  # the token that opens the dashboard
    oncall = _keys_cli("create", "oncall", "--role", "admin", "--db", db).splitlines()[0]
    _until(proxy, lambda: metrics(proxy, oncall).status_code == 200, "a stored admin key reads /metrics")
    assert "tokenward_requests_total" in metrics(proxy, oncall).text
    assert metrics(proxy, "tw-team-a-secret").status_code == 401  # a plain key still does not
    configured = {"ops-admin": hashlib.sha256(b"tw-ops-admin-secret").hexdigest()}  # `keys revoke --config`
    assert revoke_key(ledger_named(db, None).state, "ops-admin", now=dt.datetime.now(dt.UTC), configured=configured)
    _until(proxy, lambda: metrics(proxy, "tw-ops-admin-secret").status_code == 401, "the revoked key is refused")
    _keys_cli("revoke", "oncall", "--db", db)
    _until(proxy, lambda: metrics(proxy, oncall).status_code == 401, "the revoked stored key is refused")
    assert metrics(proxy, "admin-token-1").status_code == 200


def test_a_token_variable_that_is_unset_opens_nothing(start_proxy, monkeypatch):
    monkeypatch.delenv("TW_METRICS_TOKEN", raising=False)
    proxy = start_proxy(server={"metrics_token_env": "TW_METRICS_TOKEN"})
    assert metrics(proxy).status_code == 401
    assert httpx.get(f"{proxy.url}/metrics", headers={"authorization": "Bearer"}).status_code == 401
    assert metrics(proxy, "anything").status_code == 401


def test_budget_headers_go_only_to_callers_inside_the_budgets_scope(start_proxy, upstream):
    budgets = [BudgetSettings(name="team-b-monthly", limit_usd=50, scope={"key": "team-b"}, period="month")]
    proxy = start_proxy(upstreams=upstream, auth="virtual_keys", keys=KEYS, budgets=budgets)
    inside = chat(proxy, "tw-team-b-secret")
    assert inside.status_code == 200
    assert inside.headers["x-tokenward-budget"] == "team-b-monthly"
    # a whole reply's headers are made once it is recorded: what is left after its own cost
    left = Decimal(inside.headers["x-tokenward-budget-remaining-usd"])
    assert left == Decimal(50) - Decimal(inside.headers["x-tokenward-cost-usd"]) and left < 50
    outside = chat(proxy, "tw-team-a-secret")
    assert outside.status_code == 200
    assert not [name for name in outside.headers if name.startswith("x-tokenward-budget")]
    unknown = chat(proxy, "tw-not-a-key")
    assert unknown.status_code == 401
    assert not [name for name in unknown.headers if name.startswith("x-tokenward-budget")]
    assert "team-b" not in unknown.text
