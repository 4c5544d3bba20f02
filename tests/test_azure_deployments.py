"""Azure OpenAI's deployment URLs through tokenward: the real ``openai.AzureOpenAI`` client, a raw upstream.

``AzureOpenAI(azure_endpoint=<tokenward>)`` sends ``POST /openai/deployments/{deployment}/chat/completions
?api-version=...`` with an ``api-key`` header. tokenward forwards those to the Azure upstream under its
``/openai`` path, meters them like ``/v1`` requests, and refuses every other path under a deployment.

Prices (builtin catalog, shared/reference/usage-and-pricing.md 2.1): gpt-4o $2.50 in, $1.25 cached in,
$10.00 out per 1M tokens.
"""

from __future__ import annotations

import http.client
import json
from decimal import Decimal

import httpx
import openai
import pytest

from tokenward.proxy.config import UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.edge import parse_base, target

from .raw_upstream import LAST_CHUNK, chunk, json_reply, sse_head

API_VERSION = "2024-10-21"
USAGE = {"prompt_tokens": 1200, "completion_tokens": 50, "total_tokens": 1250,
         "prompt_tokens_details": {"cached_tokens": 1024}}  # fmt: skip
# (1200 - 1024) x 2.50 + 1024 x 1.25 + 50 x 10.00 = 440 + 1280 + 500 = 2220 per 1M -> $0.00222
COST = Decimal("0.00222")


def azure_reply(stream: bool) -> list[bytes]:
    """A gpt-4o reply as Azure sends it (the deployment's model snapshot in ``model``)."""
    base = {"id": "chatcmpl-az", "created": 1764633600, "model": "gpt-4o-2024-08-06", "system_fingerprint": "fp_az"}
    if not stream:
        message = {"role": "assistant", "content": "Hello"}
        body = {**base, "object": "chat.completion", "usage": USAGE,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # fmt: skip
        return [json_reply(json.dumps(body).encode())]
    events = [
        {"id": "", "object": "", "created": 0, "model": "", "choices": [], "prompt_filter_results": []},  # Azure's first
        {**base, "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hello"}, "finish_reason": None}]},
        {**base, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**base, "object": "chat.completion.chunk", "choices": [], "usage": USAGE},
    ]  # fmt: skip
    lines = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
    return [sse_head(), *(chunk(line) for line in lines), LAST_CHUNK]


@pytest.fixture
def upstream(raw_upstream):
    return raw_upstream


@pytest.fixture
def proxy(start_proxy, upstream):
    upstreams = [
        UpstreamConfig(name="openai", base_url=f"{upstream.url}/v1", provider="openai", default=True),
        UpstreamConfig(
            name="azure",
            base_url=f"{upstream.url}/openai",
            provider="azure",
            api_key_header="api-key",
            api_key_prefix="",
        ),
    ]
    return start_proxy(upstreams=upstreams)


def azure_client(proxy) -> openai.AzureOpenAI:
    return openai.AzureOpenAI(azure_endpoint=proxy.url, api_key="az-key", api_version=API_VERSION, max_retries=0)


def request_line(head: bytes) -> bytes:
    return head.split(b"\r\n", 1)[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_azure_client_is_forwarded_to_its_deployment_and_metered(proxy, upstream, stream):
    upstream.script = lambda head, body: azure_reply(stream)
    client = azure_client(proxy)
    request = {"model": "chat-prod", "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**request, stream=True)
            if c.choices
        )
    else:
        text = client.chat.completions.create(**request).choices[0].message.content
    assert text == "Hello"
    ((head, body),) = upstream.requests
    # the deployment URL under the upstream's /openai path, the query byte for byte, the client's key as api-key
    assert (
        request_line(head)
        == f"POST /openai/deployments/chat-prod/chat/completions?api-version={API_VERSION} HTTP/1.1".encode()
    )
    assert b"\r\napi-key: az-key\r\n" in head.lower()
    assert json.loads(body)["model"] == "chat-prod"
    (row,) = proxy.rows(1)
    assert (row["endpoint"], row["upstream"], row["outcome"], row["http_status"]) == (
        "chat_completions", "azure", "ok", 200,
    )  # fmt: skip
    assert (row["input_tokens"], row["cached_input_tokens"], row["output_tokens"]) == (1200, 1024, 50)
    assert (row["requested_model"], row["served_model"]) == ("chat-prod", "gpt-4o-2024-08-06")
    assert (row["cost_usd"], row["price_status"]) == (COST, "priced")
    assert row["path"] == "/openai/deployments/chat-prod/chat/completions"


def test_a_streamed_deployment_request_asks_for_usage_like_v1(proxy, upstream):
    """tokenward adds ``stream_options.include_usage`` (and strips the usage chunk back out) as under /v1."""
    upstream.script = lambda head, body: azure_reply(True)
    stream = azure_client(proxy).chat.completions.create(
        model="chat-prod", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    chunks = list(stream)
    ((_, body),) = upstream.requests
    assert json.loads(body)["stream_options"] == {"include_usage": True}
    assert [c.usage for c in chunks if c.usage is not None] == []  # the client did not ask: it sees none
    (row,) = proxy.rows(1)
    assert (row["output_tokens"], row["cost_usd"]) == (50, COST)


def test_without_an_azure_upstream_deployment_urls_are_refused_and_recorded(start_proxy, upstream):
    proxy = start_proxy(upstreams=[UpstreamConfig(name="openai", base_url=f"{upstream.url}/v1", default=True)])
    upstream.script = lambda head, body: azure_reply(False)
    with pytest.raises(openai.NotFoundError) as caught:
        azure_client(proxy).chat.completions.create(model="chat-prod", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "deployment_not_found"
    assert upstream.requests == []  # not sent to the OpenAI upstream as /v1/... or anything else
    (row,) = proxy.rows(1)
    assert (row["endpoint"], row["outcome"], row["http_status"]) == ("chat_completions", "client_error", 404)


@pytest.mark.parametrize(
    "path",
    [
        "/openai/deployments/chat-prod/files",  # not a model endpoint of a deployment
        "/openai/deployments/chat-prod/messages",  # the Anthropic dialect's path, not Azure's
        "/openai/deployments/chat-prod",
        "/openai/messages",  # nor under Azure's other paths (tests/test_azure_api.py has those that pass)
        "/openai/v1/messages",
    ],
)
def test_other_openai_paths_are_not_forwarded(proxy, upstream, path):
    upstream.script = lambda head, body: azure_reply(False)
    reply = httpx.post(proxy.url + path + f"?api-version={API_VERSION}", json={"model": "x"}, headers={"api-key": "k"})
    assert reply.status_code == 404
    # before: "... the OpenAI-compatible API is under /v1.", as if the deployment URLs did not exist
    assert reply.json()["error"]["message"] == (
        f"Unknown path {path}: under /openai/ tokenward serves Azure OpenAI's API: a POST to a deployment's "
        "model endpoints (/openai/deployments/{deployment}/chat/completions, /completions, /embeddings, "
        "/images/... and /audio/...) and the OpenAI API's other paths with ?api-version= (/openai/responses, "
        "/openai/files, /openai/batches, ...) or under /openai/v1/; Anthropic's paths are not Azure's."
    )
    assert upstream.requests == []


@pytest.mark.parametrize(
    "path",
    [
        "/openai/deployments/chat-prod/../../v1/files",
        "/openai/deployments/chat-prod/%2e%2e/files/chat/completions",
        "/openai/deployments//chat/completions",
        "/openai/deployments/a%2fb/chat/completions",
    ],
)
def test_deployment_paths_that_could_climb_are_refused(proxy, upstream, path):
    host, port = proxy.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)  # sends the path as written
    try:
        connection.request("POST", path, body=b'{"model": "x"}', headers={"api-key": "k"})
        reply = connection.getresponse()
        status, error = reply.status, json.loads(reply.read())["error"]
    finally:
        connection.close()
    assert (status, error["code"]) == (400, "invalid_path")
    assert upstream.requests == []


def test_a_non_azure_upstream_named_for_a_deployment_url_is_refused(proxy, upstream):
    reply = httpx.post(
        proxy.url + "/openai/deployments/chat-prod/chat/completions",
        json={"messages": []},
        headers={"api-key": "k", "x-tokenward-upstream": "openai"},
    )
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "not_an_azure_upstream")
    assert upstream.requests == []


@pytest.mark.parametrize(
    "base",
    ["https://r.openai.azure.com", "https://r.openai.azure.com/openai", "https://r.openai.azure.com/openai/v1"],
)
def test_every_form_of_an_azure_base_gives_the_same_deployment_url(base):
    found = target(b"/openai/deployments/gpt-4o-mini/embeddings", "POST", b"api-version=2024-10-21")
    assert found is not None and (found.deployment, found.tail, found.endpoint.name) == (
        "gpt-4o-mini", "embeddings", "embeddings",
    )  # fmt: skip
    url = parse_base(base).azure_url(found)
    assert str(url) == "https://r.openai.azure.com/openai/deployments/gpt-4o-mini/embeddings?api-version=2024-10-21"


def test_with_virtual_keys_the_azure_key_replaces_the_clients(start_proxy, upstream, monkeypatch):
    """The client's ``api-key`` is its virtual key; the upstream gets tokenward's Azure key instead, never both."""
    monkeypatch.setenv("AZURE_UPSTREAM_KEY", "azure-secret")
    proxy = start_proxy(
        upstreams=[
            UpstreamConfig(
                name="azure", base_url=f"{upstream.url}/openai/v1", provider="azure", api_key_header="api-key",
                api_key_prefix="", api_key_env="AZURE_UPSTREAM_KEY", default=True,
            )
        ],
        auth="virtual_keys",
        keys=[VirtualKeyConfig(name="team-a", key="tw-team-a-key-0001", team="research")],
    )  # fmt: skip
    upstream.script = lambda head, body: azure_reply(False)
    client = openai.AzureOpenAI(
        azure_endpoint=proxy.url, api_key="tw-team-a-key-0001", api_version=API_VERSION, max_retries=0
    )
    client.chat.completions.create(model="chat-prod", messages=[{"role": "user", "content": "hi"}])
    ((head, _),) = upstream.requests
    assert request_line(head).startswith(b"POST /openai/deployments/chat-prod/chat/completions?")
    key_lines = [line for line in head.lower().split(b"\r\n") if line.startswith((b"api-key:", b"authorization:"))]
    assert key_lines == [b"api-key: azure-secret"]
    (row,) = proxy.rows(1)
    assert (row["key_id"].startswith("vk-"), row["team"], row["cost_usd"]) == (True, "research", COST)

    with pytest.raises(openai.AuthenticationError):  # a wrong virtual key does not reach Azure
        openai.AzureOpenAI(
            azure_endpoint=proxy.url, api_key="tw-wrong", api_version=API_VERSION, max_retries=0
        ).chat.completions.create(model="chat-prod", messages=[{"role": "user", "content": "hi"}])
    assert len(upstream.requests) == 1
