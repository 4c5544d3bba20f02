"""Degrade instead of refusing: a clamped output limit or a cheaper model, never past (or around) a budget.

Prices (tests/fixtures/field_case_prices.yaml, per 1M tokens): gpt-4o $2.50 in / $10.00 out,
gpt-4o-mini $0.15 in / $0.60 out. The scripted upstream bills every request its worst case: the
prompt's n + 7 tokens in, and as many tokens out as the (edited) body allows.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Iterator
from decimal import Decimal

import httpx
import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tokenward.pricing.budgets import Budget, Degrade, Period
from tokenward.pricing.catalog import load_catalog
from tokenward.pricing.cost import price
from tokenward.pricing.quote import worst_case
from tokenward.pricing.settings import BudgetSettings, DegradeSettings
from tokenward.pricing.usage import Usage
from tokenward.proxy.config import UpstreamConfig
from tokenward.proxy.degrade import degrade
from tokenward.proxy.guard import BudgetGuard, BudgetRefusal

from .agentkit import AGENT_KEY, PRICES, serving
from .servers import Servers

UTC = dt.UTC


async def bill_the_worst_case(request: web.Request, body: bytes) -> web.StreamResponse:
    """A chat upstream that answers with the most output the request allows (its worst case)."""
    document = json.loads(body)
    words = document["messages"][0]["content"].split(" ")
    output = document.get("max_tokens") or document.get("max_completion_tokens") or 50
    return web.json_response(
        {
            "id": "c1",
            "object": "chat.completion",
            "model": document["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": len(words) + 7,
                "completion_tokens": output,
                "total_tokens": len(words) + 7 + output,
            },
        }
    )


@pytest.fixture
def billing() -> Iterator[Servers]:
    with Servers(bill_the_worst_case).running() as running:
        yield running


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch):
    monkeypatch.setenv("SIM_UPSTREAM_KEY", "sk-upstream")


def body(n_tokens: int, max_tokens: int | None, model: str = "gpt-4o") -> bytes:
    """A request body spelt the way a client might (odd spacing: edits must keep every other byte)."""
    limit = f'  "max_tokens" : {max_tokens} ,' if max_tokens is not None else ""
    content = "hello" + " hello" * (n_tokens - 1)
    return f'{{"model":"{model}",{limit}"messages":[{{"role":"user","content":"{content}"}}]}}'.encode()


def send(url: str, content: bytes) -> httpx.Response:
    headers = {"authorization": f"Bearer {AGENT_KEY}", "content-type": "application/json"}
    return httpx.post(f"{url}/v1/chat/completions", content=content, headers=headers, timeout=30)


def upstream_for(servers: Servers) -> list[UpstreamConfig]:
    return [
        UpstreamConfig(
            name="test",
            base_url=f"{servers.upstream_url}/v1",
            default=True,
            provider="test",
            api_key_env="SIM_UPSTREAM_KEY",
        )
    ]


def test_a_request_that_does_not_fit_is_clamped_to_what_does(tmp_path, billing):
    cap = BudgetSettings(
        name="cap", limit_usd="0.03", period="total", action="block",
        degrade=DegradeSettings(clamp_output=True, min_output_tokens=100),
    )  # fmt: skip
    with serving(tmp_path / "l.duckdb", None, budgets=[cap], upstreams=upstream_for(billing)) as proxy:
        # A: fits as it is, (1007 x 2.50 + 1000 x 10.00) / 1M = $0.0125175, $0.0174825 left
        first = send(proxy.url, body(1000, 1000))
        assert first.status_code == 200 and "x-tokenward-degraded" not in first.headers
        # B sets no max_tokens: its worst case is 16384 out ($0.1663575). What fits: 2517.5 + 10 n <= 17482.5,
        # n = 1496 ($0.0174775); the body gets "max_tokens":1496, every other byte as sent
        clamped = send(proxy.url, body(1000, None))
        assert clamped.status_code == 200
        assert clamped.headers["x-tokenward-degraded"] == "max_tokens=1496;was=16384;budget=cap"
        assert clamped.headers["x-tokenward-cost-usd"] == "0.0174775"
        assert billing.requests[-1]["body"] == b'{"max_tokens":1496,' + body(1000, None)[1:]
        # C: $0.000005 left, not even 100 tokens out: refused
        refused = send(proxy.url, body(1000, 1000))
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exceeded"
        rows = proxy.rows(3)
    assert [(r["cost_usd"], r["degraded"], r["reserved_usd"]) for r in rows] == [
        (Decimal("0.0125175"), None, Decimal("0.0125175")),
        (Decimal("0.0174775"), "max_tokens 16384 -> 1496 (budget cap)", Decimal("0.0174775")),
        (Decimal(0), None, None),
    ]
    assert sum(r["cost_usd"] for r in rows) == Decimal("0.029995") <= Decimal("0.03")


def test_an_existing_limit_is_edited_in_place(tmp_path, billing):
    cap = BudgetSettings(
        name="cap", limit_usd="0.01", period="total", action="block", degrade=DegradeSettings(clamp_output=True)
    )
    with serving(tmp_path / "l.duckdb", None, budgets=[cap], upstreams=upstream_for(billing)) as proxy:
        # 2517.5 + 10 n <= 10000: n = 748 ($0.0099975)
        clamped = send(proxy.url, body(1000, 1000))
        assert clamped.headers["x-tokenward-degraded"] == "max_tokens=748;was=1000;budget=cap"
        assert billing.requests[-1]["body"] == body(1000, 1000).replace(b": 1000 ,", b": 748 ,")


def test_a_cheaper_model_is_checked_against_its_own_budgets_too(tmp_path, billing):
    # cap reroutes gpt-4o to gpt-4o-mini; the mini's own budget ($0.003) has no degrade and binds on its own.
    # gpt-4o: $0.0125175 as above; gpt-4o-mini: (1007 x 0.15 + 1000 x 0.60) / 1M = $0.00075105
    budgets = [
        BudgetSettings(
            name="cap", limit_usd="0.02", period="total", action="block",
            degrade=DegradeSettings(reroute={"gpt-4o": "gpt-4o-mini"}),
        ),
        BudgetSettings(name="mini", limit_usd="0.003", scope={"model": "gpt-4o-mini"}, period="total", action="block"),
    ]  # fmt: skip
    with serving(tmp_path / "l.duckdb", None, budgets=budgets, upstreams=upstream_for(billing)) as proxy:
        assert "x-tokenward-degraded" not in send(proxy.url, body(1000, 1000)).headers
        for _ in range(3):  # $0.0074825 left in cap: rerouted; mini: 3 x $0.00075105 = $0.00225315
            rerouted = send(proxy.url, body(1000, 1000))
            assert rerouted.headers["x-tokenward-degraded"] == "model=gpt-4o-mini;was=gpt-4o;budget=cap"
            assert rerouted.json()["model"] == "gpt-4o-mini"
            assert billing.requests[-1]["body"] == body(1000, 1000).replace(b'"gpt-4o"', b'"gpt-4o-mini"')
        # a fourth would take mini to $0.0030042: mini refuses, and it does not degrade
        assert send(proxy.url, body(1000, 1000)).status_code == 429
        rows = proxy.rows(5)
    assert [(r["requested_model"], r["served_model"], r["sent_model"], r["cost_usd"]) for r in rows[:2]] == [
        ("gpt-4o", "gpt-4o", None, Decimal("0.0125175")),
        ("gpt-4o", "gpt-4o-mini", "gpt-4o-mini", Decimal("0.00075105")),
    ]
    assert rows[1]["degraded"] == "model gpt-4o -> gpt-4o-mini (budget cap)"
    # the rerouted requests still count against cap: 0.0125175 + 3 x 0.00075105
    assert sum(r["cost_usd"] for r in rows) == Decimal("0.01477065")


def test_degrade_is_configured_on_blocking_budgets_only(tmp_path):
    for settings_, says in (
        (BudgetSettings(name="b", limit_usd=1, degrade=DegradeSettings(clamp_output=True)), "needs action: block"),
        (BudgetSettings(name="b", limit_usd=1, action="block", degrade=DegradeSettings()), "reroute or clamp_output"),
    ):
        with pytest.raises(ValueError, match=says):
            settings_.to_budgets()


# --- no sequence of requests spends past the limit, through either path ------------------------------

CATALOG = load_catalog([PRICES], builtin=False)
NOW = dt.datetime(2026, 11, 12, 10, 0, tzinfo=UTC)


def _worst(model: str, input_tokens: int, output: int) -> Decimal:
    bound = worst_case(
        CATALOG, model=model, provider="test", at=NOW, input_tokens=input_tokens, max_output_tokens=output
    )
    assert bound is not None
    return bound


def _cost(model: str, input_tokens: int, output: int) -> Decimal:
    resolution = CATALOG.resolve(model, "test", NOW, fallback=False, requested=model)
    return price(Usage(input_tokens=input_tokens, output_tokens=output), resolution, at=NOW).total


request = st.tuples(
    st.integers(0, 20_000),  # input tokens
    st.integers(1, 8_000),  # max output tokens
    st.sampled_from(["gpt-4o", "gpt-4o-mini"]),
    st.integers(0, 100),  # how much of the allowed output is used (percent)
    st.booleans(),  # settle the oldest request in flight before sending this one
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(request, max_size=40),
    limit=st.decimals(min_value=Decimal("0.001"), max_value=Decimal("0.5"), places=6),
    mini_limit=st.decimals(min_value=Decimal("0.0001"), max_value=Decimal("0.05"), places=6),
    mode=st.sampled_from(["clamp", "reroute", "both"]),
    floor=st.integers(1, 500),
)
def test_no_sequence_of_requests_spends_past_a_limit(steps, limit, mini_limit, mode, floor):
    policy = Degrade(
        reroute=(("gpt-4o", "gpt-4o-mini"),) if mode in ("reroute", "both") else (),
        clamp=mode in ("clamp", "both"),
        min_output_tokens=floor,
    )
    cap = Budget("cap", limit, period=Period("total"), action="block", degrade=policy)
    mini = Budget("mini", mini_limit, scope=(("model", "gpt-4o-mini"),), period=Period("total"), action="block")
    guard = BudgetGuard([cap, mini], NOW)
    spent = {"cap": Decimal(0), "mini": Decimal(0)}
    flight: list[tuple[object, str, int, int, int]] = []

    def settle() -> None:
        reservation, model, input_tokens, output, used = flight.pop(0)
        cost = _cost(model, input_tokens, output * used // 100)
        guard.release(reservation)
        guard.observe(
            {"started_at": NOW.timestamp(), "cost_usd": cost, "requested_model": model, "served_model": model}
        )
        spent["cap"] += cost
        spent["mini"] += cost if model == "gpt-4o-mini" else 0

    async def run() -> None:
        for input_tokens, output, model, used, settle_first in steps:
            if settle_first and flight:
                settle()
            attributes = {"model": (model,)}
            worst = _worst(model, input_tokens, output)
            try:
                flight.append((await guard.admit(attributes, worst, NOW), model, input_tokens, output, used))
                continue
            except BudgetRefusal:
                pass

            async def bound(to: str | None, tokens: int, size: int = input_tokens) -> Decimal | None:
                return _worst(to, size, tokens) if to is not None else None

            plan = await degrade(guard, attributes, worst, NOW, model=model, max_output_tokens=output, bound=bound)
            event(
                f"degraded: {'none' if plan is None else ('model' if plan.model else '') + ('tokens' if plan.max_output_tokens else '')}"
            )
            if plan is not None:
                sent = plan.model or model
                tokens = plan.max_output_tokens or output
                assert plan.worst_case == _worst(sent, input_tokens, tokens)
                assert tokens >= floor if plan.max_output_tokens is not None else True
                flight.append((plan.reservation, sent, input_tokens, tokens, used))
            for book in guard.standing({"model": ("gpt-4o", "gpt-4o-mini")}, NOW):
                assert book["spent_usd"] + book["reserved_usd"] <= book["budget"].limit_usd
        while flight:
            settle()

    asyncio.run(run())
    assert spent["cap"] <= limit and spent["mini"] <= mini_limit


def test_a_rerouted_row_counts_for_the_model_it_was_sent_to_after_a_restart_too(tmp_path):
    """The guard counts a row for its requested, sent and served models; the ledger's books must agree.

    A request for gpt-4o rerouted to gpt-4o-mini whose client left (no reply: no served model) keeps its
    $0.5 reservation as spend: against the gpt-4o-mini budget too, in the running proxy and after a restart.
    """
    from tokenward.proxy.guard import attributes_of_row
    from tokenward.reports.ledger import open_ledger, write_rows
    from tokenward.reports.ledger.spend import DuckSpend

    from .test_ledger import make_row

    mini = Budget("mini", Decimal(1), scope=(("model", "gpt-4o-mini"),), action="block")
    row = make_row(
        "r",
        requested_model="gpt-4o",
        sent_model="gpt-4o-mini",
        served_model=None,
        price_status="usage_unknown",
        cost_usd=None,
        reserved_usd=Decimal("0.5"),
        started_at=1_780_000_000.0,
    )
    assert mini.matches(attributes_of_row(row))  # in the running proxy
    path = tmp_path / "l.duckdb"
    write_rows(path, [row])
    conn = open_ledger(path, read_only=True)
    try:
        window = (dt.datetime(2020, 1, 1, tzinfo=UTC), dt.datetime(2030, 1, 1, tzinfo=UTC))
        assert DuckSpend(conn).spend_in(mini, *window) == Decimal("0.5")  # what a restart reads back
    finally:
        conn.close()


def test_an_azure_deployment_request_is_clamped_never_rerouted(tmp_path, billing):
    """Azure runs the deployment's model whatever the body names: a reroute would price a model never served.

    The same figures as the reroute test above: cap $0.02, the first gpt-4o request ($0.0125175) fits;
    the second no longer does at 1000 output tokens. A /v1 request would go to gpt-4o-mini; a deployment
    request is clamped instead: (0.02 - 0.0125175 - 1007 x 2.50 / 1M) / (10 / 1M) = 496 output tokens.
    """
    budgets = [
        BudgetSettings(
            name="cap", limit_usd="0.02", period="total", action="block",
            degrade=DegradeSettings(reroute={"gpt-4o": "gpt-4o-mini"}, clamp_output=True, min_output_tokens=100),
        )
    ]  # fmt: skip
    azure = [
        UpstreamConfig(
            name="azure", base_url=f"{billing.upstream_url}/openai", provider="azure", default=True,
            api_key_env="SIM_UPSTREAM_KEY", api_key_header="api-key", api_key_prefix="",
        )
    ]  # fmt: skip
    url_path = "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21"
    headers = {"api-key": AGENT_KEY, "content-type": "application/json"}
    with serving(tmp_path / "l.duckdb", None, budgets=budgets, upstreams=azure) as proxy:
        first = httpx.post(proxy.url + url_path, content=body(1000, 1000), headers=headers, timeout=30)
        assert first.status_code == 200 and "x-tokenward-degraded" not in first.headers
        second = httpx.post(proxy.url + url_path, content=body(1000, 1000), headers=headers, timeout=30)
        assert second.status_code == 200
        assert second.headers["x-tokenward-degraded"] == "max_tokens=496;was=1000;budget=cap"
        assert billing.requests[-1]["target"] == url_path
        assert b'"gpt-4o"' in billing.requests[-1]["body"]  # the model is left as the client sent it
        rows = proxy.rows(2)
    # 1007 x 2.50 + 496 x 10 = 7477.5 per 1M -> $0.0074775
    assert [(r["requested_model"], r["sent_model"], r["cost_usd"]) for r in rows] == [
        ("gpt-4o", None, Decimal("0.0125175")),
        ("gpt-4o", None, Decimal("0.0074775")),
    ]
