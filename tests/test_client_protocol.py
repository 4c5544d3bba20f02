"""What real clients read from tokenward's own replies: the ``anthropic`` and ``openai`` SDKs, Claude Code's requests.

The Anthropic SDK and Claude Code read an error as ``{"type": "error", "error": {"type", "message"}}``
with ``error.type`` from Anthropic's vocabulary (``rate_limit_error``, ``authentication_error``, ...);
OpenAI's SDK reads ``{"error": {"message", "type", "param", "code"}}``. tokenward answers a request in
Anthropic's dialect with both at once, and every refusal still gets its one ledger row.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Proxy
from tests.servers import Servers, api
from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.app import create_app
from tokenward.proxy.config import AuthConfig, Config, LedgerConfig, UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.server import running_in_thread

KEY = "tw-claude-code-0123456789"
CLAUDE = {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    with Servers(api).running() as running:
        yield running


@contextmanager
def start(servers: Servers, ledger: Path, **config: Any) -> Iterator[Proxy]:
    config = {
        "upstreams": [
            UpstreamConfig(
                name="openai", base_url=f"{servers.upstream_url}/openai/v1", provider="openai", default=True
            ),
            UpstreamConfig(
                name="anthropic",
                base_url=f"{servers.upstream_url}/anthropic/v1",
                provider="anthropic",
                models=["claude-*"],
            ),
        ],
        "ledger": LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        **config,
    }
    app = create_app(Config(**config))
    with running_in_thread(app) as url:
        yield Proxy(url, app, ledger)


def anthropic_error(kind: str, message: str, code: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message, "param": None, "code": code}}


def test_a_budget_refusal_reaches_the_anthropic_sdk_as_anthropics_rate_limit_error_and_is_not_retried(
    servers, tmp_path
):
    """Before: ``{"error": {"type": "insufficient_quota", ...}}``: the SDK's ``err.type`` named no Anthropic type."""
    budget = BudgetSettings(name="tiny", limit_usd="0.000001", period="day", action="block")
    with start(servers, tmp_path / "l.duckdb", budgets=[budget]) as proxy:
        sent = len(servers.requests)
        with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-client") as claude:  # 2 retries by default
            with pytest.raises(anthropic.RateLimitError) as refused:
                claude.messages.create(**CLAUDE)
        (row,) = proxy.rows(1)
    error = refused.value
    assert error.type == "rate_limit_error" and error.api_message.startswith("Budget 'tiny'")
    assert error.body == anthropic_error("rate_limit_error", error.api_message, "budget_exceeded")
    assert error.response.headers["x-should-retry"] == "false"  # so the SDK tried once: one row, nothing sent
    assert servers.requests[sent:] == []
    assert (row["endpoint"], row["http_status"], row["outcome"], row["cost_usd"]) == (
        "anthropic_messages",
        429,
        "rejected",
        0,
    )


def test_an_unknown_key_reaches_claude_codes_async_client_as_an_authentication_error(servers, tmp_path):
    """Claude Code (the async SDK, ``anthropic-beta`` header) tells a user to log in on ``authentication_error``."""

    async def ask() -> anthropic.AuthenticationError:
        async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="tw-nobody-000000", max_retries=0) as claude:
            with pytest.raises(anthropic.AuthenticationError) as refused:
                await claude.beta.messages.count_tokens(
                    model="claude-sonnet-4-5",
                    messages=[{"role": "user", "content": "hi"}],
                    betas=["claude-code-20250219"],
                )
            return refused.value

    auth = AuthConfig(mode="virtual_keys")
    with start(servers, tmp_path / "l.duckdb", auth=auth, virtual_keys=[VirtualKeyConfig(name="cc", key=KEY)]) as proxy:
        error = asyncio.run(ask())
        (row,) = proxy.rows(1)
    assert error.type == "authentication_error" and error.body["type"] == "error"
    assert error.body["error"]["code"] == "invalid_api_key" and error.body["error"]["message"] == error.api_message
    assert (row["path"], row["http_status"], row["outcome"]) == ("/v1/messages/count_tokens", 401, "unauthorized")


@pytest.mark.parametrize(
    ("path", "headers", "anthropic_shape"),
    [
        ("/v1/messages", {"x-api-key": "sk-ant-client"}, True),
        ("/v1/messages", {"authorization": "Bearer sk-client"}, True),  # the path is Anthropic's
        ("/v1/messages", {"authorization": "Bearer oauth-token", "anthropic-beta": "oauth-2025-04-20"}, True),
        # Anthropic's OpenAI-compatible endpoint through its SDK's headers: Anthropic's SDK reads the reply
        ("/v1/chat/completions", {"authorization": "Bearer sk-client", "anthropic-version": "2023-06-01"}, True),
        ("/v1/chat/completions", {"authorization": "Bearer sk-client"}, False),
        ("/v1/responses", {"authorization": "Bearer sk-client"}, False),
    ],
)
def test_bad_json_is_refused_in_the_shape_of_the_dialect_the_client_speaks(
    servers, tmp_path, path, headers, anthropic_shape
):
    with start(servers, tmp_path / "l.duckdb") as proxy:
        reply = httpx.post(
            f"{proxy.url}{path}", content=b'{"model": ', headers={**headers, "content-type": "application/json"}
        )
        (row,) = proxy.rows(1)
    assert reply.status_code == 400 and reply.headers["content-type"] == "application/json"
    document = reply.json()
    error = document["error"]
    assert error["code"] == "invalid_json" and error["param"] is None and error["message"]
    if anthropic_shape:
        assert document == anthropic_error("invalid_request_error", error["message"], "invalid_json")
    else:
        assert document == {
            "error": {
                "message": error["message"],
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_json",
            }
        }
    assert (row["http_status"], row["outcome"]) == (400, "client_error")


def test_the_openai_sdk_still_reads_code_and_message_from_an_anthropic_shaped_refusal(servers, tmp_path):
    """A request with an Anthropic header through the OpenAI SDK gets both shapes: ``code`` and ``message`` read as before."""
    budget = BudgetSettings(name="tiny", limit_usd="0.000001", period="day", action="block")
    with start(servers, tmp_path / "l.duckdb", budgets=[budget]) as proxy:
        with openai.OpenAI(
            base_url=f"{proxy.url}/v1", api_key="sk-client", default_headers={"anthropic-version": "2023-06-01"}
        ) as client:
            with pytest.raises(openai.RateLimitError) as refused:
                client.chat.completions.create(model="claude-sonnet-4-5", messages=[{"role": "user", "content": "hi"}])
        rows = proxy.rows(1)
    error = refused.value
    assert error.code == "budget_exceeded" and error.type == "rate_limit_error" and len(rows) == 1
    assert json.loads(error.response.content)["type"] == "error"
