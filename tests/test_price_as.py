"""Price pins: an upstream's ``price_as`` and ``pricing.price_as`` win over the reply's model.

Prices: tests/fixtures/field_case_prices.yaml (test prices, USD per 1M tokens).
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import httpx

from tokenward.pricing.catalog import load_catalog
from tokenward.pricing.quote import quote
from tokenward.pricing.settings import PricingSettings, build_catalog
from tokenward.pricing.usage import Usage
from tokenward.proxy.config import UpstreamConfig
from tokenward.proxy.simulator import RECORD_HEADER, Recording

PRICES = Path(__file__).parent / "fixtures" / "field_case_prices.yaml"
AT = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)
# field case B09's usage: 102 uncached + 2048 cached in, 120 out
B09 = {"prompt_tokens": 2150, "completion_tokens": 120, "prompt_tokens_details": {"cached_tokens": 2048}}


def test_pins_resolve_before_the_served_model():
    catalog = load_catalog([PRICES], builtin=False, price_as={"Prod-Deploy": "gpt-4o"})
    served = "gpt-4o-mini-2024-07-18"
    assert catalog.resolve(served, "test", AT).entry.id == "test/gpt-4o-mini"  # no pin: the reply's model
    pinned = catalog.resolve(served, "test", AT, requested="prod-deploy")
    assert (pinned.entry.id, pinned.how) == ("test/gpt-4o", "price_as_model")
    upstream = catalog.resolve(served, "test", AT, requested="prod-deploy", price_as="o1")
    assert (upstream.entry.id, upstream.how) == ("test/o1", "price_as_upstream")  # the upstream's pin wins
    # a pin naming an unknown model leaves the request unpriced (never priced as what the reply said)
    assert catalog.resolve(served, "test", AT, price_as="gpt-9") is None


def test_pricing_settings_carry_the_pins_into_the_catalog():
    settings = PricingSettings(files=[str(PRICES)], price_as={"eu-deployment": "gpt-4o"})
    catalog = build_catalog(settings)
    usage = Usage(input_tokens=2150, cached_input_tokens=2048, output_tokens=120)
    priced = quote(catalog, usage, model="gpt-4.1", provider="test", at=AT, requested="eu-deployment")
    # as gpt-4o: 102 x 2.50 + 2048 x 1.25 + 120 x 10.00, per 1M = $0.004015
    assert (priced.status, priced.cost_usd, priced.resolved_by) == ("priced", Decimal("0.004015"), "price_as_model")
    # unpinned, as the served gpt-4.1: 102 x 2.00 + 2048 x 0.50 + 120 x 8.00, per 1M = $0.002188
    plain = quote(catalog, usage, model="gpt-4.1", provider="test", at=AT, requested="another-deployment")
    assert (plain.cost_usd, plain.resolved_by) == (Decimal("0.002188"), "exact")


def register(simulator, name, request, model):
    body = {"id": name, "object": "chat.completion", "model": model, "choices": [], "usage": B09}
    response = {"status": 200, "content_type": "application/json", "body": body}
    simulator.simulator.add(
        Recording(name, "test", "openai", "chat_completions", False, {"body": request}, response, None)
    )


def test_an_azure_deployment_is_priced_as_its_pinned_base_model(start_proxy, simulator):
    azure = UpstreamConfig(
        name="azure",
        base_url=f"{simulator.url}/azure/v1",
        provider="test",
        default=True,
        price_as="gpt-4o",
        unpriced="block",
    )
    proxy = start_proxy(upstreams=[azure], catalog=load_catalog([PRICES], builtin=False))
    request = {"model": "contoso-chat-prod", "messages": [{"role": "user", "content": "refund window?"}]}
    register(simulator, "azure-pinned", request, "gpt-4o-mini-2024-07-18")  # the reply names another model
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json=request, headers={RECORD_HEADER: "azure-pinned"})
    assert reply.status_code == 200  # unpriced: block does not refuse a deployment with a pinned price
    (row,) = proxy.rows(1)
    assert (row["requested_model"], row["served_model"]) == ("contoso-chat-prod", "gpt-4o-mini-2024-07-18")
    # field case B09 at gpt-4o's rates: 102 x 2.50 + 2048 x 1.25 + 120 x 10.00, per 1M = $0.004015
    assert (row["price_entry_id"], row["price_resolved_by"], row["cost_usd"]) == (
        "test/gpt-4o",
        "price_as_upstream",
        Decimal("0.004015"),
    )


def test_a_requested_model_pin_applies_through_the_proxy(start_proxy, simulator):
    from .conftest import upstreams_for

    catalog = load_catalog([PRICES], builtin=False, price_as={"prod-gpt4o": "gpt-4o"})
    proxy = start_proxy(upstreams=upstreams_for(simulator.url, ["test"]), catalog=catalog)
    request = {"model": "prod-gpt4o", "messages": [{"role": "user", "content": "hello"}]}
    register(simulator, "model-pinned", request, "gpt-4.1")
    httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=request,
        headers={RECORD_HEADER: "model-pinned", "x-tokenward-upstream": "test"},
    )
    (row,) = proxy.rows(1)
    assert (row["served_model"], row["price_entry_id"], row["price_resolved_by"], row["cost_usd"]) == (
        "gpt-4.1",
        "test/gpt-4o",
        "price_as_model",
        Decimal("0.004015"),
    )


def test_reprice_keeps_pins_and_repair_flags(tmp_path):
    from tokenward.proxy.exchange import Exchange, Outcome
    from tokenward.proxy.recorder import build_row
    from tokenward.reports.ledger import open_ledger, write_rows
    from tokenward.reports.reprice import reprice

    catalog = load_catalog([PRICES], builtin=False, price_as={"prod-gpt4o": "gpt-4o"})
    usage = Usage(input_tokens=2150, cached_input_tokens=2048, output_tokens=120)
    rows = []
    for request_id, requested, pin, repairs in (
        ("upstream-pin", "contoso-chat-prod", "gpt-4o", ()),
        ("model-pin", "prod-gpt4o", None, ()),
        ("repaired", "gpt-4.1", None, ("R1: test",)),
    ):
        ex = Exchange(endpoint="chat_completions", method="POST", path="/v1/chat/completions", request_id=request_id)
        ex.requested_model, ex.served_model, ex.provider, ex.price_as = requested, "gpt-4.1", "test", pin
        ex.usage = Usage(
            **{k: getattr(usage, k) for k in ("input_tokens", "cached_input_tokens", "output_tokens")}, repairs=repairs
        )
        ex.end(Outcome.OK, 200)
        rows.append(build_row(ex, catalog))
    ledger = tmp_path / "l.duckdb"
    write_rows(ledger, rows)
    conn = open_ledger(ledger)
    result = reprice(conn, catalog)
    stored = conn.execute(
        "SELECT request_id, price_status, price_entry_id, cost_usd FROM requests ORDER BY 1"
    ).fetchall()
    conn.close()
    assert (result.rows_checked, result.rows_changed) == (3, 0)  # nothing moves: pins and flags survive
    # pinned rows at gpt-4o (B09: $0.004015), the repaired one at the served gpt-4.1 ($0.002188), still flagged
    assert stored == [
        ("model-pin", "priced", "test/gpt-4o", Decimal("0.004015")),
        ("repaired", "repaired", "test/gpt-4.1", Decimal("0.002188")),
        ("upstream-pin", "priced", "test/gpt-4o", Decimal("0.004015")),
    ]
