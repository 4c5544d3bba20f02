"""Background Responses (``"background": true``) are settled with their real usage, exactly once.

The reply to the ``POST`` comes before the model runs (``status: queued``, ``usage: null``), so its
row is ``deferred`` at the worst case its budget reservation held. Before, it stayed so forever: a
report showed no cost for it, and a blocking budget counted the whole reservation. Now the first
reply through tokenward that shows the finished response (a retrieval, a streamed resume, a cancel)
prices it as of its request's start and settles that row; later retrievals change nothing. A real
proxy in front of :class:`~tests.raw_upstream.RawUpstream`, the real ``openai`` SDK; gpt-4.1 is
2.00 in / 8.00 out per 1M tokens (built-in).
"""

from __future__ import annotations

import json
import time
from decimal import Decimal

import httpx
import openai

from tokenward.pricing.settings import BudgetSettings

from .raw_upstream import LAST_CHUNK, chunk, json_reply, sse_head

USAGE = {"input_tokens": 1000, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 100,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 1100}  # fmt: skip
QUEUED = {"id": "resp_bg1", "object": "response", "created_at": 1, "status": "queued", "model": "gpt-4.1",
          "background": True, "error": None, "output": [], "usage": None, "tools": []}  # fmt: skip
DONE = {**QUEUED, "status": "completed", "usage": USAGE, "model": "gpt-4.1-2025-04-14",
        "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "Hi", "annotations": []}]}]}  # fmt: skip


def upstream(head: bytes, body: bytes) -> list[bytes]:
    """The queued reply to the create; the finished response to a retrieval, whole or streamed."""
    line = head.split(b"\r\n", 1)[0]
    if line.startswith(b"POST /v1/responses "):
        return [json_reply(json.dumps(QUEUED).encode())]
    if b"stream=true" in line:
        completed = {"type": "response.completed", "sequence_number": 5, "response": DONE}
        event = b"event: response.completed\ndata: " + json.dumps(completed).encode() + b"\n\n"
        return [sse_head(), chunk(event), LAST_CHUNK]
    return [json_reply(json.dumps(DONE).encode())]


def test_a_background_response_is_settled_once_with_its_real_usage(raw_proxy, raw_upstream):
    budgets = [BudgetSettings(name="cap", limit_usd=Decimal(5), scope={}, period="total", action="block")]
    proxy = raw_proxy(budgets=budgets)
    raw_upstream.script = upstream
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as client:
        queued = client.responses.create(model="gpt-4.1", input="hi", background=True, max_output_tokens=1000)
        assert (queued.id, queued.status, queued.usage) == ("resp_bg1", "queued", None)
        (deferred,) = proxy.rows(1)
        assert (deferred["price_status"], deferred["cost_usd"]) == ("deferred", None)
        held = deferred["reserved_usd"]
        assert held > Decimal("0.008")  # at least the 1,000 output tokens it may make
        # retrieved three times (twice whole, once as a streamed resume), as a poller does
        assert client.responses.retrieve("resp_bg1").usage.output_tokens == 100
        assert client.responses.retrieve("resp_bg1").status == "completed"
        assert [e.type for e in client.responses.retrieve("resp_bg1", stream=True)] == ["response.completed"]
    rows = proxy.rows(expect=4)
    create = next(r for r in rows if r["method"] == "POST")
    # 1000 x 2.00 + 100 x 8.00 = 2800 per 1M -> $0.0028, counted once
    assert (create["price_status"], create["cost_usd"], create["input_tokens"], create["output_tokens"]) == (
        "priced",
        Decimal("0.0028"),
        1000,
        100,
    )
    assert (create["served_model"], create["usage_source"], create["reserved_usd"]) == (
        "gpt-4.1-2025-04-14",
        "reported",
        held,
    )
    retrievals = [r for r in rows if r["method"] == "GET"]
    assert [(r["price_status"], r["cost_usd"], r["input_tokens"]) for r in retrievals] == [("not_metered", None, 0)] * 3
    # the budget counts the real cost, not the reservation, and holds nothing
    (cap,) = httpx.get(f"{proxy.url}/v1/tokenward/budget", timeout=10).json()["budgets"]
    assert (Decimal(cap["spent_usd"]), Decimal(cap["held_usd"])) == (Decimal("0.0028"), Decimal(0))


def test_a_retrieval_settles_it_and_a_cancel_after_it_changes_nothing(raw_proxy, raw_upstream):
    """No budget: the row counted nothing while deferred; it is priced once, whatever reads the response after."""
    proxy = raw_proxy()
    raw_upstream.script = upstream
    body = {"model": "gpt-4.1", "input": "hi", "background": True}
    assert httpx.post(f"{proxy.url}/v1/responses", json=body, timeout=10).json()["status"] == "queued"
    assert httpx.get(f"{proxy.url}/v1/responses/resp_bg1", timeout=10).json()["status"] == "completed"
    assert httpx.post(f"{proxy.url}/v1/responses/resp_bg1/cancel", timeout=10).status_code == 200
    rows = proxy.rows(expect=3)
    assert [(r["method"], r["price_status"], r["cost_usd"]) for r in rows] == [
        ("POST", "priced", Decimal("0.0028")),
        ("GET", "not_metered", None),
        ("POST", "not_metered", None),
    ]


def test_concurrent_settlements_of_one_response_settle_it_once(tmp_path):
    """Two replicas (or threads) seeing the finished response at once: one settlement wins."""
    import datetime as dt
    from concurrent.futures import ThreadPoolExecutor

    from tokenward.reports.ledger import deferred
    from tokenward.reports.ledger.state import SqliteState

    state = SqliteState(tmp_path / "l.duckdb.state.sqlite")
    deferred.record(state, "resp_x", "req_1", {"started_at": 1.0})
    now = dt.datetime(2026, 12, 2, tzinfo=dt.UTC)
    with ThreadPoolExecutor(8) as pool:
        won = list(
            pool.map(lambda i: deferred.settle(SqliteState(state.path), "resp_x", {"cost_usd": i}, now), range(8))
        )
    assert won.count(True) == 1
    assert deferred.deferred(state, "resp_x") is None  # settled: a later retrieval finds nothing to settle
    ((_, request_id, settlement),) = deferred.unapplied(state)
    assert request_id == "req_1" and settlement["cost_usd"] == won.index(True)


def test_two_replicas_on_postgres_settle_a_background_response_once(tmp_path, pg_url, raw_upstream):
    """Both replicas retrieve the finished response; one settles it, the budget's books move once."""
    from contextlib import ExitStack

    import psycopg

    from tokenward.pricing.settings import GuardSettings
    from tokenward.proxy.app import create_app
    from tokenward.proxy.config import Config, LedgerConfig, UpstreamConfig
    from tokenward.proxy.server import running_in_thread

    raw_upstream.script = upstream
    budgets = [BudgetSettings(name="cap", limit_usd=Decimal(5), scope={}, period="total", action="block")]
    urls = []
    with ExitStack() as stack:
        for number in range(2):
            config = Config(
                upstreams=[UpstreamConfig(name="o", base_url=f"{raw_upstream.url}/v1", provider="openai")],
                ledger=LedgerConfig(url=pg_url, spool_dir=str(tmp_path / f"spool{number}"), flush_interval_s=0.05),
                budgets=budgets,
                guard=GuardSettings(),
            )
            urls.append(stack.enter_context(running_in_thread(create_app(config))))
        body = {"model": "gpt-4.1", "input": "hi", "background": True, "max_output_tokens": 1000}
        assert httpx.post(f"{urls[0]}/v1/responses", json=body, timeout=10).json()["status"] == "queued"
        for url in (urls[1], urls[0], urls[1]):
            assert httpx.get(f"{url}/v1/responses/resp_bg1", timeout=10).json()["status"] == "completed"

        def settled() -> list[tuple]:
            with psycopg.connect(pg_url) as conn:
                return conn.execute(
                    "SELECT price_status, cost_usd, output_tokens FROM requests WHERE method = 'POST'"
                ).fetchall()

        deadline = time.monotonic() + 20
        while settled() != [("priced", Decimal("0.0028"), 100)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert settled() == [("priced", Decimal("0.0028"), 100)]
        with psycopg.connect(pg_url) as conn:
            assert conn.execute("SELECT count(*) FROM deferred_responses WHERE settled_at IS NOT NULL").fetchone() == (
                1,
            )
            (spent,) = conn.execute("SELECT spent FROM budget_books WHERE book = 'cap'").fetchone()
        assert spent == Decimal("0.0028")  # the reservation replaced by the real cost, once


def test_a_retrieval_through_another_upstream_does_not_settle_it(raw_proxy, raw_upstream):
    """A client choosing the upstream of its retrieval (``x-tokenward-upstream``) cannot price the response there."""
    proxy = raw_proxy()
    raw_upstream.script = upstream
    body = {"model": "gpt-4.1", "input": "hi", "background": True}
    assert httpx.post(f"{proxy.url}/v1/responses", json=body, timeout=10).json()["status"] == "queued"
    elsewhere = {"x-tokenward-upstream": "anthropic"}  # the same server here; a relay the client shapes, in the field
    assert httpx.get(f"{proxy.url}/v1/responses/resp_bg1", headers=elsewhere, timeout=10).status_code == 200
    (create, _) = proxy.rows(expect=2)
    assert (create["price_status"], create["cost_usd"]) == ("deferred", None)
    assert httpx.get(f"{proxy.url}/v1/responses/resp_bg1", timeout=10).status_code == 200
    create = proxy.rows(expect=3)[0]
    assert (create["price_status"], create["cost_usd"]) == ("priced", Decimal("0.0028"))
