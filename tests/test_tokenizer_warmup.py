"""The tokenizer's rank file (about a second of CPU, ~70 MB of memory) is read only when a count needs it, off the loop.

With a blocking budget, a request is counted when the budget is near its limit. Before, the first
such count read ``o200k_base`` on the event loop (small bodies are counted there), which stalled
every connection for that second, more on a loaded machine: clients with short timeouts gave up.
Now a count that finds its encoding not yet read goes to a worker thread, and the loop goes on.
Far from the limit the request is bounded by its bytes and the tokenizer is never read: reading
it at start instead (tried) raised the idle RSS of a proxy with a budget from 108 to 183 MB.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy import tokenizer
from tokenward.proxy.app import create_app
from tokenward.proxy.config import Config, LedgerConfig, UpstreamConfig
from tokenward.proxy.server import running_in_thread

from .conftest import read_rows
from .servers import Servers

LOOP_THREAD = "tokenward-proxy"  # the thread running_in_thread serves the proxy's event loop in


async def chat_reply(request: web.Request, body: bytes) -> web.StreamResponse:
    return web.json_response(
        {
            "id": "chatcmpl-warm",
            "object": "chat.completion",
            "model": "gpt-4o-mini-2024-07-18",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 10, "total_tokens": 1010},
        }
    )


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that read a rank file, with no encoding loaded to start with."""
    monkeypatch.setattr(tokenizer, "_loaded", {})
    seen: list[str] = []
    original = tokenizer.get_encoding

    def recording(name: str) -> Any:
        if not tokenizer.is_loaded(name):
            seen.append(threading.current_thread().name)
        return original(name)

    monkeypatch.setattr(tokenizer, "get_encoding", recording)
    return seen


@contextmanager
def proxy_with_a_blocking_budget(
    tmp_path: Path, upstream_url: str, limit: Decimal = Decimal("10")
) -> Iterator[tuple[str, Path]]:
    ledger = tmp_path / "ledger.duckdb"
    config = Config(
        upstreams=[
            UpstreamConfig(name="openai", base_url=f"{upstream_url}/v1", provider="openai", api_key_env="WARM_KEY")
        ],
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        budgets=[BudgetSettings(name="cap", limit_usd=limit, period="total", action="block")],
    )
    with running_in_thread(create_app(config)) as url:
        yield url, ledger


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARM_KEY", "sk-upstream")


def test_a_budget_far_from_its_limit_never_reads_the_tokenizer(tmp_path, loads):
    body = {"model": "gpt-4o-mini", "max_tokens": 10, "messages": [{"role": "user", "content": "hello " * 50}]}
    with (
        Servers(chat_reply).running() as servers,
        proxy_with_a_blocking_budget(tmp_path, servers.upstream_url) as (
            url,
            _,
        ),
    ):
        reply = httpx.post(
            f"{url}/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-c"}, timeout=30
        )
        assert reply.status_code == 200, reply.text
    # $10 left: the bound by bytes ($0.0001675, below) is under 1 % of it, so nothing is counted
    assert loads == [] and not tokenizer.is_loaded("o200k_base")


def test_the_first_count_reads_the_tokenizer_in_a_worker_thread(tmp_path, loads):
    body = {"model": "gpt-4o-mini", "max_tokens": 10, "messages": [{"role": "user", "content": "hello " * 50}]}
    # $0.0003 left: the bound by bytes (300 bytes of text: ceil(300 x 1.1) + 300 = 630 in at the priority
    # $0.25 + 10 out at $1.00 per 1M = $0.0001675) is over guard.bytes_bound_share (0.01) of it, so the text is counted
    limit = Decimal("0.0003")
    with (
        Servers(chat_reply).running() as servers,
        proxy_with_a_blocking_budget(tmp_path, servers.upstream_url, limit) as (
            url,
            ledger,
        ),
    ):
        assert not tokenizer.is_loaded("o200k_base")
        reply = httpx.post(
            f"{url}/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-c"}, timeout=30
        )
        assert reply.status_code == 200, reply.text
    assert len(loads) == 1 and loads[0] != LOOP_THREAD  # read for the bound, in a worker thread
    (row,) = read_rows(ledger)
    # the upstream's usage is billed: 1000 x $0.15 + 10 x $0.60 per 1M (gpt-4o-mini) = $0.000156
    assert row["input_tokens"] == 1000 and row["output_tokens"] == 10 and row["cost_usd"] == Decimal("0.000156")
