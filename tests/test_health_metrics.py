"""/healthz reports the ledger writer and turns 503 when rows cannot be written; /metrics for operators."""

from __future__ import annotations

import re
import shutil
import socket
import time
from decimal import Decimal

import httpx

from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.config import UpstreamConfig
from tokenward.proxy.simulator import RECORD_HEADER
from tokenward.reports.alerts import AlertSettings, WebhookSettings

CHAT = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"
CHAT_STREAM = "tests/models/cassettes/test_openai/test_run_stream_sync_streams_real_model.yaml#0"
CHAT_BODY = {"messages": [{"content": "hello", "role": "user"}], "model": "gpt-4o", "n": 1, "stream": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_healthz_reports_the_ledger_and_answers_503_while_it_cannot_be_written(start_proxy):
    proxy = start_proxy()
    health = httpx.get(f"{proxy.url}/healthz")
    assert health.status_code == 200
    body = health.json()
    assert (body["status"], body["writable"], body["problem"], body["queued_rows"]) == ("ok", True, None, 0)
    assert (body["spool_files"], body["spool_rows"], body["stale_after_s"]) == (0, 0, 10.0)
    assert 0 <= body["last_write_age_s"] < 1  # flushes every 0.05 s here, even with nothing to write
    httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT_BODY, headers={RECORD_HEADER: CHAT})
    assert len(proxy.rows(1)) == 1
    # and the proxy's own log holds nothing more (a move of its own may still be finishing)
    assert wait_until(lambda: httpx.get(f"{proxy.url}/healthz").json()["spool_rows"] == 0)

    recorder = proxy.app.state.recorder
    recorder.stale_after_s = 0.5
    moved = proxy.ledger.with_suffix(".away")
    proxy.ledger.rename(moved)
    proxy.ledger.mkdir()  # a directory where the file was: every write fails
    try:
        httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT_BODY, headers={RECORD_HEADER: CHAT})
        # 503 at once (stale), its reason once the next move is tried (up to 5 s after a costly one)
        failing = wait_until(
            lambda: (r := httpx.get(f"{proxy.url}/healthz")).status_code == 503 and r.json()["problem"] and r
        )
        assert failing, "healthz did not turn 503"
        body = failing.json()
        assert (body["status"], body["writable"], body["problem"]) == ("unavailable", False, "ledger_error")
        assert (body["spool_files"], body["spool_rows"], body["queued_rows"]) == (1, 1, 0)
        assert body["last_write_age_s"] > 0.5
    finally:
        shutil.rmtree(proxy.ledger)
        moved.rename(proxy.ledger)
    recovered = wait_until(lambda: (r := httpx.get(f"{proxy.url}/healthz")).status_code == 200 and r)
    assert recovered and recovered.json()["spool_files"] == 0 and recovered.json()["problem"] is None
    assert len(proxy.rows(2)) == 2  # the row waited in the spool, then went in


def sample_value(metrics: str, series: str) -> float | None:
    match = re.search(rf"^{re.escape(series)} (\S+)$", metrics, re.M)
    return float(match.group(1)) if match else None


def test_metrics_latency_ttft_upstream_errors_and_no_created_series(start_proxy, simulator):
    dead = UpstreamConfig(name="dead", base_url=f"http://127.0.0.1:{free_port()}/v1")
    openai_up = UpstreamConfig(name="openai", base_url=f"{simulator.url}/openai/v1", default=True, provider="openai")
    proxy = start_proxy(upstreams=[dead, openai_up])
    httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT_BODY, headers={RECORD_HEADER: CHAT})
    stream = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    httpx.post(f"{proxy.url}/v1/chat/completions", json=stream, headers={RECORD_HEADER: CHAT_STREAM})
    httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT_BODY, headers={"x-tokenward-upstream": "dead"})
    rows = proxy.rows(3)
    metrics = httpx.get(f"{proxy.url}/metrics")
    assert metrics.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format
    text = metrics.text
    assert "_created" not in text
    labels = '{endpoint="chat_completions",upstream="openai"}'
    assert sample_value(text, f"tokenward_request_duration_seconds_count{labels}") == 2
    total = sum(r["latency_ms"] for r in rows if r["upstream"] == "openai") / 1000
    assert abs(sample_value(text, f"tokenward_request_duration_seconds_sum{labels}") - total) < 1e-9
    assert sample_value(text, f"tokenward_time_to_first_token_seconds_count{labels}") == 1
    ttfb = next(r["ttfb_ms"] for r in rows if r["stream"]) / 1000
    assert abs(sample_value(text, f"tokenward_time_to_first_token_seconds_sum{labels}") - ttfb) < 1e-9
    buckets = re.findall(
        r'^tokenward_time_to_first_token_seconds_bucket\{endpoint="chat_completions",le="([^"]+)",upstream="openai"\} '
        r"(\S+)$",
        text,
        re.M,
    )
    assert len(buckets) == 13  # 12 bounds and +Inf
    for le, count in buckets:  # cumulative: the one stream counts in every bucket from its own up
        assert float(count) == (1.0 if le == "+Inf" or float(le) >= ttfb else 0.0), le
    assert sample_value(text, 'tokenward_upstream_errors_total{outcome="upstream_unreachable",upstream="dead"}') == 1
    assert 'tokenward_request_duration_seconds_count{endpoint="chat_completions",upstream="dead"}' not in text
    assert sample_value(text, "tokenward_ledger_writable") == 1
    assert sample_value(text, "tokenward_spool_files") == 0
    assert "tokenward_budget_" not in text  # no budgets configured


def test_budget_gauges_and_alert_delivery_failures(start_proxy, simulator):
    hook = WebhookSettings(name="ops-hook", url=f"http://127.0.0.1:{free_port()}/hook")  # nobody listens
    # period "total": no forecast alert beside the threshold's (a month's would fire or not by the date)
    budget = BudgetSettings(
        name="tiny", limit_usd=Decimal("0.0002"), period="total", thresholds=[50], notify=["ops-hook"]
    )
    proxy = start_proxy(budgets=[budget], alerts=AlertSettings(webhooks=[hook], retries=0))
    httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT_BODY, headers={RECORD_HEADER: CHAT})
    proxy.rows(1)

    def failures():
        text = httpx.get(f"{proxy.url}/metrics").text
        return sample_value(text, 'tokenward_alert_delivery_failures_total{channel="webhook"}') and text

    text = wait_until(failures)  # $0.00012 of $0.0002 crosses 50 %: the alert is due soon, and its webhook fails
    assert text, "the failed delivery was not counted"
    assert sample_value(text, 'tokenward_alert_delivery_failures_total{channel="webhook"}') == 1
    assert sample_value(text, 'tokenward_budget_spend_usd{budget="tiny"}') == 0.00012
    assert sample_value(text, 'tokenward_budget_limit_usd{budget="tiny"}') == 0.0002
    assert sample_value(text, 'tokenward_budget_reserved_usd{budget="tiny"}') == 0
    assert sample_value(text, 'tokenward_budget_remaining_usd{budget="tiny"}') == 0.00008


def test_per_user_budgets_are_exported_the_most_spent_first_and_counted(start_proxy, monkeypatch):
    """Before: a template's per-user budgets (``chat-user[alice]``) were nowhere in /metrics."""
    from tokenward.proxy import metrics

    monkeypatch.setattr(metrics, "PER_VALUE_SERIES", 2)  # 20 by default: the cap, at a size a test can pass
    template = BudgetSettings(name="chat-user", per="end_user", limit_usd=Decimal("0.01"), period="total")
    proxy = start_proxy(budgets=[template])
    for user in ("alice", "alice", "carol", "bob"):
        headers = {RECORD_HEADER: CHAT, "x-tokenward-user": user}
        assert httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT_BODY, headers=headers).status_code == 200
    proxy.rows(4)
    text = httpx.get(f"{proxy.url}/metrics").text
    # gpt-4o, each request $0.00012: alice $0.00024 of $0.01; bob and carol $0.00012 each, bob first by name
    assert sample_value(text, 'tokenward_budget_instances{budget="chat-user"}') == 3
    assert sample_value(text, 'tokenward_budget_spend_usd{budget="chat-user[alice]"}') == 0.00024
    assert sample_value(text, 'tokenward_budget_limit_usd{budget="chat-user[alice]"}') == 0.01
    assert sample_value(text, 'tokenward_budget_reserved_usd{budget="chat-user[alice]"}') == 0
    assert sample_value(text, 'tokenward_budget_remaining_usd{budget="chat-user[alice]"}') == 0.00976
    assert sample_value(text, 'tokenward_budget_spend_usd{budget="chat-user[bob]"}') == 0.00012
    assert "chat-user[carol]" not in text  # past the cap: counted in tokenward_budget_instances only


def test_model_labels_are_capped_so_a_key_holder_cannot_grow_metrics_without_end(start_proxy, monkeypatch):
    """An OpenAI-compatible upstream that serves whatever model it is asked for (vLLM, Ollama, a router
    answering with the name it was sent) makes the client choose every row's model: each new name was a
    new series per token kind, for as long as the proxy runs. Past the cap, models count as "(other)"."""
    from aiohttp import web

    from tokenward.proxy import metrics as metrics_module

    from .servers import Servers

    async def serves_any_model(request: web.Request, body: bytes) -> web.StreamResponse:
        import json

        model = json.loads(body)["model"]
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }
        )

    monkeypatch.setattr(metrics_module, "MAX_MODEL_LABELS", 5, raising=False)  # the cap, made small
    long_name = "x" * 300
    models = [long_name] + [f"m-{i}" for i in range(7)]
    with Servers(serves_any_model).running() as servers:
        upstream = UpstreamConfig(name="vllm", base_url=f"{servers.upstream_url}/v1", default=True, provider="openai")
        proxy = start_proxy(upstreams=[upstream])
        for model in models:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            assert httpx.post(f"{proxy.url}/v1/chat/completions", json=body).status_code == 200
        rows = proxy.rows(len(models))
        text = httpx.get(f"{proxy.url}/metrics").text
    assert sorted(r["served_model"] for r in rows) == sorted(models)  # the ledger keeps every name, whole
    labelled = re.findall(r'^tokenward_tokens_total\{kind="input_tokens",model="([^"]*)"\} (\S+)$', text, re.M)
    # the first five names seen get a label each (the 300-character one cut to 128 and an ellipsis),
    # the other three requests count under "(other)": 3 input tokens each
    assert dict(labelled) == {
        "x" * 128 + "…": "3.0",
        "m-0": "3.0",
        "m-1": "3.0",
        "m-2": "3.0",
        "m-3": "3.0",
        "(other)": "9.0",
    }
    assert sample_value(text, 'tokenward_tokens_total{kind="output_tokens",model="(other)"}') == 6
