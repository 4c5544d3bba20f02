"""Endpoints tokenward does not meter pass through untouched, each still with one ledger row."""

from __future__ import annotations

import hashlib
from decimal import Decimal

import httpx
import openai

from tokenward.proxy.simulator import binary_payload


def client_for(proxy):
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0)


def test_models_list_and_query_string(start_proxy, simulator):
    proxy = start_proxy()
    with client_for(proxy) as client:
        models = client.models.list()
    assert [m.id for m in models.data] == ["gpt-4o"]
    reply = httpx.get(f"{proxy.url}/v1/models?limit=2&order=desc")
    assert (
        reply.status_code == 200 and simulator.simulator.requests[-1]["path"] == "/openai/v1/models?limit=2&order=desc"
    )
    rows = proxy.rows(2)
    assert [(r["endpoint"], r["method"], r["path"], r["price_status"], r["outcome"]) for r in rows] == [
        ("passthrough", "GET", "/v1/models", "not_metered", "ok")
    ] * 2
    assert rows[0]["cost_usd"] is None and rows[0]["usage_source"] == "none"


def test_multipart_upload_reaches_upstream_intact(start_proxy, tmp_path):
    proxy = start_proxy()
    data = bytes(range(256)) * 4000 + b"tail"
    path = tmp_path / "batch.jsonl"
    path.write_bytes(data)
    with client_for(proxy) as client, path.open("rb") as handle:
        raw = client.files.with_raw_response.create(file=handle, purpose="batch")
    echoed = raw.http_response.json()
    assert echoed["fields"]["file"] == {
        "filename": "batch.jsonl",
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    assert echoed["fields"]["purpose"]["bytes"] == len(b"batch")
    (row,) = proxy.rows(1)
    assert (row["method"], row["path"], row["http_status"]) == ("POST", "/v1/files", 200)


def test_binary_download_and_streamed_binary(start_proxy):
    proxy = start_proxy()
    with client_for(proxy) as client:
        content = client.files.content("file-abc")
        assert content.content == binary_payload()
        speech = client.audio.speech.create(model="tts-1", voice="alloy", input="hello")
        assert speech.content == binary_payload()
        assert speech.response.headers["content-type"] == "audio/mpeg"
    download, spoken = proxy.rows(2)
    assert (download["path"], download["price_status"]) == ("/v1/files/file-abc/content", "not_metered")
    # speech is metered, its audio relayed as it arrives: "hello" is 5 characters x $15.00 / 1M (tts-1)
    assert (spoken["endpoint"], spoken["price_status"], spoken["input_characters"], spoken["cost_usd"]) == (
        "audio_speech",
        "priced",
        5,
        Decimal("0.000075"),
    )


def test_healthz(start_proxy):
    proxy = start_proxy()
    health = httpx.get(f"{proxy.url}/healthz")  # the details: tests/test_health_metrics.py
    assert health.status_code == 200 and health.json()["status"] == "ok"
