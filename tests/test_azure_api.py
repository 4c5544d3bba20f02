"""Azure OpenAI's own paths besides the deployment URLs: ``/openai/{tail}?api-version=...`` and ``/openai/v1/{tail}``.

The real ``openai.AzureOpenAI`` client sends only the model endpoints to deployment URLs
(``/openai/deployments/{name}/chat/completions``); the Responses API, files, batches, vector stores
and the rest go to ``{azure_endpoint}/openai/{tail}?api-version=...``. tokenward forwards those to the
Azure upstream under its ``/openai`` path, meters them like ``/v1`` requests and holds their objects
to the key that made them, as under ``/v1``. The upstream is :mod:`tests.object_store`, whose routes
read the path below its first segment, so it serves ``/openai/files`` as it serves ``/v1/files``.

Price (builtin catalog, shared/reference/usage-and-pricing.md 2.1): gpt-4o-mini $0.15 in, $0.60 out per
1M tokens. The store answers every response with 12 in / 4 out: 12 x 0.15 + 4 x 0.60 = 4.2 per 1M.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import read_rows
from tests.object_store import ObjectStore
from tokenward.proxy.app import create_app
from tokenward.proxy.config import AuthConfig, Config, LedgerConfig, UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.edge import parse_base, target
from tokenward.proxy.keys import key_id
from tokenward.proxy.server import running_in_thread

API_VERSION = "2025-04-01-preview"
SECRET = "azure-account-secret"
ALICE, BOB = "tw-alice-azure-0123456", "tw-bob-azure-01234567"
VK_ALICE, VK_BOB = (key_id(hashlib.sha256(k.encode()).hexdigest()) for k in (ALICE, BOB))
COST = Decimal("0.0000042")


@pytest.fixture
def store() -> Iterator[ObjectStore]:
    with ObjectStore().running() as running:
        yield running


def azure_config(store: ObjectStore, ledger: Path, *, azure: bool = True) -> Config:
    root = store.url.removesuffix("/v1")
    upstreams = [UpstreamConfig(name="openai", base_url=store.url, api_key_env="AZ_SECRET", default=True)]
    if azure:
        upstreams.append(
            UpstreamConfig(
                name="azure", base_url=f"{root}/openai", provider="azure", api_key_env="AZ_SECRET",
                api_key_header="api-key", api_key_prefix="",
            )
        )  # fmt: skip
    return Config(
        upstreams=upstreams,
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        auth=AuthConfig(mode="virtual_keys", allow_unmetered=["*"]),
        virtual_keys=[VirtualKeyConfig(name="alice", key=ALICE), VirtualKeyConfig(name="bob", key=BOB)],
    )


@pytest.fixture
def proxy(store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("AZ_SECRET", SECRET)
    with running_in_thread(create_app(azure_config(store, tmp_path / "l.duckdb"))) as url:
        yield url


OPENED: list[openai.AzureOpenAI | openai.OpenAI] = []


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    yield
    while OPENED:
        OPENED.pop().close()


def azure(url: str, key: str) -> openai.AzureOpenAI:
    client = openai.AzureOpenAI(azure_endpoint=url, api_key=key, api_version=API_VERSION, max_retries=0)
    OPENED.append(client)
    return client


def rows(ledger: Path, expect: int) -> list[dict]:
    import time

    deadline = time.monotonic() + 10
    while True:
        found = read_rows(ledger) if ledger.exists() else []
        if len(found) >= expect or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_the_responses_api_of_an_azure_client_is_forwarded_and_metered(proxy, store, tmp_path):
    """``AzureOpenAI.responses.create`` posts ``/openai/responses?api-version=...``: before, a 404 that reached nothing."""
    response = azure(proxy, ALICE).responses.create(model="gpt-4o-mini", input="hi")
    assert response.status == "completed"
    assert store.requests == [("POST", f"/openai/responses?api-version={API_VERSION}")]
    assert store.headers[0]["api-key"] == SECRET  # tokenward's Azure key, not alice's virtual key
    assert "authorization" not in store.headers[0]
    (row,) = rows(tmp_path / "l.duckdb", 1)
    assert (row["endpoint"], row["upstream"], row["outcome"], row["key_id"]) == ("responses", "azure", "ok", VK_ALICE)
    assert (row["input_tokens"], row["output_tokens"], row["cost_usd"]) == (12, 4, COST)
    assert row["path"] == "/openai/responses"


def test_a_stored_response_and_a_file_are_their_keys_own_under_the_azure_paths(proxy, store, tmp_path):
    """Object isolation reads ``/openai/{tail}`` as it reads ``/v1/{tail}``: bob gets 404 for alice's objects."""
    alice, bob = azure(proxy, ALICE), azure(proxy, BOB)
    response = alice.responses.create(model="gpt-4o-mini", input="hi")
    uploaded = alice.files.create(file=("in.jsonl", b'{"custom_id": "1"}\n'), purpose="batch")
    assert alice.files.retrieve(uploaded.id).id == uploaded.id
    assert alice.responses.retrieve(response.id).id == response.id
    seen = len(store.requests)
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.delete(uploaded.id)
    assert len(store.requests) == seen  # none of bob's reached the account
    assert [f.id for f in bob.files.list()] == []
    assert [f.id for f in alice.files.list()] == [uploaded.id]
    assert uploaded.id in store.objects  # still there
    found = rows(tmp_path / "l.duckdb", 10)
    assert sum(1 for r in found if r["key_id"] == VK_BOB and r["http_status"] == 404) == 4


def test_a_batch_under_the_azure_paths_is_checked_on_its_input_file(proxy, store):
    """A batch names its input file: bob's batch on alice's file is refused; alice's reads it with her api-version."""
    alice, bob = azure(proxy, ALICE), azure(proxy, BOB)
    line = {"custom_id": "1", "method": "POST", "url": "/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}}  # fmt: skip
    uploaded = alice.files.create(file=("in.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch")
    seen = len(store.requests)
    with pytest.raises(openai.NotFoundError):
        bob.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert len(store.requests) == seen
    batch = alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert (batch.input_file_id, batch.id in store.objects) == (uploaded.id, True)
    assert store.requests[seen:] == [
        ("GET", f"/openai/files/{uploaded.id}/content?api-version={API_VERSION}"),  # the lines, checked first
        ("POST", f"/openai/batches?api-version={API_VERSION}"),
    ]


def test_the_v1_api_under_the_openai_path_goes_to_the_azure_upstream(proxy, store, tmp_path):
    """``OpenAI(base_url=<tokenward>/openai/v1)``, as Azure's v1 docs write it, reaches ``<resource>/openai/v1``."""
    client = openai.OpenAI(base_url=f"{proxy}/openai/v1", api_key=ALICE, max_retries=0)
    OPENED.append(client)
    with pytest.raises(openai.NotFoundError):  # the store routes /openai/v1/... as an unknown collection "v1"
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert store.requests == [("POST", "/openai/v1/chat/completions")]
    assert store.headers[0]["api-key"] == SECRET
    (row,) = rows(tmp_path / "l.duckdb", 1)
    assert (row["endpoint"], row["upstream"], row["http_status"]) == ("chat_completions", "azure", 404)


def test_without_an_azure_upstream_the_azure_paths_are_refused_and_recorded(store, tmp_path, monkeypatch):
    monkeypatch.setenv("AZ_SECRET", SECRET)
    ledger = tmp_path / "l.duckdb"
    with running_in_thread(create_app(azure_config(store, ledger, azure=False))) as url:
        with pytest.raises(openai.NotFoundError) as caught:
            azure(url, ALICE).responses.create(model="gpt-4o-mini", input="hi")
        listed = httpx.get(f"{url}/openai/files?api-version={API_VERSION}", headers={"api-key": ALICE})
    assert caught.value.body["code"] == "not_found"
    assert "/openai/" in caught.value.body["message"] and "/v1/" in caught.value.body["message"]
    assert (listed.status_code, listed.json()["error"]["code"]) == (404, "not_found")
    assert store.requests == []  # not sent to the OpenAI upstream as /v1/... or anything else
    found = rows(ledger, 2)
    assert sorted((r["endpoint"], r["http_status"]) for r in found) == [("passthrough", 404), ("responses", 404)]


@pytest.mark.parametrize(
    ("path", "method", "expected"),
    [
        (b"/openai/responses", "POST", "https://r.openai.azure.com/openai/responses?api-version=v"),
        (b"/openai/files/file-1/content", "GET", "https://r.openai.azure.com/openai/files/file-1/content?api-version=v"),
        (b"/openai/v1/responses", "POST", "https://r.openai.azure.com/openai/v1/responses?api-version=v"),
        (b"/openai/deployments/d/embeddings", "POST", "https://r.openai.azure.com/openai/deployments/d/embeddings?api-version=v"),
    ],
)  # fmt: skip
@pytest.mark.parametrize(
    "base",
    ["https://r.openai.azure.com", "https://r.openai.azure.com/openai", "https://r.openai.azure.com/openai/v1"],
)
def test_every_form_of_an_azure_base_gives_the_same_url(base, path, method, expected):
    found = target(path, method, b"api-version=v")
    assert found is not None and found.azure is not None
    assert str(parse_base(base).azure_url(found)) == expected


@pytest.mark.parametrize(
    ("path", "method", "tail", "endpoint"),
    [
        (b"/openai/responses", "POST", "responses", "responses"),
        (b"/openai/v1/chat/completions", "POST", "chat/completions", "chat_completions"),
        (b"/openai/files/file-1", "DELETE", "files/file-1", None),
        (b"/openai/vector_stores", "GET", "vector_stores", None),
    ],
)
def test_an_azure_path_has_the_tail_metering_and_isolation_read(path, method, tail, endpoint):
    found = target(path, method)
    assert found is not None
    assert (found.tail, found.endpoint.name if found.endpoint else None) == (tail, endpoint)


@pytest.mark.parametrize(
    "path",
    [
        b"/openai/messages",  # Anthropic's dialect: Azure OpenAI does not serve it
        b"/openai/v1/messages",
        b"/openai/deployments",
        b"/openai/v1/v1/chat/completions",
        b"/openai/v1/deployments/d/chat/completions",
        b"/openai/V1/deployments/d/chat/completions",
    ],
)
def test_paths_under_openai_that_are_not_azures_api_are_not_targets(path):
    assert target(path, "POST") is None
