"""A key holder against the boundary: requests the upstream honours in a way the bound did not price.

Each test runs a real proxy in ``virtual_keys`` mode (tokenward holds the provider key) in front
of a real aiohttp upstream on loopback that behaves as the provider named does, and drives it with
the real ``openai`` SDK.

Prices (builtin catalog, USD per 1M tokens): ``openai/gpt-4.1-nano`` at OpenRouter input 0.10,
output 0.40 (every input-side rate 0.10); ``anthropic/claude-opus-4`` input 15, 1-hour cache
write 30 (the dearest input-side rate, which the bound uses), output 75.

Counts (o200k_base): ``"hello" + " hello" * 99`` is 100 text tokens, 107 with chat overhead.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import io
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import multipart
import openai
import pytest
from aiohttp import web

from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.app import create_app
from tokenward.proxy.config import AuthConfig, Config, LedgerConfig, UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.keys import key_id
from tokenward.proxy.server import running_in_thread
from tokenward.reports.ledger.state import SqliteState

from .conftest import read_rows
from .servers import Servers

KEY = "tw-attacker-key-0001"
PROVIDER_KEY = "sk-or-provider-secret-0001"
PROMPT = "hello" + " hello" * 99  # 100 tokens; 107 as a chat message
NANO, OPUS = "openai/gpt-4.1-nano", "anthropic/claude-opus-4"


@pytest.fixture(autouse=True)
def provider_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OR_KEY", PROVIDER_KEY)


class OpenRouter:
    """Chat completions as OpenRouter serves them with model fallbacks (``models``).

    OpenRouter tries ``models`` in order when the first one fails (over its context, moderated,
    rate limited: https://openrouter.ai/docs/features/model-routing, checked 2026-12-01); this one
    lets the first fail and serves, and bills, the last, writing all ``max_tokens`` of output.
    ``served`` collects the model of each request it billed.
    """

    def __init__(self) -> None:
        self.served: list[str] = []

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        document = await request.json()
        fallbacks = document.get("models")
        model = fallbacks[-1] if isinstance(fallbacks, list) and fallbacks else document["model"]
        self.served.append(model)
        usage = {"prompt_tokens": 107, "completion_tokens": document["max_tokens"]}
        return web.json_response(
            {"id": "gen-1", "object": "chat.completion", "model": model, "provider": "Anthropic",
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
             "usage": {**usage, "total_tokens": sum(usage.values())}}
        )  # fmt: skip


def attacker_config(ledger: Path, budget: BudgetSettings, *upstreams: tuple[str, str, str]) -> Config:
    """A proxy holding the provider key (``OR_KEY``) for the virtual key ``KEY``, under ``budget``.

    ``upstreams``: ``(name, base_url, provider)`` each.
    """
    return Config(
        upstreams=[
            UpstreamConfig(name=name, base_url=base_url, provider=provider, api_key_env="OR_KEY")
            for name, base_url, provider in upstreams
        ],
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        auth=AuthConfig(mode="virtual_keys"),
        virtual_keys=[VirtualKeyConfig(name="agent", key=KEY)],
        budgets=[budget],
    )


@contextmanager
def openrouter_proxy(upstream_url: str, ledger: Path, budget: BudgetSettings) -> Iterator[openai.OpenAI]:
    config = attacker_config(ledger, budget, ("openrouter", f"{upstream_url}/api/v1", "openrouter"))
    with running_in_thread(create_app(config)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def chat(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=NANO, max_tokens=1000, messages=[{"role": "user", "content": PROMPT}], **extra
    )


def test_fallback_models_are_bounded_at_the_dearest_one_they_may_be_served_by(tmp_path):
    # $0.05 left. Served by opus, the request costs 107 x 15 + 1000 x 75 = 76,605 -> $0.076605, over the
    # limit. Its bound at nano alone, ceil(107 x 1.1) + 300 = 418 in: 418 x 0.10 + 1000 x 0.40 = $0.0004418,
    # admitted it (the provider billed $0.076605, +53 % over the limit). At the dearest model it may be served
    # by, whose tokenizer tokenward lacks (x 1.25): ceil(107 x 1.1 x 1.25) + 300 = 448 in: 448 x 30 + 1000 x 75
    # = 88,440 -> $0.08844 > $0.05: refused before the provider hears of it.
    upstream = OpenRouter()
    budget = BudgetSettings(name="agent-cap", limit_usd=Decimal("0.05"), period="total", action="block")
    with Servers(upstream.handle).running() as servers:
        with openrouter_proxy(servers.upstream_url, tmp_path / "l.duckdb", budget) as client:
            with pytest.raises(openai.RateLimitError) as refused:
                chat(client, extra_body={"models": [NANO, OPUS]})
            plain = chat(client)  # without fallbacks the same request is nano's, and fits
    assert refused.value.body["code"] == "budget_exceeded"  # type: ignore[index]
    assert "may cost up to $0.08844" in refused.value.body["message"]  # type: ignore[index]
    assert upstream.served == [NANO]
    assert plain.http_response.headers["x-tokenward-cost-usd"] == "0.0004107"  # 107 x 0.10 + 1000 x 0.40
    rows = read_rows(tmp_path / "l.duckdb")
    assert [(r["http_status"], r["outcome"], r["cost_usd"]) for r in rows] == [
        (429, "rejected", Decimal(0)),
        (200, "ok", Decimal("0.0004107")),
    ]


def test_a_model_budget_covers_the_fallback_models_a_request_names(tmp_path):
    # opus may spend $0.01 in all: a request for nano naming opus as its fallback is opus's to bound
    upstream = OpenRouter()
    budget = BudgetSettings(
        name="opus-cap", scope={"model": OPUS}, limit_usd=Decimal("0.01"), period="total",
        action="block",
    )  # fmt: skip
    with Servers(upstream.handle).running() as servers:
        with openrouter_proxy(servers.upstream_url, tmp_path / "l.duckdb", budget) as client:
            with pytest.raises(openai.RateLimitError) as refused:
                chat(client, extra_body={"models": [NANO, OPUS]})
            chat(client)  # nano alone is outside opus-cap's scope
            chat(client, extra_body={"models": [NANO, "openai/gpt-4.1-nano"]})  # so are nano's own fallbacks
    assert refused.value.response.headers["x-tokenward-budget"] == "opus-cap"
    assert upstream.served == [NANO, NANO]


class LaxUpstream:
    """An OpenAI-compatible server that validates requests with pydantic in its default lax mode, as vLLM does.

    ``"20000"`` and ``20000.0`` are then the integer 20000 for ``max_tokens``, ``n`` and ``best_of``. It writes
    every token allowed: ``max_tokens`` for each of ``max(n, best_of)`` completions, and bills them all.
    """

    def __init__(self) -> None:
        import pydantic

        class Request(pydantic.BaseModel):
            max_tokens: int
            n: int = 1
            best_of: int | None = None

        self.request = Request
        self.billed_output: list[int] = []

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        parsed = self.request.model_validate_json(body)
        output = parsed.max_tokens * max(parsed.n, parsed.best_of or 1)
        self.billed_output.append(output)
        chat = request.path.endswith("/chat/completions")
        usage = {"prompt_tokens": 107 if chat else 100, "completion_tokens": output}
        choice = {"index": 0, "finish_reason": "length"}
        choice |= {"message": {"role": "assistant", "content": "ok"}} if chat else {"text": "ok"}
        return web.json_response(
            {"id": "x1", "object": "chat.completion" if chat else "text_completion", "model": "gpt-4o-mini",
             "service_tier": "default", "choices": [choice], "usage": {**usage, "total_tokens": sum(usage.values())}}
        )  # fmt: skip


LAX = [
    ("chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": "20000", "n": 2.0}),
    ("chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 20000.0, "n": " 2"}),
    ("completions", {"prompt": PROMPT, "max_tokens": 20000, "best_of": 2}),
]


@pytest.mark.parametrize(("path", "body"), LAX, ids=["string-limit", "float-limit", "best_of"])
def test_counts_a_lax_upstream_reads_as_numbers_are_numbers_to_the_bound(tmp_path, path, body):
    # gpt-4o-mini, standard tier: input 0.15, output 0.60. The upstream writes 2 x 20,000 = 40,000 tokens:
    # 107 x 0.15 + 40,000 x 0.60 = $0.02401605 for the chat (100 in for the completion: $0.024015), over the
    # $0.015 limit. Read as no limit and one choice, the bound assumed 16,384 (or 20,000) tokens of output:
    # 418 x 0.15 + 16,384 x 0.60 = $0.0098931 and 411 x 0.15 + 20,000 x 0.60 = $0.01206165, admitted (+60 %).
    # Read as the upstream reads them: ceil(107 x 1.1) + 300 = 418 in, 418 x 0.15 + 40,000 x 0.60 = $0.0240627
    # (completion: 100 x 1.1 is 110.00000000000001 in floating point, so 111 + 300 = 411 in, $0.02406165), refused.
    upstream = LaxUpstream()
    request = {"model": "gpt-4o-mini", "service_tier": "default", **body}
    with Servers(upstream.handle).running() as servers:
        config = attacker_config(
            tmp_path / "l.duckdb",
            BudgetSettings(name="cap", limit_usd=Decimal("0.015"), period="total", action="block"),
            ("vllm", f"{servers.upstream_url}/v1", "openai"),
        )
        with running_in_thread(create_app(config)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            with pytest.raises(openai.RateLimitError) as refused:
                client.post(f"/{path}", body=request, cast_to=object)
            fits = {**request, "max_tokens": "1000", "n": 1.0, "best_of": None}
            client.post(f"/{path}", body={k: v for k, v in fits.items() if v is not None}, cast_to=object)
    expected = "0.0240627" if path == "chat/completions" else "0.02406165"
    assert f"may cost up to ${expected}" in refused.value.body["message"]  # type: ignore[index]
    assert upstream.billed_output == [1000]  # only the request that fits reached the provider


class StoredContentUpstream:
    """OpenAI Responses and Anthropic Messages that bill 100,000 input tokens of content the body only names.

    An ``item_reference`` (an item of an earlier stored response), a ``prompt`` template (instructions
    stored in the project), an earlier audio reply named by its id, and an Anthropic MCP server's tool results
    all enter the model's context, and are billed as input, without being in the request body. ``billed`` collects each request's cost (USD), as
    soon as it arrives; each reply takes 0.5 s, so concurrent requests overlap.
    """

    def __init__(self) -> None:
        self.billed: list[Decimal] = []

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        if request.path.endswith("/messages"):  # claude-sonnet-4-5: 100,000 x 3 + 10 x 15 = $0.30015
            self.billed.append(Decimal("0.30015"))
            await asyncio.sleep(0.5)
            return web.json_response(
                {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
                 "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn", "stop_sequence": None,
                 "usage": {"input_tokens": 100_000, "output_tokens": 10}}
            )  # fmt: skip
        self.billed.append(Decimal("0.015006"))  # gpt-4o-mini, default tier: 100,000 x 0.15 + 10 x 0.60
        await asyncio.sleep(0.5)
        if request.path.endswith("/chat/completions"):
            return web.json_response(
                {"id": "c1", "object": "chat.completion", "model": "gpt-4o-mini", "service_tier": "default",
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 100_000, "completion_tokens": 10, "total_tokens": 100_010}}
            )  # fmt: skip
        return web.json_response(
            {"id": "resp_1", "object": "response", "status": "completed", "model": "gpt-4o-mini",
             "service_tier": "default", "error": None, "output": [],
             "usage": {"input_tokens": 100_000, "output_tokens": 10, "total_tokens": 100_010}}
        )  # fmt: skip


STORED = [
    ("responses", {"input": [{"type": "item_reference", "id": "msg_1"}, {"role": "user", "content": "and?"}]}),
    ("responses", {"prompt": {"id": "pmpt_1", "version": "2"}, "input": "hi"}),
    (
        "chat/completions",  # an earlier audio reply, by id: the model hears it again
        {
            "max_tokens": 10,
            "messages": [
                {"role": "user", "content": "Read me the report."},
                {"role": "assistant", "audio": {"id": "audio_1"}},
                {"role": "user", "content": "Again, slower."},
            ],
        },
    ),
    (
        "messages",
        {
            "model": "claude-sonnet-4-5",
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "read it all"}],
            "mcp_servers": [{"type": "url", "url": "https://mcp.example/sse", "name": "docs"}],
        },
    ),
]


@pytest.mark.parametrize(
    ("path", "body"), STORED, ids=["item_reference", "prompt_template", "audio_reply", "mcp_servers"]
)
def test_content_the_body_only_names_leaves_a_request_unbounded(tmp_path, path, body):
    # Room for one and a half requests. Bounded by the few tokens in the body (about $0.0001), four concurrent
    # requests were all admitted and billed 4 x $0.015006 = $0.060024 (Anthropic: 4 x $0.30015 = $1.2006),
    # 2.7 times the limit. Unbounded, the first reserves everything left and runs alone: the others get 429.
    upstream = StoredContentUpstream()
    real = Decimal("0.30015") if path == "messages" else Decimal("0.015006")
    request = {"model": "gpt-4o-mini", "service_tier": "default", "max_output_tokens": 10, **body}
    if path == "chat/completions":
        request = {"model": "gpt-4o-mini", "service_tier": "default", **body}
    if path == "messages":
        request = body
    if path == "responses" and isinstance(body["input"], list):
        # the item is the key's own (an earlier response of its): isolation lets it be named
        state = SqliteState(str(tmp_path / "l.duckdb") + ".state.sqlite")
        owner = key_id(hashlib.sha256(KEY.encode()).hexdigest())
        state.record_objects([("msg_1", "response_item", owner, dt.datetime.now(dt.UTC))])
        state.close()
    with Servers(upstream.handle).running() as servers:
        config = attacker_config(
            tmp_path / "l.duckdb",
            BudgetSettings(name="cap", limit_usd=real * 3 / 2, period="total", action="block"),
            ("openai", f"{servers.upstream_url}/v1", "openai"),
            ("anthropic", f"{servers.upstream_url}/v1", "anthropic"),
        )
        with running_in_thread(create_app(config)) as url:

            async def fire() -> list[Any]:
                async with httpx.AsyncClient(timeout=30) as client:
                    headers = {"authorization": f"Bearer {KEY}"}
                    if path == "messages":
                        headers |= {"anthropic-version": "2023-06-01", "anthropic-beta": "mcp-client-2025-04-04"}
                    return await asyncio.gather(
                        *(client.post(f"{url}/v1/{path}", json=request, headers=headers) for _ in range(4))
                    )

            replies = asyncio.run(fire())
    assert sorted(r.status_code for r in replies) == [200, 429, 429, 429]
    assert upstream.billed == [real] and real <= real * 3 / 2


TOOL_OUTPUT = "hello" + " hello" * 99_999  # 100,000 tokens
TOOL_TURN = [
    {"role": "user", "content": "Summarise the weather."},  # 6 tokens
    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Paris"}'},  # 5
    {"type": "function_call_output", "call_id": "call_1", "output": TOOL_OUTPUT},
]


class ResponsesUpstream:
    """OpenAI Responses billing what the model read (``usage``, costing ``billed`` USD), after 0.5 s."""

    def __init__(self, billed: str, input_tokens: int) -> None:
        self.price, self.input_tokens = Decimal(billed), input_tokens
        self.billed: list[Decimal] = []

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        self.billed.append(self.price)
        await asyncio.sleep(0.5)
        usage = {"input_tokens": self.input_tokens, "output_tokens": 10, "total_tokens": self.input_tokens + 10}
        return web.json_response(
            {"id": "resp_1", "object": "response", "status": "completed", "model": "gpt-4o-mini",
             "service_tier": "default", "error": None, "output": [], "usage": usage}
        )  # fmt: skip


def four_at_once(tmp_path: Path, upstream: ResponsesUpstream, limit: str, turn: list, **extra: Any) -> tuple[list, list]:
    """Four concurrent Responses requests of ``turn`` under a hard limit of ``limit`` USD: (admitted, refused)."""
    with Servers(upstream.handle).running() as servers:
        config = attacker_config(
            tmp_path / "l.duckdb",
            BudgetSettings(name="cap", limit_usd=Decimal(limit), period="total", action="block"),
            ("openai", f"{servers.upstream_url}/v1", "openai"),
        )
        with running_in_thread(create_app(config)) as url:

            async def fire() -> list[Any]:
                async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as client:
                    calls = (
                        client.responses.with_raw_response.create(
                            model="gpt-4o-mini", input=turn, max_output_tokens=10, service_tier="default", **extra
                        )
                        for _ in range(4)
                    )
                    return await asyncio.gather(*calls, return_exceptions=True)

            replies = asyncio.run(fire())
    admitted = [r for r in replies if not isinstance(r, Exception)]
    return admitted, [r for r in replies if isinstance(r, openai.RateLimitError)]


def test_tool_call_outputs_and_arguments_count_toward_the_bound(tmp_path):
    # A function call's output is input the provider bills. Counted as the message alone (6 tokens:
    # ceil(6 x 1.1) + 300 = 307 in, 307 x 0.15 + 10 x 0.60 = $0.00005205), four concurrent requests were all
    # admitted against room for one and a half ($0.0225) and billed 4 x $0.01500765 = $0.0600306 (+167 %).
    # Counted with the arguments and the output, 6 + 5 + 100,000 = 100,011 tokens, + 7 for the one message (its
    # role, 3, and 3 for the reply): ceil(100,018 x 1.1) + 300 = 110,320 in, 110,320 x 0.15 + 10 x 0.60 =
    # $0.016554 each: one fits, the others get 429.
    upstream = ResponsesUpstream("0.01500765", 100_011)  # gpt-4o-mini, default tier: 100,011 x 0.15 + 10 x 0.60
    admitted, refused = four_at_once(tmp_path, upstream, "0.0225", TOOL_TURN)
    assert (len(admitted), len(refused)) == (1, 3)
    assert "may cost up to $0.016554" in refused[0].body["message"]  # type: ignore[index]
    assert admitted[0].headers["x-tokenward-cost-usd"] == "0.01500765"
    assert upstream.billed == [Decimal("0.01500765")]


SEALED = "A" * 120_000  # base64 of 90,000 bytes: an encrypted reasoning item replayed by a stateless client
SEALED_TURN = [
    {"role": "user", "content": "Summarise the weather."},  # 6 tokens
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": SEALED},
]


def test_encrypted_content_a_client_replays_counts_toward_the_bound(tmp_path):
    # Stateless Responses clients (include=["reasoning.encrypted_content"], store=false) send each
    # turn's reasoning back encrypted; the provider decrypts it and bills it as input (80,000 tokens
    # here). Counted as the message alone (ceil(6 x 1.1) + 300 = 307 in, $0.00005205), four
    # concurrent requests were all admitted against a $0.02 limit and billed 4 x $0.0120069 =
    # $0.0480276 (2.4x). Bounded by its decoded size, one token per byte: the message 6 + 7 of overhead,
    # ceil(13 x 1.1) + 300 = 315, + 90,001 = 90,316 in, 90,316 x 0.15 + 10 x 0.60 = $0.0135534 each: one fits,
    # the others get 429.
    upstream = ResponsesUpstream("0.0120069", 80_006)  # 80,006 x 0.15 + 10 x 0.60
    admitted, refused = four_at_once(
        tmp_path, upstream, "0.02", SEALED_TURN, store=False, include=["reasoning.encrypted_content"]
    )
    assert (len(admitted), len(refused)) == (1, 3)
    assert "may cost up to $0.0135534" in refused[0].body["message"]  # type: ignore[index]
    assert upstream.billed == [Decimal("0.0120069")]


def test_anthropic_redacted_thinking_and_encrypted_search_results_are_bounded_by_their_size():
    from tokenward.proxy.bounds import scan

    turn = {
        "model": "claude-sonnet-4-5",
        "messages": [
            {"role": "user", "content": "Find it."},
            {"role": "assistant", "content": [
                {"type": "redacted_thinking", "data": "B" * 4_000},  # 3,000 bytes: 3,001 tokens
                {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "it"}},
                {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
                    {"type": "web_search_result", "url": "https://example.com", "title": "It",
                     "encrypted_content": "C" * 8_000},  # 6,000 bytes: 6,001 tokens
                ]},
            ]},
        ],
    }  # fmt: skip
    found = scan(turn)
    assert (found.opaque_tokens, found.unbounded) == (9_002, False)


def test_a_computer_call_screenshot_is_bounded_as_an_image():
    from tokenward.proxy.bounds import scan

    # the screenshot a computer-use turn returns is billed as image input, like an input_image
    turn = {
        "model": "computer-use-preview",
        "input": [
            {
                "type": "computer_call_output",
                "call_id": "call_1",
                "output": {"type": "computer_screenshot", "image_url": "data:image/png;base64,iVBORw0KGgo="},
            }
        ],
    }
    assert (scan(turn).images, scan(turn).unbounded) == (1, False)


def test_an_unpriced_fallback_model_cannot_be_bounded(tmp_path):
    # a fallback with no price could bill anything: under a blocking budget the request is refused
    upstream = OpenRouter()
    budget = BudgetSettings(name="agent-cap", limit_usd=Decimal("5"), period="total", action="block")
    with Servers(upstream.handle).running() as servers:
        with openrouter_proxy(servers.upstream_url, tmp_path / "l.duckdb", budget) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                chat(client, extra_body={"models": [NANO, "house/model-x"]})
    assert refused.value.body["code"] == "model_not_priced"  # type: ignore[index]
    assert "'openai/gpt-4.1-nano', 'house/model-x'" in refused.value.body["message"]  # type: ignore[index]
    assert upstream.served == []


class FirstValueImages:
    """OpenAI-style image edits from a server whose form parser keeps the first value of a repeated field.

    aiohttp's, Werkzeug's and Go's form readers do (``MultiDict.get``, ``FormValue``); Starlette's keeps
    the last. It makes ``n`` images at 6,240 output tokens each (gpt-image-1's largest) and bills them.
    """

    def __init__(self) -> None:
        self.made: list[int] = []

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        parts = multipart.MultipartParser(io.BytesIO(body), "B")
        n = int(next((part.value for part in parts if part.name == "n"), "1"))  # the first value
        self.made.append(n)
        usage = {"input_tokens": 20, "input_tokens_details": {"text_tokens": 20, "image_tokens": 0}}
        return web.json_response(
            {"created": 1, "data": [{"b64_json": "iVBORw0KGgo="}] * n,
             "usage": {**usage, "output_tokens": 6240 * n, "total_tokens": 20 + 6240 * n}}
        )  # fmt: skip


def edit_form(*fields: tuple[str, str]) -> bytes:
    parts = [f'--B\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n' for name, value in fields]
    image = '--B\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\nContent-Type: image/png\r\n\r\n'
    return ("".join(parts) + image).encode() + b"\x89PNG\r\n\x1a\n" + b"\r\n--B--\r\n"


def test_a_form_field_sent_twice_is_refused_before_the_upstream_reads_either(tmp_path):
    # gpt-image-1 makes images at up to 6,240 output tokens x 40.00 / 1M = $0.2496 each; $1 is room for three.
    # n=10 then n=1: tokenward read the last (one image, admitted), this upstream the first: 10 images,
    # 62,400 x 40.00 + 20 x 5.00 = $2.4961, two and a half times the limit.
    upstream = FirstValueImages()
    budget = BudgetSettings(name="images", limit_usd=Decimal(1), period="total", action="block")
    with Servers(upstream.handle).running() as servers:
        config = attacker_config(tmp_path / "l.duckdb", budget, ("openai", f"{servers.upstream_url}/v1", "openai"))
        with running_in_thread(create_app(config)) as url:
            headers = {"authorization": f"Bearer {KEY}", "content-type": "multipart/form-data; boundary=B"}
            twice = edit_form(("model", "gpt-image-1"), ("prompt", "a hat"), ("n", "10"), ("n", "1"))
            refused = httpx.post(f"{url}/v1/images/edits", content=twice, headers=headers)
            once = edit_form(("model", "gpt-image-1"), ("prompt", "a hat"), ("n", "1"))
            served = httpx.post(f"{url}/v1/images/edits", content=once, headers=headers)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_request"
    assert "'n' twice" in refused.json()["error"]["message"]
    assert served.status_code == 200 and upstream.made == [1]
    assert served.headers["x-tokenward-cost-usd"] == "0.2497"  # 6,240 x 40.00 + 20 x 5.00


def test_fallbacks_in_the_messages_shape_are_bounded_like_models(tmp_path):
    # OpenRouter's Messages endpoint takes the fallback list as `fallbacks: [{"model": ...}]`: the same
    # opus fallback, the same bound as with `models`: 448 x 30 + 1000 x 75 = 88,440 -> $0.08844 > $0.05
    upstream = OpenRouter()
    budget = BudgetSettings(name="agent-cap", limit_usd=Decimal("0.05"), period="total", action="block")
    with Servers(upstream.handle).running() as servers:
        with openrouter_proxy(servers.upstream_url, tmp_path / "l.duckdb", budget) as client:
            with pytest.raises(openai.RateLimitError) as refused:
                chat(client, extra_body={"fallbacks": [{"model": OPUS}]})
    assert "may cost up to $0.08844" in refused.value.body["message"]  # type: ignore[index]
    assert upstream.served == []


def test_more_fallback_models_than_a_bound_prices_are_refused(tmp_path):
    upstream = OpenRouter()
    budget = BudgetSettings(name="agent-cap", limit_usd=Decimal("0.05"), period="total", action="block")
    many = [f"openai/gpt-4.1-nano-{i}" for i in range(9)]
    with Servers(upstream.handle).running() as servers:
        with openrouter_proxy(servers.upstream_url, tmp_path / "l.duckdb", budget) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                chat(client, extra_body={"models": [NANO, *many]})
    assert refused.value.body["code"] == "too_many_fallback_models"  # type: ignore[index]
    assert upstream.served == []
    assert [(r["http_status"], r["cost_usd"]) for r in read_rows(tmp_path / "l.duckdb")] == [(400, Decimal(0))]
