"""Helpers for the agent-budget tests: a proxy on a given ledger (so it can be restarted), recorded replies.

Prices are the test prices of ``tests/fixtures/field_case_prices.yaml`` (gpt-4o: $2.50 input and
$10.00 output per 1M tokens; gpt-4o-mini: $0.15 and $0.60), so every figure can be worked out by hand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tokenward.pricing.catalog import load_catalog
from tokenward.pricing.settings import GuardSettings
from tokenward.proxy.app import create_app
from tokenward.proxy.config import AuthConfig, Config, LedgerConfig, UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.server import running_in_thread
from tokenward.proxy.simulator import FAULT_HEADER, RECORD_HEADER

from .conftest import Proxy
from .test_budgets import register

PRICES = Path(__file__).parent / "fixtures" / "field_case_prices.yaml"
AGENT_KEY = "tw-agent-key-0001"
EXACT_COUNT = GuardSettings(input_margin=1, input_margin_tokens=0)
"""No margin for input the provider adds unseen: a worst case is the text's count and ``max_tokens``."""


def prompt(n_tokens: int, max_tokens: int | None, model: str = "gpt-4o") -> dict[str, Any]:
    """A chat request of ``n_tokens + 7`` input tokens (o200k_base; see test_budgets.long_prompt_request)."""
    request: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "hello" + " hello" * (n_tokens - 1)}],
    }
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    return request


def record(simulator: Any, name: str, prompt_tokens: int, completion_tokens: int) -> None:
    """Register a recorded non-streamed gpt-4o reply ``name`` with this usage (picked by the record header)."""
    # a body no real request has: the shared simulator also matches recordings by body
    register(simulator, name, {"model": "gpt-4o", "recording": name}, prompt_tokens, completion_tokens)


def upstream(simulator: Any) -> UpstreamConfig:
    """The simulator's ``test`` provider (priced by the test prices), with an upstream key."""
    return UpstreamConfig(
        name="test", base_url=f"{simulator.url}/test/v1", default=True, provider="test", api_key_env="SIM_UPSTREAM_KEY"
    )


def agent_key(**extra: Any) -> VirtualKeyConfig:
    """The ``agent`` key of team ``research``."""
    return VirtualKeyConfig(name="agent", key=AGENT_KEY, team="research", **extra)


@contextmanager
def serving(
    ledger: Path,
    simulator: Any,
    *,
    budgets: Any = (),
    keys: list[VirtualKeyConfig] | None = None,
    auth: AuthConfig | None = None,
    upstreams: list[UpstreamConfig] | None = None,
    guard: GuardSettings = EXACT_COUNT,
    **config: Any,
) -> Iterator[Proxy]:
    """A proxy on ``ledger`` in front of the simulator (or ``upstreams``), stopped (and flushed) on exit.

    Its guard counts input exactly (:data:`EXACT_COUNT`), so that worst cases can be worked out by hand.
    """
    settings = Config(
        guard=guard,
        upstreams=upstreams or [upstream(simulator)],
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        auth=auth or AuthConfig(mode="virtual_keys"),
        virtual_keys=keys if keys is not None else [agent_key()],
        budgets=list(budgets),
        **config,
    )
    app = create_app(settings, catalog=load_catalog([PRICES], builtin=False))
    with running_in_thread(app) as url:
        yield Proxy(url, app, ledger)


def post(url: str, request: dict[str, Any], record_name: str, key: str = AGENT_KEY, **headers: str) -> httpx.Response:
    """One chat request through the proxy, answered with recording ``record_name``."""
    sent = {"authorization": f"Bearer {key}", RECORD_HEADER: record_name, **headers}
    return httpx.post(f"{url}/v1/chat/completions", json=request, headers=sent, timeout=30)


async def post_many(
    url: str, requests: list[tuple[dict[str, Any], str, dict[str, str]]], wait_ms: int = 300
) -> list[httpx.Response]:
    """Send every ``(request, key, headers)`` at once; the upstream holds each ``wait_ms`` (all in flight)."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=len(requests))) as client:
        return await asyncio.gather(
            *(
                client.post(
                    f"{url}/v1/chat/completions",
                    json=request,
                    headers={"authorization": f"Bearer {key}", FAULT_HEADER: f"wait:{wait_ms}", **headers},
                )
                for request, key, headers in requests
            )
        )
