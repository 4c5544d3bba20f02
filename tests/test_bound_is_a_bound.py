"""The bound is a bound: 100 concurrent requests against a budget with room for 10, in five variants.

Each variant runs a real proxy in front of a real upstream (aiohttp on loopback) that bills the
worst plausible amount for what it is sent, and checks two sums against the budget's limit: what
the upstream billed, and what the ledger records as spend (costs, plus the reservation a
``usage_unknown`` row keeps). The limit is ten times what one request really costs at the
provider, so a bound that is a true upper bound admits at most ten requests.

Prices (builtin catalog, USD per 1M tokens): gpt-4o-mini input 0.15, output 0.60, priority
input 0.25, output 1.00; gpt-4o input 2.50, output 10.00.

Counts (o200k_base): ``long_chat(1000)`` is 1000 text tokens + 7 of chat overhead = 1007; the
recorded Responses request of ``HIDDEN_REQUEST`` counts 99 tokens (its text, its tool calls' arguments
and outputs, and its tool's JSON)
and OpenAI billed 335 input tokens for it.

The bound a request gets (``guard`` defaults): counted input x ``input_margin`` 1.1, rounded up,
+ ``input_margin_tokens`` 300, + each image's ``image_tokens_max`` from the catalog (gpt-4o-mini
48,169), priced at the dearest rate and tier the request could be billed at.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from tokenward.pricing.catalog import load_catalog
from tokenward.pricing.quote import quote, worst_case
from tokenward.pricing.settings import BudgetSettings, GuardSettings
from tokenward.pricing.usage import Usage
from tokenward.proxy.app import create_app
from tokenward.proxy.config import AuthConfig, Config, LedgerConfig, ServerConfig, UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.server import running_in_thread

from .conftest import read_rows
from .servers import Servers

KEY = "tw-bound-key-0001"
CATALOG = load_catalog()
HIDDEN_REQUEST = json.loads((Path(__file__).parent / "fixtures" / "hidden_input_request.json").read_text())
SHOW = os.environ.get("TOKENWARD_SHOW_OVERSHOOT") == "1"  # print the figures (and do not assert)


def long_chat(n_tokens: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A gpt-4o-mini chat request whose input counts n_tokens + 7 ("hello" + (n-1) x " hello")."""
    return {
        "model": "gpt-4o-mini",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hello" + " hello" * (n_tokens - 1)}],
        **extra,
    }


def no_limit_chat() -> dict[str, Any]:
    """``long_chat(1000, ...)`` with no output limit at all."""
    body = long_chat(1000, 0, service_tier="default")
    del body["max_tokens"]
    return body


def image_chat() -> dict[str, Any]:
    """10 text tokens + 7 overhead and one image (a data URL), 100 tokens of output at most."""
    return {
        "model": "gpt-4o-mini",
        "max_tokens": 100,
        "service_tier": "default",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hello" + " hello" * 9},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "high"}},
                ],
            }
        ],
    }


class BillingUpstream:
    """An OpenAI-shaped upstream that bills the worst plausible amount for each request it receives.

    ``billed`` collects the USD billed per request (priced with the builtin catalog at the tier it
    served), appended as soon as the request arrives: the provider bills whether or not anybody
    reads the reply.
    """

    def __init__(self, variant: str, wait_s: float = 0.3) -> None:
        self.variant = variant
        self.wait_s = wait_s
        self.billed: list[Decimal] = []
        self.bodies: list[dict[str, Any]] = []

    def _bill(self, model: str, usage: Usage, tier: str) -> Decimal:
        priced = quote(CATALOG, usage, model=model, provider="openai", at=dt.datetime.now(dt.UTC), service_tier=tier)
        assert priced.cost_usd is not None, model
        return priced.cost_usd

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        document = json.loads(body)
        self.bodies.append(document)
        variant = self.variant
        tier = "default"
        if variant == "dearer_tier":  # the project's default tier is priority: `auto` is served there
            usage, tier = Usage(input_tokens=1007, output_tokens=1000), "priority"
        elif variant == "image_heavy":  # a 768x2048 image: 8 tiles x 5667 + 2833 = 48,169 tokens at gpt-4o-mini
            usage = Usage(input_tokens=17 + 48169, image_input_tokens=48169, output_tokens=100)
        elif variant == "hidden_input":  # what OpenAI billed for this request (recorded), all 20 tokens out
            usage = Usage(input_tokens=335, output_tokens=20)
        elif variant == "client_gone":  # the whole reply is generated and billed; nobody reads it
            usage = Usage(input_tokens=1007, output_tokens=1000)
        elif variant == "two_limits":  # an upstream that reads max_tokens and ignores max_completion_tokens
            usage = Usage(input_tokens=1007, output_tokens=document["max_tokens"])
        elif variant == "prediction":  # every token of the 1,000-token prediction rejected: billed as output
            usage = Usage(input_tokens=17, output_tokens=document["max_tokens"] + 1000)
        elif variant == "no_limit":  # a model that writes until its own window (100K) unless the request says less
            usage = Usage(input_tokens=1007, output_tokens=document.get("max_completion_tokens", 100_000))
        else:  # unpriced: the provider has its own price for its own model: $0.001 a request
            usage = Usage(input_tokens=1007, output_tokens=1000)
        model = document["model"]
        self.billed.append(Decimal("0.001") if variant == "unpriced" else self._bill(model, usage, tier))
        await asyncio.sleep(self.wait_s)
        counts = {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}
        if request.path.endswith("/responses"):
            return web.json_response(
                {"id": "resp_1", "object": "response", "status": "completed", "model": model,
                 "service_tier": tier, "error": None, "output": [],
                 "usage": {**counts, "total_tokens": sum(counts.values())}}
            )  # fmt: skip
        return web.json_response(
            {"id": "c1", "object": "chat.completion", "model": model, "service_tier": tier,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
             "usage": {"prompt_tokens": usage.input_tokens, "completion_tokens": usage.output_tokens,
                       "total_tokens": usage.input_tokens + usage.output_tokens,
                       "prompt_tokens_details": {"image_tokens": usage.image_input_tokens}}}
        )  # fmt: skip


@contextmanager
def proxy_for(upstream_url: str, tmp_path: Path, limit: Decimal, **guard: Any) -> Iterator[tuple[str, Path]]:
    """A proxy with one blocking total budget of ``limit`` USD in front of ``upstream_url``."""
    ledger = tmp_path / "ledger.duckdb"
    config = Config(
        upstreams=[UpstreamConfig(name="openai", base_url=f"{upstream_url}/v1", provider="openai", api_key_env="BOUND_KEY")],
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        auth=AuthConfig(mode="virtual_keys"),
        virtual_keys=[VirtualKeyConfig(name="agent", key=KEY)],
        budgets=[BudgetSettings(name="room-for-ten", limit_usd=limit, period="total", action="block")],
        guard=GuardSettings(**guard),
        server=ServerConfig(drain_after_disconnect_s=0.3),
    )
    app = create_app(config)
    context = running_in_thread(app)
    url = context.__enter__()
    try:
        yield url, ledger
    finally:
        context.__exit__(None, None, None)


async def fire(
    url: str, path: str, body: dict[str, Any], count: int, leave_once: BillingUpstream | None = None
) -> list[Any]:
    """``count`` concurrent requests; the replies (or exceptions), in order.

    With ``leave_once``, the clients still waiting hang up (their requests are cancelled, so
    their connections close) as soon as every other request has its reply and each waiting one
    has reached that upstream: a condition, not a client timeout, which on a loaded machine
    also expired before a request was even sent (a ``ConnectTimeout``: no request, no row).
    """
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=count)) as client:
        tasks = [asyncio.ensure_future(client.post(f"{url}/v1/{path}", json=body, headers=headers)) for _ in range(count)]
        if leave_once is not None:
            deadline = time.monotonic() + 30
            while sum(not t.done() for t in tasks) > len(leave_once.bodies) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            for task in tasks:
                task.cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)


def spend_of(rows: list[dict[str, Any]]) -> Decimal:
    """What the ledger counts against the budget: costs, and what ``usage_unknown`` rows hold."""
    total = Decimal(0)
    for row in rows:
        if row["cost_usd"] is not None:
            total += row["cost_usd"]
        elif row["price_status"] in ("usage_unknown", "unpriced") and row["reserved_usd"] is not None:
            total += row["reserved_usd"]
    return total


# (variant, path, body, real cost of one request at the provider, requests admitted by the bound)
VARIANTS = [
    # priority: 1007 x 0.25 + 1000 x 1.00 = 1251.75 -> $0.00125175. Bound: ceil(1007 x 1.1) + 300 = 1408 in at
    # the priority rate (the request pins no tier): 1408 x 0.25 + 1000 x 1.00 = $0.001352; 0.0125175 / 0.001352
    # -> 9 admitted. (Standard-tier bound, before: 1007 x 0.15 + 1000 x 0.60 = $0.00075105: 16 admitted, +60 %.)
    ("dearer_tier", "chat/completions", long_chat(1000, 1000), Decimal("0.00125175"), 9),
    # 48,186 x 0.15 + 100 x 0.60 = 7287.9 -> $0.0072879. Bound: ceil(17 x 1.1) + 300 + 48,169 = 48,488 in:
    # 48,488 x 0.15 + 100 x 0.60 = $0.0073332 -> 0.072879 / 0.0073332 -> 9 admitted. (Before: 3000 per image,
    # 3017 x 0.15 + 60 = $0.00051255: all 100 admitted, +900 %.)
    ("image_heavy", "chat/completions", image_chat(), Decimal("0.0072879"), 9),
    # 335 x 2.50 + 20 x 10.00 = 1037.5 -> $0.0010375. Bound: ceil(99 x 1.1) + 300 = 409 in:
    # 409 x 2.50 + 200 = $0.0012225 -> 0.010375 / 0.0012225 -> 8 admitted. (Without the calls' arguments and
    # outputs, 56 counted: 362 x 2.50 + 200 = $0.001105, 9 admitted.) (Before: 56 x 2.50 + 200 = $0.00034:
    # 30 admitted, +200 %.)
    ("hidden_input", "responses", HIDDEN_REQUEST, Decimal("0.0010375"), 8),
    # 1007 x 0.15 + 1000 x 0.60 = $0.00075105 billed although the client left. Bound: 1408 x 0.15 + 600
    # = $0.0008112 -> 9 admitted, each keeping its $0.0008112 as spend (usage_unknown).
    ("client_gone", "chat/completions", long_chat(1000, 1000, service_tier="default"), Decimal("0.00075105"), 9),
    # max_completion_tokens 1 beside max_tokens 1000, to an upstream that honours max_tokens: 1007 x 0.15 +
    # 1000 x 0.60 = $0.00075105. Bound at the larger limit: 1408 x 0.15 + 600 = $0.0008112 -> 9 admitted.
    # (Bound at the first field, before: 1408 x 0.15 + 0.60 = $0.0002118: 35 admitted, +250 %.)
    (
        "two_limits",
        "chat/completions",
        long_chat(1000, 1000, max_completion_tokens=1, service_tier="default"),
        Decimal("0.00075105"),
        9,
    ),
    # no output limit: the bound assumes guard.default_max_output_tokens 16,384 and sends it as
    # max_completion_tokens, so the upstream writes at most that: 1007 x 0.15 + 16,384 x 0.60 = 9981.45
    # -> $0.00998145. Bound: 1408 x 0.15 + 16,384 x 0.60 = $0.0100416 -> 9 admitted. (Before, the body went
    # unchanged: 9 admitted, each billed 1007 x 0.15 + 100,000 x 0.60 = $0.06015105, +442 %.)
    ("no_limit", "chat/completions", no_limit_chat(), Decimal("0.00998145"), 9),
    # Predicted Outputs: 10 tokens of output at most, and a 1,000-token prediction the reply does not use;
    # OpenAI bills the rejected prediction tokens as completion tokens: 17 x 0.15 + 1010 x 0.60 = 608.55
    # -> $0.00060855. Bound: ceil(17 x 1.1) + 300 = 319 in, 10 + ceil(1000 x 1.1) = 1110 out: 47.85 + 666
    # = $0.00071385 -> 0.0060855 / 0.00071385 -> 8 admitted. (Before, the prediction was not bounded:
    # 47.85 + 6 = $0.00005385: all 100 admitted, billed $0.060855, +900 %.)
    (
        "prediction",
        "chat/completions",
        long_chat(10, 10, service_tier="default", prediction={"type": "content", "content": "hello" + " hello" * 999}),
        Decimal("0.00060855"),
        8,
    ),
    # no price: refused (400 model_not_priced) before it reaches the provider. (Before: all 100 admitted.)
    ("unpriced", "chat/completions", long_chat(1000, 1000, model="house-model-x"), Decimal("0.001"), 0),
]


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOUND_KEY", "sk-upstream")


@pytest.mark.parametrize(("variant", "path", "body", "real", "admitted"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_hundred_concurrent_requests_never_overshoot_room_for_ten(tmp_path, variant, path, body, real, admitted):
    limit = real * 10
    # client_gone: the clients hang up once the refusals are back and the admitted requests are at an
    # upstream that answers after 5 s
    upstream = BillingUpstream(variant, wait_s=5.0 if variant == "client_gone" else 0.3)
    gone = upstream if variant == "client_gone" else None
    with Servers(upstream.handle).running() as servers, proxy_for(servers.upstream_url, tmp_path, limit) as (url, ledger):
        replies = asyncio.run(fire(url, path, body, 100, leave_once=gone))
        if variant == "client_gone":
            time.sleep(1.0)  # tokenward waits 0.3 s for the upstream after the client left, then gives up
    rows = read_rows(ledger)
    billed = sum(upstream.billed, Decimal(0))
    recorded = spend_of(rows)
    refused = sum(isinstance(r, httpx.Response) and r.status_code in (400, 429) for r in replies)
    if SHOW:
        print(
            f"\n{variant}: limit ${limit}, admitted {len(upstream.billed)}, refused {refused}, billed ${billed} "
            f"({(billed - limit) / limit * 100:+.0f} %), recorded ${recorded} ({(recorded - limit) / limit * 100:+.0f} %)"
        )
        return
    assert len(rows) == 100
    assert len(upstream.billed) == admitted and refused == 100 - admitted
    assert billed <= limit and recorded <= limit
    assert billed == real * admitted


def test_an_unpriced_model_held_at_a_configured_price_counts_what_it_holds(tmp_path):
    # guard.unpriced_hold_usd $0.001 (the provider's real price here): room for ten holds of $0.001
    limit = Decimal("0.01")
    upstream = BillingUpstream("unpriced")
    body = long_chat(1000, 1000, model="house-model-x")
    with Servers(upstream.handle).running() as servers, proxy_for(
        servers.upstream_url, tmp_path, limit, unpriced_hold_usd=Decimal("0.001")
    ) as (url, ledger):
        replies = asyncio.run(fire(url, "chat/completions", body, 100))
    rows = read_rows(ledger)
    assert sum(r.status_code == 200 for r in replies) == 10 and len(upstream.billed) == 10
    # each admitted row is unpriced (cost NULL) and keeps its $0.001 hold as spend: exactly the limit
    unpriced = [r for r in rows if r["price_status"] == "unpriced"]
    assert len(unpriced) == 10 and all(r["reserved_usd"] == Decimal("0.001") for r in unpriced)
    assert spend_of(rows) == limit and sum(upstream.billed, Decimal(0)) == limit


def test_the_bound_prices_the_dearest_tier_a_request_can_be_served_at():
    when = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)

    def bound(**kwargs: Any) -> Decimal | None:
        return worst_case(
            CATALOG, model="gpt-4o-mini", provider="openai", at=when, input_tokens=1000, max_output_tokens=1000, **kwargs
        )

    # gpt-4o-mini: standard 0.15 / 0.60, priority 0.25 / 1.00, batch 0.5x (never served unasked)
    assert bound() == Decimal("0.00125")  # no tier asked: priority, 1000 x 0.25 + 1000 x 1.00
    assert bound(service_tier="auto") == Decimal("0.00125")
    assert bound(service_tier="default") == Decimal("0.00075")  # pinned: 150 + 600
    assert bound(service_tier="priority") == Decimal("0.00125")
    assert bound(service_tier="flex") == Decimal("0.00075")  # no flex price in the entry: standard rates
    # one image: gpt-4o-mini's image_tokens_max 48,169 at the input rate, on top of the 1000 counted
    assert bound(service_tier="default", images=1) == Decimal("0.00797535")  # 49,169 x 0.15 + 600


def test_a_request_without_an_output_limit_is_sent_the_one_its_bound_assumed(tmp_path):
    upstream = BillingUpstream("no_limit", wait_s=0)
    with Servers(upstream.handle).running() as servers:
        with proxy_for(servers.upstream_url, tmp_path, Decimal(1)) as (url, _):
            chat, embed = (
                httpx.post(f"{url}/v1/{path}", json=body, headers={"authorization": f"Bearer {KEY}"})
                for path, body in (
                    ("chat/completions", no_limit_chat()),
                    ("embeddings", {"model": "text-embedding-3-small", "input": "hello"}),
                )
            )
        with proxy_for(servers.upstream_url, tmp_path / "off", Decimal(1), set_output_limit=False) as (url, _):
            unchanged = httpx.post(
                f"{url}/v1/chat/completions", json=no_limit_chat(), headers={"authorization": f"Bearer {KEY}"}
            )
    assert chat.headers["x-tokenward-output-limit"] == "max_completion_tokens=16384"
    assert upstream.bodies[0]["max_completion_tokens"] == 16384 and "max_tokens" not in upstream.bodies[0]
    assert upstream.bodies[1] == {"model": "text-embedding-3-small", "input": "hello"}  # embeddings untouched
    assert "x-tokenward-output-limit" not in embed.headers
    assert upstream.bodies[2] == no_limit_chat() and "x-tokenward-output-limit" not in unchanged.headers
