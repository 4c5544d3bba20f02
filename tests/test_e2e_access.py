"""Who may reach what, and who spent it: the unmetered allow-list, attribution rules, one credential per request."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import read_rows
from tests.servers import Servers, api, raw_request
from tokenward.proxy.app import create_app
from tokenward.proxy.config import (
    AttributionRule,
    AttributionSettings,
    AuthConfig,
    Config,
    LedgerConfig,
    UpstreamConfig,
    VirtualKeyConfig,
)
from tokenward.proxy.keys import fingerprint
from tokenward.proxy.server import running_in_thread

SECRET = "sk-upstream-secret-access"
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "three primes"}]}


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    with Servers(api).running() as running:
        yield running


@pytest.fixture(autouse=True)
def upstream_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCESS_SECRET", SECRET)


@contextmanager
def proxy(
    servers: Servers, ledger: Path, auth: AuthConfig, keys: list[VirtualKeyConfig] | None = None
) -> Iterator[str]:
    config = Config(
        upstreams=[
            UpstreamConfig(
                name="openai",
                base_url=f"{servers.upstream_url}/openai/v1",
                provider="openai",
                api_key_env="ACCESS_SECRET",
                default=True,
            ),
            UpstreamConfig(
                name="claude",
                base_url=f"{servers.upstream_url}/anthropic/v1",
                provider="anthropic",
                api_key_env="ACCESS_SECRET",
                api_key_header="x-api-key",
                api_key_prefix="",
            ),
        ],
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        auth=auth,
        virtual_keys=keys or [],
    )
    with running_in_thread(create_app(config)) as url:
        yield url


def gpt(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


KEYS = [VirtualKeyConfig(name="team-a", key="tw-team-a-0001"), VirtualKeyConfig(name="team-b", key="tw-team-b-0002")]


def test_unmetered_endpoints_are_refused_in_virtual_keys_mode_unless_allowed(servers, tmp_path, tmp_path_factory):
    ledger = tmp_path / "ledger.duckdb"
    before = len(servers.requests)
    with proxy(servers, ledger, AuthConfig(mode="virtual_keys"), KEYS) as url, gpt(url, "tw-team-a-0001") as client:
        with pytest.raises(openai.PermissionDeniedError) as info:
            client.files.create(file=("batch.jsonl", b'{"x": 1}\n'), purpose="batch")
        assert [m.id for m in client.models.list().data] == ["gpt-4o-mini"]  # free: allowed by default
        assert client.models.retrieve("gpt-4o-mini") is not None
        with pytest.raises(openai.PermissionDeniedError):
            client.models.delete("ft:gpt-4o-mini:acme:1")  # deleting a fine-tune is not free
        with pytest.raises(openai.PermissionDeniedError):
            client.batches.list()
        completion = client.chat.completions.create(**CHAT)  # metered endpoints are what keys are for
    assert info.value.code == "endpoint_not_allowed" and info.value.status_code == 403
    assert info.value.body["type"] == "permission_error"  # type: ignore[index]
    message = info.value.body["message"]  # type: ignore[index]
    assert message == (
        "tokenward does not meter POST /v1/files, and in virtual_keys mode unmetered endpoints are refused "
        "unless allowed: add 'POST files' to auth.allow_unmetered to let it pass."
    )
    assert completion.usage is not None and completion.usage.prompt_tokens == 9
    assert [s["target"] for s in servers.requests[before:]] == [
        "/openai/v1/models",
        "/openai/v1/models/gpt-4o-mini",
        "/openai/v1/chat/completions",
    ]  # refused requests never left
    rows = read_rows(ledger)
    assert [(r["method"], r["path"], r["outcome"], r["http_status"]) for r in rows] == [
        ("POST", "/v1/files", "rejected", 403),
        ("GET", "/v1/models", "ok", 200),
        ("GET", "/v1/models/gpt-4o-mini", "ok", 200),
        ("DELETE", "/v1/models/ft:gpt-4o-mini:acme:1", "rejected", 403),
        ("GET", "/v1/batches", "rejected", 403),
        ("POST", "/v1/chat/completions", "ok", 200),
    ]
    assert {r["principal"] for r in rows} == {"team-a"}


def test_the_allow_list_is_global_and_a_key_can_replace_it(servers, tmp_path):
    auth = AuthConfig(mode="virtual_keys", allow_unmetered=["files", "files/*", "GET models"])
    keys = [KEYS[0], VirtualKeyConfig(name="team-b", key="tw-team-b-0002", allow_unmetered=["GET files"])]
    with proxy(servers, tmp_path / "ledger.duckdb", auth, keys) as url:
        with gpt(url, "tw-team-a-0001") as a:
            uploaded = a.files.with_raw_response.create(file=("batch.jsonl", b'{"x": 1}\n'), purpose="batch")
            assert uploaded.status_code == 200 and servers.requests[-1]["target"] == "/openai/v1/files"
            assert servers.requests[-1]["headers"]["authorization"] == f"Bearer {SECRET}"
            a.files.with_raw_response.delete("file-1")
            assert servers.requests[-1]["method"] == "DELETE"
        with gpt(url, "tw-team-b-0002") as b:
            assert b.files.list().data == []  # team-a's file-1 is not team-b's
            with pytest.raises(openai.PermissionDeniedError) as info:
                b.files.create(file=("batch.jsonl", b"{}\n"), purpose="batch")
            with pytest.raises(openai.PermissionDeniedError):
                b.models.list()  # the key's list replaces the global one
    assert "add 'POST files' to virtual_keys[1].allow_unmetered (key 'team-b')" in info.value.body["message"]


def test_passthrough_mode_forwards_every_endpoint_as_before(servers, tmp_path):
    auth = AuthConfig(mode="passthrough", allow_unmetered=[])
    with proxy(servers, tmp_path / "ledger.duckdb", auth) as url, gpt(url, "sk-client-own") as client:
        client.files.with_raw_response.create(file=("batch.jsonl", b"{}\n"), purpose="batch")
        client.batches.with_raw_response.list()
    assert [s["target"] for s in servers.requests[-2:]] == ["/openai/v1/files", "/openai/v1/batches"]
    assert servers.requests[-1]["headers"]["authorization"] == "Bearer sk-client-own"


def attribution_keys() -> list[VirtualKeyConfig]:
    return [
        VirtualKeyConfig(
            name="svc",
            key="tw-svc-0001",
            attribution=AttributionSettings(
                end_user=AttributionRule(pinned="svc-batch"), tags=AttributionRule(pinned=["batch", "nightly"])
            ),
        ),
        VirtualKeyConfig(
            name="app-b",
            key="tw-app-b-0002",
            attribution=AttributionSettings(
                end_user=AttributionRule(prefix="b/", required=True),
                tags=AttributionRule(allow=["eval", "prod"]),
            ),
        ),
        VirtualKeyConfig(name="open", key="tw-open-0003"),
    ]


def test_attribution_is_pinned_bounded_or_taken_from_the_client_per_key(servers, tmp_path):
    ledger = tmp_path / "ledger.duckdb"
    auth = AuthConfig(mode="virtual_keys", attribution=AttributionSettings(session=AttributionRule(prefix="run-")))
    refusals: list[Any] = []
    with proxy(servers, ledger, auth, attribution_keys()) as url:
        with gpt(url, "tw-svc-0001") as svc:  # the client's claims are ignored: the key says who spends
            svc.chat.completions.create(
                **CHAT,
                user="user-b",
                extra_headers={
                    "x-tokenward-user": "user-b",
                    "x-tokenward-tags": "prod",
                    "x-tokenward-session": "run-1",
                },
            )
        with gpt(url, "tw-app-b-0002") as app:
            app.chat.completions.create(**CHAT, user="b/alice", extra_headers={"x-tokenward-tags": "prod,eval"})
            for user, tags, session in (
                ("alice", "prod", "run-2"),  # outside the key's prefix
                ("b/alice", "prod,staging", "run-2"),  # a tag outside the allowlist
                (None, "prod", "run-2"),  # no end user, and the key requires one
                ("b/alice", "prod", "other-2"),  # a session outside the global prefix
            ):
                with pytest.raises(openai.PermissionDeniedError) as info:
                    app.chat.completions.create(
                        **CHAT,
                        **({"user": user} if user else {}),
                        extra_headers={"x-tokenward-tags": tags, "x-tokenward-session": session},
                    )
                refusals.append(info.value)
        with gpt(url, "tw-open-0003") as other:
            other.chat.completions.create(**CHAT, user="anyone", extra_headers={"x-tokenward-session": "run-9"})
        claude = anthropic.Anthropic(base_url=url, api_key="tw-app-b-0002", max_retries=0)
        claude.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=5,
            messages=[{"role": "user", "content": "hi"}],
            metadata={"user_id": "b/carol"},
        )
        with pytest.raises(anthropic.PermissionDeniedError):
            claude.messages.create(
                model="claude-sonnet-4-5",
                max_tokens=5,
                messages=[{"role": "user", "content": "hi"}],
                metadata={"user_id": "mallory"},
            )
        claude.close()
    assert [(e.status_code, e.code) for e in refusals] == [(403, "attribution_refused")] * 4
    assert [e.body["message"] for e in refusals] == [
        "end_user 'alice' is not allowed for this key: it must start with 'b/' (virtual_keys[1].attribution.end_user).",
        "tag 'staging' is not allowed for this key: it must be one of ['eval', 'prod'] (virtual_keys[1].attribution.tags).",
        "This key must name its end_user (the request's user field, metadata.user_id or X-Tokenward-User): "
        "virtual_keys[1].attribution.end_user.required is set.",
        "session 'other-2' is not allowed for this key: it must start with 'run-' (auth.attribution.session).",
    ]
    rows = read_rows(ledger, "WHERE outcome = 'ok'")
    assert [(r["principal"], r["end_user"], list(r["tags"] or []), r["session_id"]) for r in rows] == [
        ("svc", "svc-batch", ["batch", "nightly"], "run-1"),
        ("app-b", "b/alice", ["eval", "prod"], None),
        ("open", "anyone", [], "run-9"),
        ("app-b", "b/carol", [], None),
    ]
    refused = read_rows(ledger, "WHERE outcome = 'rejected'")
    assert [(r["principal"], r["http_status"]) for r in refused] == [("app-b", 403)] * 5


def test_one_credential_per_request_and_the_fingerprint_of_the_one_sent(servers, tmp_path):
    ledger = tmp_path / "ledger.duckdb"
    before = len(servers.requests)
    body = b'{"model": "gpt-4o-mini", "messages": []}'
    with proxy(servers, ledger, AuthConfig(mode="passthrough")) as url:
        statuses = [
            raw_request(url, "POST", b"/v1/chat/completions", headers, body)
            for headers in (
                {"x-api-key": "decoy-1", "authorization": "Bearer sk-real"},  # a decoy before the real key
                {"authorization": "Bearer sk-real", "api-key": "decoy-2"},
            )
        ]
        twice = httpx.post(
            f"{url}/v1/chat/completions",
            content=body,
            headers=[("authorization", "Bearer a"), ("authorization", "Bearer b")],
        )
        sent = len(servers.requests)
        with gpt(url, "sk-real") as client:
            client.chat.completions.create(**CHAT)
        claude = anthropic.Anthropic(base_url=url, api_key="sk-real", max_retries=0)
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        claude.close()
        httpx.post(
            f"{url}/v1/messages",
            json={"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": []},
            headers={"x-api-key": "sk-real", "anthropic-version": "2023-06-01"},
        )
        httpx.get(f"{url}/v1/models", headers={"authorization": "Basic dXNlcjpwdw=="})
    assert [status for status, _ in statuses] == [400, 400] and twice.status_code == 400
    assert twice.json()["error"]["code"] == "ambiguous_credentials"
    assert sent == before  # none of them was forwarded
    assert servers.requests[-2]["headers"]["x-api-key"] == "sk-real"  # forwarded untouched in passthrough mode
    rows = read_rows(ledger)
    assert [(r["principal"], r["http_status"]) for r in rows] == [
        ("anonymous", 400),
        ("anonymous", 400),
        ("anonymous", 400),
        (fingerprint("sk-real"), 200),  # the same key through either SDK or header is the same principal
        (fingerprint("sk-real"), 200),
        (fingerprint("sk-real"), 200),
        (fingerprint("Basic dXNlcjpwdw=="), 200),  # what the upstream checks, not "anonymous"
    ]


def test_a_virtual_key_cannot_pick_the_accounts_organization_or_project(servers, tmp_path):
    """OpenAI-Organization / OpenAI-Project choose who is billed; they go with tokenward's key, not the client."""
    account = {"OpenAI-Organization": "org-someone-else", "OpenAI-Project": "proj-someone-else"}
    auth = AuthConfig(mode="virtual_keys")
    with proxy(servers, tmp_path / "ledger.duckdb", auth, KEYS) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="tw-team-a-0001", default_headers=account) as client:
            client.chat.completions.create(**CHAT)
    sent = servers.requests[-1]["headers"]
    assert sent["authorization"] == f"Bearer {SECRET}"
    assert "openai-organization" not in sent and "openai-project" not in sent
    with proxy(servers, tmp_path / "other.duckdb", AuthConfig(mode="passthrough")) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-client-own", default_headers=account) as client:
            client.chat.completions.create(**CHAT)
    sent = servers.requests[-1]["headers"]
    assert (sent["openai-organization"], sent["openai-project"]) == ("org-someone-else", "proj-someone-else")


def test_a_google_key_in_a_header_or_the_query_is_one_caller_with_one_fingerprint(servers, tmp_path):
    """Before, in passthrough mode: Google's credentials (``x-goog-api-key``, ``?key=``) were not read, so a Gemini
    client that sent its key that way was ``anonymous``, and one that added a made-up ``Authorization`` beside it
    was attributed to that decoy: every new decoy minted a new ``fp-`` principal (a new per-key budget) while the
    upstream billed the same key. Now each form of one key is that key's fingerprint, and two different
    credentials in one request are 400 ``ambiguous_credentials``, nothing sent."""
    ledger = tmp_path / "ledger.duckdb"
    body = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}'
    json_type = {"content-type": "application/json"}
    with proxy(servers, ledger, AuthConfig(mode="passthrough")) as url:
        sent = len(servers.requests)
        refused = [
            httpx.post(f"{url}/v1/chat/completions{query}", content=body, headers={**json_type, **headers})
            for query, headers in (
                ("", {"x-goog-api-key": "AIza-real", "authorization": "Bearer decoy-1"}),
                ("?key=AIza-real", {"authorization": "Bearer decoy-2"}),
                ("?key=AIza-real", {"x-goog-api-key": "AIza-other"}),
                ("?key=AIza-real&%4Bey=AIza-other", {}),
            )
        ]
        assert [(r.status_code, r.json()["error"]["code"]) for r in refused] == [(400, "ambiguous_credentials")] * 4
        assert len(servers.requests) == sent
        accepted = [
            httpx.post(f"{url}/v1/chat/completions{query}", content=body, headers={**json_type, **headers})
            for query, headers in (
                ("", {"x-goog-api-key": "AIza-real"}),
                ("?key=AIza-real", {}),
                ("?key=AIza%2Dreal", {"x-goog-api-key": "AIza-real", "authorization": "Bearer AIza-real"}),
            )
        ]
        assert [r.status_code for r in accepted] == [200, 200, 200]
    rows = read_rows(ledger)
    assert [(r["principal"], r["http_status"]) for r in rows] == [("anonymous", 400)] * 4 + [
        (fingerprint("AIza-real"), 200)
    ] * 3
