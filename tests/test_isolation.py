"""Tenant isolation end to end: two keys (and an admin) on one provider account, the real SDKs, a real upstream.

The upstream (:mod:`tests.object_store`) is one account holding every key's objects, as a provider is; only
tokenward stands between alice's objects and bob. Every refusal must be the same 404 whether the id is
another key's, has no owner or does not exist, must never reach the upstream, and must leave a ledger row.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import read_rows
from tests.crashkit import ProxyProcess
from tests.object_store import ObjectStore
from tokenward.proxy.app import create_app
from tokenward.proxy.config import AuthConfig, Config, LedgerConfig, UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.keys import key_id
from tokenward.proxy.server import running_in_thread

SECRET = "sk-account-secret-objects"
ALICE, BOB, OPS = "tw-alice-0123456789", "tw-bob-0123456789ab", "tw-ops-0123456789abc"
KEYS = [
    VirtualKeyConfig(name="alice", key=ALICE),
    VirtualKeyConfig(name="bob", key=BOB),
    VirtualKeyConfig(name="ops", key=OPS, role="admin"),
]
VK_ALICE, VK_BOB, VK_OPS = (key_id(hashlib.sha256(k.encode()).hexdigest()) for k in (ALICE, BOB, OPS))
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def store() -> Iterator[ObjectStore]:
    with ObjectStore().running() as running:
        yield running


@pytest.fixture(autouse=True)
def account_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OBJECTS_SECRET", SECRET)


def config_for(store: ObjectStore, ledger: Path, mode: str = "virtual_keys") -> Config:
    return Config(
        upstreams=[
            UpstreamConfig(name="openai", base_url=store.url, api_key_env="OBJECTS_SECRET", default=True),
            UpstreamConfig(
                name="anthropic",
                base_url=store.anthropic_url,
                provider="anthropic",
                api_key_env="OBJECTS_SECRET",
                api_key_header="x-api-key",
                api_key_prefix="",
            ),
        ],
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        auth=AuthConfig(mode=mode, allow_unmetered=["*"]),  # type: ignore[arg-type]
        virtual_keys=KEYS if mode == "virtual_keys" else [],
    )


@contextmanager
def proxy(store: ObjectStore, ledger: Path, mode: str = "virtual_keys") -> Iterator[str]:
    with running_in_thread(create_app(config_for(store, ledger, mode))) as url:
        yield url


def gpt(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def not_found(kind: str, object_id: str) -> dict[str, Any]:
    """The error body a refused id gets (the SDK's ``body``): OpenAI's wording for an unknown id."""
    return {
        "message": f"No such {kind} object: {object_id}",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def refused(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(r["principal"], r["method"], r["path"], r["outcome"], r["error"]) for r in rows if r["http_status"] == 404]


def upload(client: openai.OpenAI, name: str) -> str:
    return client.files.create(file=(name, f'{{"custom_id": "{name}"}}\n'.encode()), purpose="batch").id


def test_files_stay_with_the_key_that_uploaded_them(store, tmp_path):
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        mine, theirs = upload(alice, "a.jsonl"), upload(bob, "b.jsonl")
        assert [f.id for f in alice.files.list()] == [mine]
        assert [f.id for f in bob.files.list()] == [theirs]
        assert alice.files.retrieve(mine).filename == "a.jsonl"
        assert alice.files.content(mine).read() == b'{"custom_id": "a.jsonl"}\n'
        sent = len(store.requests)
        for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
            with pytest.raises(openai.NotFoundError) as info:
                call(mine)
            assert info.value.body == not_found("File", mine)
        assert store.requests[sent:] == []  # no refused request reached the account
        assert mine in store.objects
        assert alice.files.delete(mine).deleted is True
    assert mine not in store.objects
    rows = read_rows(ledger)
    note = f"refused by isolation: file {mine} belongs to key {VK_ALICE}"
    assert refused(rows) == [
        ("bob", "GET", f"/v1/files/{mine}", "rejected", note),
        ("bob", "GET", f"/v1/files/{mine}/content", "rejected", note),
        ("bob", "DELETE", f"/v1/files/{mine}", "rejected", note),
    ]
    assert {(r["upstream"], r["endpoint"], r["price_status"]) for r in rows if r["http_status"] == 404} == {
        (None, "passthrough", "not_metered")
    }
    assert len(rows) == 10  # two uploads, two lists, a read, a download, three refusals, a delete: one row each
    assert [r["http_status"] for r in rows].count(200) == 7


def test_an_admin_key_sees_every_object_and_unowned_ones_are_admin_only(store, tmp_path):
    legacy = store.add_file("before-tokenward.jsonl", b"{}\n", "batch")["id"]  # no recorded owner
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob, gpt(url, OPS) as ops:
        mine, theirs = upload(alice, "a.jsonl"), upload(bob, "b.jsonl")
        with pytest.raises(openai.NotFoundError) as info:
            alice.files.retrieve(legacy)
        assert info.value.body == not_found("File", legacy)
        assert [f.id for f in alice.files.list()] == [mine]
        assert [f.id for f in ops.files.list()] == [theirs, mine, legacy]
        assert ops.files.retrieve(theirs).filename == "b.jsonl"
        assert ops.files.content(legacy).read() == b"{}\n"
        admins = upload(ops, "ops.jsonl")  # an admin's objects are its own too
        assert [f.id for f in alice.files.list()] == [mine] and [f.id for f in bob.files.list()] == [theirs]
        assert ops.files.delete(theirs).deleted is True
    assert refused(read_rows(ledger)) == [
        (
            "alice",
            "GET",
            f"/v1/files/{legacy}",
            "rejected",
            f"refused by isolation: file {legacy} has no recorded owner",
        )
    ]
    assert admins in store.objects


def test_batches_reach_only_their_own_files_and_outputs(store, tmp_path):
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob, gpt(url, OPS) as ops:
        mine = upload(alice, "requests.jsonl")
        sent = len(store.requests)
        with pytest.raises(openai.NotFoundError) as info:  # bob names alice's file in a body
            bob.batches.create(input_file_id=mine, endpoint="/v1/chat/completions", completion_window="24h")
        assert info.value.body == not_found("File", mine)
        assert store.requests[sent:] == []
        batch = alice.batches.create(input_file_id=mine, endpoint="/v1/chat/completions", completion_window="24h")
        for call in (bob.batches.retrieve, bob.batches.cancel):
            with pytest.raises(openai.NotFoundError):
                call(batch.id)
        assert list(bob.batches.list()) == []
        # the admin reads it first: the output file the provider made belongs to alice, who owns the batch
        output = ops.batches.retrieve(batch.id).output_file_id
        assert output is not None and [b.id for b in alice.batches.list()] == [batch.id]
        assert alice.files.content(output).read() == b'{"id": "out"}\n'
        with pytest.raises(openai.NotFoundError):
            bob.files.content(output)
        assert {f.id for f in alice.files.list()} == {mine, output}
    assert [row[1:3] for row in refused(read_rows(ledger))] == [
        ("POST", "/v1/batches"),
        ("GET", f"/v1/batches/{batch.id}"),
        ("POST", f"/v1/batches/{batch.id}/cancel"),
        ("GET", f"/v1/files/{output}/content"),
    ]


def test_vector_stores_and_their_files(store, tmp_path):
    with proxy(store, tmp_path / "ledger.duckdb") as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        mine, theirs = upload(alice, "a.txt"), upload(bob, "b.txt")
        with pytest.raises(openai.NotFoundError) as info:
            bob.vector_stores.create(name="steal", file_ids=[theirs, mine])
        assert info.value.body == not_found("File", mine)
        vs_alice = alice.vector_stores.create(name="a", file_ids=[mine])
        vs_bob = bob.vector_stores.create(name="b", file_ids=[theirs])
        assert [v.id for v in alice.vector_stores.list()] == [vs_alice.id]
        assert [f.id for f in alice.vector_stores.files.list(vs_alice.id)] == [mine]
        sent = len(store.requests)
        for call in (
            lambda: bob.vector_stores.retrieve(vs_alice.id),
            lambda: bob.vector_stores.delete(vs_alice.id),
            lambda: bob.vector_stores.files.list(vs_alice.id),
            lambda: bob.vector_stores.files.create(vector_store_id=vs_alice.id, file_id=theirs),
            lambda: bob.vector_stores.files.create(vector_store_id=vs_bob.id, file_id=mine),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert store.requests[sent:] == []
        assert store.vector_store_files[vs_alice.id] == [mine] and store.vector_store_files[vs_bob.id] == [theirs]
        assert [v.id for v in bob.vector_stores.list()] == [vs_bob.id]


def test_stored_chat_completions_are_listed_and_read_only_by_their_key(store, tmp_path):
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        first = alice.chat.completions.create(**CHAT, store=True)
        with alice.chat.completions.create(**CHAT, store=True, stream=True) as stream:
            streamed = {chunk.id for chunk in stream}
        alice.chat.completions.create(**CHAT)  # not stored: nothing to own
        theirs = bob.chat.completions.create(**CHAT, store=True)
        [second] = streamed
        assert [c.id for c in alice.chat.completions.list()] == [second, first.id]
        assert [c.id for c in bob.chat.completions.list()] == [theirs.id]
        assert alice.chat.completions.retrieve(first.id).choices[0].message.content == "stored"
        assert [m.content for m in alice.chat.completions.messages.list(second)] == ["hi"]
        sent = len(store.requests)
        for call in (
            lambda: bob.chat.completions.retrieve(first.id),
            lambda: bob.chat.completions.messages.list(first.id),
            lambda: bob.chat.completions.update(first.id, metadata={"owner": "bob"}),
            lambda: bob.chat.completions.delete(second),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                call()
        assert info.value.body == not_found("ChatCompletion", second)
        assert store.requests[sent:] == []
        assert alice.chat.completions.delete(second).deleted is True
    rows = read_rows(ledger, "WHERE endpoint = 'chat_completions'")
    assert [(r["principal"], r["input_tokens"], r["output_tokens"], r["stream"]) for r in rows] == [
        ("alice", 12, 4, False),
        ("alice", 12, 4, True),
        ("alice", 12, 4, False),
        ("bob", 12, 4, False),
    ]
    # gpt-4o-mini: $0.15 in, $0.60 out per 1M tokens: 12 * 0.15e-6 + 4 * 0.60e-6
    assert {r["cost_usd"] for r in rows} == {Decimal("0.0000042")}


def test_responses_chain_only_from_their_own_key_whatever_the_json_spelling(store, tmp_path):
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        first = alice.responses.create(model="gpt-4o-mini", input="hi")
        chained = alice.responses.create(model="gpt-4o-mini", input="more", previous_response_id=first.id)
        assert chained.output_text == f"after {first.id}"
        with alice.responses.create(model="gpt-4o-mini", input="hi", stream=True) as stream:
            streamed = [e.response.id for e in stream if e.type == "response.completed"]
        assert alice.responses.retrieve(streamed[0]).id == streamed[0]
        unstored = alice.responses.create(model="gpt-4o-mini", input="hi", store=False)
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(unstored.id)  # never stored, so never owned
        own = bob.responses.create(model="gpt-4o-mini", input="hi")
        sent = len(store.requests)
        for call in (
            lambda: bob.responses.create(model="gpt-4o-mini", input="x", previous_response_id=first.id),
            lambda: bob.responses.retrieve(first.id),
            lambda: bob.responses.delete(first.id),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                call()
            assert info.value.body == not_found("Response", first.id)
        headers = {"authorization": f"Bearer {BOB}", "content-type": "application/json"}
        escaped = b'{"model": "gpt-4o-mini", "input": "x", "previous\\u005fresponse_id": "%s"}' % first.id.encode()
        twice = b'{"model": "gpt-4o-mini", "input": "x", "previous_response_id": "%s", "previous_response_id": "%s"}'
        part = {"type": "file", "file": {"file_id": upload(alice, "secret.pdf")}}
        cases = [
            (escaped, 404),
            (twice % (own.id.encode(), first.id.encode()), 400),  # the upstream might read either
            (json.dumps({**CHAT, "messages": [{"role": "user", "content": [part]}]}).encode(), 404),
        ]
        sent = len(store.requests)
        statuses = [
            httpx.post(f"{url}/v1/{path}", content=body, headers=headers).status_code
            for path, (body, _) in zip(("responses", "responses", "chat/completions"), cases, strict=True)
        ]
        assert statuses == [status for _, status in cases]
        assert store.requests[sent:] == []
    rows = read_rows(ledger, "WHERE principal = 'bob' AND http_status <> 200")
    assert [(r["endpoint"], r["outcome"], r["http_status"]) for r in rows] == [
        ("responses", "rejected", 404),
        ("passthrough", "rejected", 404),
        ("passthrough", "rejected", 404),
        ("responses", "rejected", 404),
        ("responses", "client_error", 400),
        ("chat_completions", "rejected", 404),
    ]
    assert rows[0]["error"] == f"refused by isolation: response {first.id} belongs to key {VK_ALICE}"
    assert rows[0]["price_status"] == "not_billed" and rows[0]["cost_usd"] == 0


def test_a_hostile_key_guessing_ids_learns_nothing(store, tmp_path):
    """Another key's id, an unowned one and one that does not exist get the same reply, and none is sent."""
    with proxy(store, tmp_path / "ledger.duckdb") as url, gpt(url, ALICE) as alice:
        mine = upload(alice, "a.jsonl")
        batch = alice.batches.create(input_file_id=mine, endpoint="/v1/chat/completions", completion_window="24h")
        legacy = store.add_file("legacy.jsonl", b"{}\n", "batch")["id"]
        headers = {"authorization": f"Bearer {BOB}"}
        sent = len(store.requests)
        replies = {}
        for object_id in (mine, legacy, "file-9999", mine.upper(), mine + "x"):
            for target in (f"/v1/files/{object_id}", f"/v1/FILES/{object_id}/content", f"/v1/files?after={object_id}"):
                reply = httpx.get(url + target, headers=headers)
                replies[target] = (reply.status_code, reply.content.replace(object_id.encode(), b"ID"))
        for target in (f"/v1/batches/{batch.id}/cancel", f"/v1/batches?after={batch.id}"):
            reply = (
                httpx.post(url + target, headers=headers)
                if "cancel" in target
                else httpx.get(url + target, headers=headers)
            )
            replies[target] = (reply.status_code, reply.content.replace(batch.id.encode(), b"ID"))
        assert store.requests[sent:] == []
        assert {status for status, _ in replies.values()} == {404}
        assert {body for target, (_, body) in replies.items() if "atch" not in target} == {
            b'{"error":{"message":"No such File object: ID","type":"invalid_request_error","param":null,"code":null}}'
        }
        # an encoded letter in an id is refused by the edge before isolation (one spelling per id)
        encoded = mine[:-1] + f"%{ord(mine[-1]):02X}"
        assert httpx.get(f"{url}/v1/files/{encoded}", headers=headers).status_code == 400


def test_a_list_page_is_filled_from_later_upstream_pages(store, tmp_path):
    store.max_page = 4  # the provider's largest page: alice's files sit behind pages of bob's
    with proxy(store, tmp_path / "ledger.duckdb") as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        mine = [upload(alice, f"a{i}.jsonl") for i in range(3)]
        theirs = [upload(bob, f"b{i}.jsonl") for i in range(10)]
        sent = len(store.requests)
        page = alice.files.list(limit=2)
        assert [f.id for f in page.data] == [mine[2], mine[1]] and page.has_more is True
        assert [(m, p.split("?")[1]) for m, p in store.requests[sent:]] == [
            ("GET", "limit=10000"),  # the largest page tokenward asks for (files); the store serves 4
            ("GET", f"limit=10000&after={theirs[6]}"),
            ("GET", f"limit=10000&after={theirs[2]}"),
        ]
        assert [f.id for f in alice.files.list(limit=2)] == mine[::-1]  # the SDK pages on: every one of alice's
        assert [f.id for f in bob.files.list(limit=3)] == theirs[::-1]
        raw = httpx.get(f"{url}/v1/files?limit=2", headers={"authorization": f"Bearer {ALICE}"}).json()
        assert (raw["object"], raw["first_id"], raw["last_id"], raw["has_more"]) == ("list", mine[2], mine[1], True)
        assert set(raw) == {"object", "data", "first_id", "last_id", "has_more"}


def test_an_upstream_refusing_large_pages_gets_the_callers_limit(store, tmp_path):
    store.max_page, store.refuses_large_pages = 5, True
    with proxy(store, tmp_path / "ledger.duckdb") as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        mine = [upload(alice, f"a{i}.jsonl") for i in range(2)]
        theirs = [upload(bob, f"b{i}.jsonl") for i in range(6)]
        sent = len(store.requests)
        assert [f.id for f in alice.files.list(limit=3)] == mine[::-1]
        assert [p.split("?")[1] for _, p in store.requests[sent : sent + 3]] == [
            "limit=10000",  # refused with 400
            "limit=3",
            f"limit=3&after={theirs[3]}",
        ]
        with pytest.raises(openai.BadRequestError):
            alice.files.list(limit=50)  # over the upstream's own limit: its 400, as without tokenward


def test_owners_survive_a_restart(store, tmp_path):
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice:
        mine = upload(alice, "a.jsonl")
        stored = alice.chat.completions.create(**CHAT, store=True).id
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        assert alice.files.retrieve(mine).id == mine
        assert alice.chat.completions.retrieve(stored).id == stored
        assert [f.id for f in alice.files.list()] == [mine] and list(bob.files.list()) == []
        with pytest.raises(openai.NotFoundError):
            bob.files.retrieve(mine)


def test_an_owner_is_recorded_before_the_id_reaches_the_client(store, tmp_path, unused_port):
    """A SIGKILL right after the client got its new ids: they are still its own after a restart."""
    config = tmp_path / "tokenward.yaml"
    config.write_text(
        "upstreams:\n"
        f"  - {{name: openai, base_url: '{store.url}', default: true, api_key_env: OBJECTS_SECRET}}\n"
        f"server: {{port: {unused_port}}}\n"
        f"ledger: {{path: '{tmp_path / 'ledger.duckdb'}'}}\n"
        "auth: {mode: virtual_keys, allow_unmetered: ['*']}\n"
        f"virtual_keys: [{{name: alice, key: {ALICE}}}, {{name: bob, key: {BOB}}}]\n"
    )
    process = ProxyProcess(config, unused_port).start()
    with gpt(process.url, ALICE) as alice:
        mine = upload(alice, "a.jsonl")
        response = alice.responses.create(model="gpt-4o-mini", input="hi").id
    process.kill()
    process.start()
    try:
        with gpt(process.url, ALICE) as alice, gpt(process.url, BOB) as bob:
            assert alice.files.retrieve(mine).id == mine
            assert alice.responses.retrieve(response).id == response
            with pytest.raises(openai.NotFoundError):
                bob.responses.retrieve(response)
    finally:
        process.stop()


class BrokenStore:
    """The state store with its owner writes failing (a full disk): reads still work."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def record_objects(self, *args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_no_id_is_handed_out_before_its_owner_is_recorded(store, tmp_path):
    ledger = tmp_path / "ledger.duckdb"
    app = create_app(config_for(store, ledger))
    owners = app.state.forwarder.isolation.owners
    owners.state = BrokenStore(owners.state)
    with running_in_thread(app) as url, gpt(url, ALICE) as alice, gpt(url, OPS) as ops:
        with pytest.raises(openai.InternalServerError) as upload_failed:
            upload(alice, "a.jsonl")
        with pytest.raises(openai.InternalServerError) as chat_failed:
            alice.chat.completions.create(**CHAT, store=True)
        with pytest.raises(openai.InternalServerError):
            with alice.chat.completions.create(**CHAT, store=True, stream=True) as stream:
                list(stream)
        assert [f.filename for f in ops.files.list()] == ["a.jsonl"]  # made, but unowned: admins only
        assert list(alice.files.list()) == []
    assert upload_failed.value.code == chat_failed.value.code == "owner_not_recorded"
    rows = read_rows(ledger, "WHERE principal = 'alice' AND http_status = 500")
    assert [(r["endpoint"], r["outcome"], r["price_status"]) for r in rows] == [
        ("passthrough", "proxy_error", "not_metered"),
        ("chat_completions", "proxy_error", "usage_unknown"),  # the provider billed it; its reply never came out
        ("chat_completions", "proxy_error", "usage_unknown"),
    ]


def test_anthropic_message_batches_and_files(store, tmp_path):
    def claude(url: str, key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)

    def request(file_id: str) -> dict[str, Any]:
        source = {"type": "file", "file_id": file_id}
        content = [{"type": "document", "source": source}, {"type": "text", "text": "summarise"}]
        params = {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [{"role": "user", "content": content}]}
        return {"custom_id": "one", "params": params}

    with proxy(store, tmp_path / "ledger.duckdb") as url, claude(url, ALICE) as alice, claude(url, BOB) as bob:
        mine = alice.beta.files.upload(file=("notes.txt", b"alice's notes", "text/plain")).id
        assert mine.startswith("file_") and [f.id for f in alice.beta.files.list()] == [mine]
        assert list(bob.beta.files.list()) == []
        with pytest.raises(anthropic.NotFoundError):
            bob.beta.files.retrieve_metadata(mine)
        sent = len(store.requests)
        with pytest.raises(anthropic.NotFoundError):
            bob.messages.batches.create(requests=[request(mine)])  # type: ignore[list-item]
        assert store.requests[sent:] == []
        batch = alice.messages.batches.create(requests=[request(mine)])  # type: ignore[list-item]
        assert [b.id for b in alice.messages.batches.list()] == [batch.id]
        assert list(bob.messages.batches.list()) == []
        with pytest.raises(anthropic.NotFoundError):
            bob.messages.batches.retrieve(batch.id)
        assert alice.messages.batches.retrieve(batch.id).id == batch.id


def form_post(url: str, key: str, path: str, fields: list[tuple[str, str]]) -> httpx.Response:
    """A multipart form of text fields, as the SDKs send ``video[id]`` and ``input_reference[file_id]``."""
    files = [(name, (None, value.encode())) for name, value in fields]
    return httpx.post(f"{url}/v1/{path}", files=files, headers={"authorization": f"Bearer {key}"})


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_video_edits_extensions_and_characters_are_endpoints_held_to_their_key(store, tmp_path):
    """``videos/edits``, ``videos/extensions`` and ``videos/characters`` are endpoints, not video ids (the openai
    SDK's own suite through tokenward found all three refused with 404): they create objects the caller owns, and
    the video or file their multipart form names must be the caller's, however the form spells it."""
    ledger = tmp_path / "ledger.duckdb"
    clip = ("clip.mp4", b"\x00\x00\x00\x18ftypmp42")
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        frame = upload(alice, "frame.png")
        made = form_post(url, ALICE, "videos", [("prompt", "a cat"), ("input_reference[file_id]", frame)])
        video = made.json()["id"]
        edit = form_post(url, ALICE, "videos/edits", [("prompt", "bluer"), ("video[id]", video)]).json()["id"]
        longer = form_post(url, ALICE, "videos/extensions", [("prompt", "longer"), ("seconds", "4"), ("video[id]", edit)])
        uploaded = alice.videos.edit(prompt="from a clip", video=clip)
        character = alice.videos.create_character(name="Tom", video=clip)
        assert (made.status_code, longer.status_code) == (200, 200)
        assert alice.videos.retrieve(longer.json()["id"]).remixed_from_video_id == edit
        assert alice.videos.retrieve(edit).remixed_from_video_id == video
        assert alice.videos.get_character(character.id).name == "Tom"  # type: ignore[arg-type]
        assert [v.id for v in alice.videos.list()] == [uploaded.id, longer.json()["id"], edit, video]
        own = bob.videos.create(prompt="a dog").id
        sent = len(store.requests)
        with pytest.raises(openai.NotFoundError) as info:
            bob.videos.retrieve(edit)
        assert info.value.body == not_found("Video", edit)
        with pytest.raises(openai.NotFoundError) as info:
            bob.videos.get_character(character.id)  # type: ignore[arg-type]
        assert info.value.body == not_found("Character", character.id)
        refusals = [  # the form a client sends, and what a form parser may also read as video.id
            ("videos", [("prompt", "mine"), ("input_reference[file_id]", frame)], "File", frame),
            ("videos/edits", [("prompt", "mine"), ("video[id]", video)], "Video", video),
            ("videos/extensions", [("prompt", "mine"), ("seconds", "4"), ("video[id]", edit)], "Video", edit),
            ("videos/edits", [("prompt", "mine"), ("video.id", video)], "Video", video),
            ("videos/edits", [("prompt", "mine"), ("video", json.dumps({"id": video}))], "Video", video),
            ("videos/edits", [("prompt", "mine"), ("video[id]", own), ("video[id]", video)], "Video", video),
        ]
        for path, fields, kind, object_id in refusals:
            reply = form_post(url, BOB, path, fields)
            assert (reply.status_code, reply.json()["error"]) == (404, not_found(kind, object_id))
        twice = form_post(url, BOB, "videos/edits", [("prompt", "mine"), ("video", f'{{"id": "{own}", "id": "{video}"}}')])
        assert (twice.status_code, twice.json()["error"]["code"]) == (400, "invalid_multipart")
        for name in ("video[id]", "input_reference[file_id]"):  # an id sent as a file part is not read: refused
            files = [("prompt", (None, b"mine")), (name, ("id.txt", video.encode(), "text/plain"))]
            hidden = httpx.post(f"{url}/v1/videos/edits", files=files, headers={"authorization": f"Bearer {BOB}"})
            assert (hidden.status_code, hidden.json()["error"]["code"]) == (400, "invalid_multipart")
            assert name in hidden.json()["error"]["message"]
        assert store.requests[sent:] == []
        mine = form_post(url, BOB, "videos/edits", [("prompt", "mine"), ("video[id]", own)]).json()["id"]
        assert [v.id for v in bob.videos.list()] == [mine, own]
    rows = read_rows(ledger)
    assert [r["path"] for r in rows if r["http_status"] == 404] == [
        f"/v1/videos/{edit}",
        f"/v1/videos/characters/{character.id}",
        "/v1/videos",
        "/v1/videos/edits",
        "/v1/videos/extensions",
        "/v1/videos/edits",
        "/v1/videos/edits",
        "/v1/videos/edits",
    ]


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_a_body_is_read_as_the_upstream_would_read_it(store, tmp_path):
    """The check reads a body by its one ``content-type``: two of them (the upstream might pick the other), or a JSON
    body sent to a form endpoint as a urlencoded form (``{"prompt": "x&video[id]=..."}`` is both), are refused."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice:
        video, frame = alice.videos.create(prompt="a cat").id, upload(alice, "frame.png")
        sent = len(store.requests)
        bob = {"authorization": f"Bearer {BOB}"}

        def post(path: str, body: bytes, *types: str) -> httpx.Response:
            headers = [*bob.items(), *(("content-type", t) for t in types)]
            return httpx.post(f"{url}/v1/{path}", content=body, headers=headers)

        form = b'--b\r\ncontent-disposition: form-data; name="prompt"\r\n\r\nmine\r\n--b--\r\n'
        smuggled = json.dumps({"prompt": f"x&video[id]={video}&z=1"}).encode()
        refusals = [
            post("videos/edits", form, "multipart/form-data; boundary=b", "multipart/form-data; boundary=c"),
            post("batches", b'{"endpoint": "/v1/chat/completions"}', "application/json", "text/plain"),
            post("videos/edits", smuggled, "application/x-www-form-urlencoded"),
            post("videos", smuggled, "text/plain"),
            post("videos/edits", smuggled),
        ]
        for reply in refusals:
            assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_content_type")
        assert "more than one Content-Type" in refusals[0].json()["error"]["message"]
        assert "'application/x-www-form-urlencoded'" in refusals[2].json()["error"]["message"]
        as_json = post("videos/edits", json.dumps({"prompt": "x", "video": {"id": video}}).encode(), "application/json")
        assert (as_json.status_code, as_json.json()["error"]) == (404, not_found("Video", video))
        ref = json.dumps({"prompt": "x", "input_reference": {"file_id": frame}}).encode()
        as_json = post("videos", ref, "application/json; charset=utf-8")
        assert (as_json.status_code, as_json.json()["error"]) == (404, not_found("File", frame))
        assert store.requests[sent:] == []
    rows = read_rows(ledger)
    assert [(r["path"], r["http_status"]) for r in rows if r["http_status"] >= 400] == [
        ("/v1/videos/edits", 400),
        ("/v1/batches", 400),
        ("/v1/videos/edits", 400),
        ("/v1/videos", 400),
        ("/v1/videos/edits", 400),
        ("/v1/videos/edits", 404),
        ("/v1/videos", 404),
    ]


def test_a_container_file_copies_only_the_callers_file(store, tmp_path):
    """``POST containers/{id}/files`` copies the file its ``file_id`` names into the container (JSON, or a form field
    a server may read as well): naming another key's file there would hand its bytes to the caller's container."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        secret = upload(alice, "secret.jsonl")
        theirs, own = alice.containers.create(name="a").id, bob.containers.create(name="b").id
        copy = alice.containers.files.create(theirs, file_id=secret)
        raw = alice.containers.files.create(theirs, file=("notes.csv", b"a,b\n1,2\n"))
        assert alice.containers.files.content.retrieve(copy.id, container_id=theirs).read() == b'{"custom_id": "secret.jsonl"}\n'
        assert alice.containers.files.content.retrieve(raw.id, container_id=theirs).read() == b"a,b\n1,2\n"
        sent = len(store.requests)
        with pytest.raises(openai.NotFoundError) as info:
            bob.containers.files.create(own, file_id=secret)
        assert info.value.body == not_found("File", secret)
        for fields in ([("file_id", secret)], [("file_id", upload(bob, "mine.jsonl")), ("file_id", secret)]):
            reply = form_post(url, BOB, f"containers/{own}/files", fields)
            assert (reply.status_code, reply.json()["error"]) == (404, not_found("File", secret))
        with pytest.raises(openai.NotFoundError) as info:
            bob.containers.files.create(theirs, file=("x.csv", b"x"))
        assert info.value.body == not_found("Container", theirs)
        assert store.requests[sent:] == [("POST", "/v1/files")]  # only bob's own upload went through
        mine = bob.containers.files.create(own, file=("b.csv", b"b\n"))
        assert bob.containers.files.content.retrieve(mine.id, container_id=own).read() == b"b\n"
    rows = read_rows(ledger)
    assert [r["path"] for r in rows if r["http_status"] == 404] == [f"/v1/containers/{own}/files"] * 3 + [
        f"/v1/containers/{theirs}/files"
    ]


def test_passthrough_mode_leaves_isolation_to_the_provider(store, tmp_path):
    """Clients bring their own provider keys: the provider isolates accounts, tokenward forwards as before."""
    ledger = tmp_path / "ledger.duckdb"
    shared = store.add_file("shared.jsonl", b"{}\n", "batch")["id"]
    with proxy(store, ledger, mode="passthrough") as url, gpt(url, "sk-client-one") as one:
        assert one.files.retrieve(shared).id == shared  # this test account serves every key
        assert [f.id for f in one.files.list()] == [shared]
    assert store.requests[-2:] == [("GET", f"/v1/files/{shared}"), ("GET", "/v1/files")]
    assert [r["http_status"] for r in read_rows(ledger)] == [200, 200]


@pytest.fixture
def unused_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_image_edit_reaches_only_the_callers_files(store, tmp_path):
    """A JSON image edit names its images and mask by ``file_id``: another key's file is refused like in a path."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        mine, theirs = upload(alice, "a.png"), upload(bob, "b.png")

        def edit(body: dict[str, Any] | None = None, **multipart: Any) -> httpx.Response:
            auth = {"authorization": f"Bearer {ALICE}"}
            return httpx.post(f"{url}/v1/images/edits", json=body, headers=auth, timeout=10, **multipart)

        sent = len(store.requests)
        for body in (
            {"model": "gpt-image-1", "prompt": "x", "images": [{"file_id": mine}, {"file_id": theirs}]},
            {"model": "gpt-image-1", "prompt": "x", "images": [{"file_id": mine}], "mask": {"file_id": theirs}},
        ):
            reply = edit(body)
            assert (reply.status_code, reply.json()["error"]) == (404, not_found("File", theirs))
        assert store.requests[sent:] == []  # neither reached the account
        edit({"model": "gpt-image-1", "prompt": "x", "images": [{"file_id": mine}], "mask": {"file_id": mine}})
        # a multipart edit names no object: its bytes are not read as JSON, whatever they hold
        form = {"model": "gpt-image-1", "prompt": "x"}
        edit(data=form, files={"image": ("i.png", b'\x89PNG "file_id": "' + theirs.encode() + b'"', "image/png")})
        assert store.requests[sent:] == [("POST", "/v1/images/edits")] * 2


def item(item_id: str) -> dict[str, str]:
    return {"type": "item_reference", "id": item_id}


def test_response_items_are_referenced_only_by_their_key(store, tmp_path):
    """An ``input`` item naming a stored item of an earlier response (output or input, streamed or not) is the caller's."""
    ledger = tmp_path / "ledger.duckdb"
    model = "gpt-4o-mini"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob, gpt(url, OPS) as ops:
        plain = alice.responses.create(model=model, input="the launch code is 1234")
        said = plain.output[0].id
        with alice.responses.create(model=model, input="hi", stream=True) as stream:  # its events in one read
            streamed = [e.item.id for e in stream if e.type == "response.output_item.added"]
        store.stream_pause = 0.05  # each event its own read: the items come after the first event
        early = []
        with alice.responses.create(model=model, input="slow", stream=True) as stream:
            for event in stream:
                if event.type == "response.completed":  # its items were recorded before this event reached alice
                    slow = event.response.output[0].id
                    early.append(alice.responses.create(model=model, input=[item(slow)]).output_text)
        assert early == ["after None; quoting 'after None'"]
        (asked,) = [i.id for i in alice.responses.input_items.list(plain.id)]  # her input item, listed
        theirs = [said, streamed[0], slow, asked]
        quoting = alice.responses.create(model=model, input=[*map(item, theirs[:3]), {"id": asked}])
        assert (
            quoting.output_text == "after None" + "; quoting 'after None'" * 3 + "; quoting 'the launch code is 1234'"
        )
        own = bob.responses.create(model=model, input="mine").output[0].id
        assert bob.responses.create(model=model, input=[item(own)]).output_text == "after None; quoting 'after None'"
        sent = len(store.requests)
        for item_id in theirs:
            for call in (
                lambda item_id=item_id: bob.responses.create(model=model, input=[item(item_id)]),
                lambda item_id=item_id: bob.responses.create(model=model, input=[{"id": item_id, "type": None}]),
                lambda item_id=item_id: bob.responses.create(model=model, input=[item(item_id)], stream=True),
                lambda item_id=item_id: bob.responses.compact(
                    model=model, input=[{"role": "user", "content": "x"}, item(item_id)]
                ),
                lambda item_id=item_id: bob.responses.input_tokens.count(model=model, input=[item(item_id)]),
            ):
                with pytest.raises(openai.NotFoundError) as info:
                    call()
                assert info.value.body == not_found("Item", item_id)
        escaped = b'{"model": "gpt-4o-mini", "input": [{"type": "item\\u005freference", "\\u0069d": "%s"}]}'
        headers = {"authorization": f"Bearer {BOB}", "content-type": "application/json"}
        reply = httpx.post(f"{url}/v1/responses", content=escaped % said.encode(), headers=headers)
        assert (reply.status_code, reply.json()["error"]) == (404, not_found("Item", said))
        assert store.requests[sent:] == []  # not one reached the account
        # an admin key reaches every key's items
        assert ops.responses.create(model=model, input=[item(said)]).output_text == "after None; quoting 'after None'"
    rows = read_rows(ledger, "WHERE principal = 'bob' AND http_status = 404")
    assert len(rows) == 4 * 5 + 1
    assert {r["endpoint"] for r in rows} == {"responses", "responses_compact", "passthrough"}
    assert rows[0]["error"] == f"refused by isolation: response_item {said} belongs to key {VK_ALICE}"
    with proxy(store, tmp_path / "passthrough.duckdb", mode="passthrough") as url, gpt(url, "sk-client") as one:
        assert one.responses.create(model=model, input=[item(said)]).output_text == "after None; quoting 'after None'"


def test_a_reasoning_item_passed_back_without_its_encrypted_content_is_the_callers(store, tmp_path):
    """A reasoning item that brings only its id and summary is read from the provider's store: the caller's only.

    Before, bob could pass alice's item id as ``{"type": "reasoning", "id": ...}`` and the model went on
    from her stored item (the stand-in upstream quotes it, as the provider's model reads it).
    """
    model = "gpt-4o-mini"
    with proxy(store, tmp_path / "ledger.duckdb") as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        hers = alice.responses.create(model=model, input="the launch code is 1234").output[0].id
        by_id = {"type": "reasoning", "id": hers, "summary": []}
        assert alice.responses.create(model=model, input=[by_id]).output_text == "after None; quoting 'after None'"
        sent = len(store.requests)
        for call in (
            lambda: bob.responses.create(model=model, input=[by_id]),
            lambda: bob.responses.create(model=model, input=[{**by_id, "encrypted_content": None}], stream=True),
            lambda: bob.responses.input_tokens.count(model=model, input=[by_id]),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                call()
            assert info.value.body == not_found("Item", hers)
        assert store.requests[sent:] == []  # not one reached the account
        # one that brings its encrypted content, under her id, is paired with her stored item all the same
        carried = {**by_id, "encrypted_content": "gAAAAB-opaque"}
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model=model, input=[carried])
        assert store.requests[sent:] == []
        # under an id tokenward never recorded (a store: false response's) it is read from what it brings: it goes on
        unstored = {**carried, "id": "rs_unstored"}
        assert bob.responses.create(model=model, input=[unstored]).output_text == "after None"


def test_an_item_passed_back_with_its_content_is_paired_only_with_the_callers_stored_item(store, tmp_path):
    """An output item passed back whole (content and ``id``) is paired by the provider with the item it stored under
    that id (a message with its reasoning item). Before, bob sent alice's message id with content of his own and
    the model went on from her stored item (the stand-in quotes it: 'the vault code is 9876'); only id-only
    items and item references were checked. A ``store: false`` response's items, which tokenward never records,
    still pass whole."""
    model = "gpt-4o-mini"
    with proxy(store, tmp_path / "ledger.duckdb") as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        said = alice.responses.create(model=model, input="the launch code is 1234").output[0].id
        (asked,) = [i.id for i in alice.responses.input_items.list(
            alice.responses.create(model=model, input="the vault code is 9876").id
        )]  # fmt: skip

        def whole(item_id: str, kind: str = "message") -> dict[str, Any]:
            if kind == "function_call":
                return {"type": kind, "id": item_id, "call_id": "call_1", "name": "f", "arguments": "{}"}
            text = {"type": "output_text", "text": "nothing to see", "annotations": []}
            return {"type": kind, "id": item_id, "role": "assistant", "status": "completed", "content": [text]}

        sent = len(store.requests)
        for item_id in (said, asked):
            for call in (
                lambda item_id=item_id: bob.responses.create(model=model, input=[whole(item_id)]),
                lambda item_id=item_id: bob.responses.create(model=model, input=[whole(item_id)], stream=True),
                lambda item_id=item_id: bob.responses.create(model=model, input=[whole(item_id, "function_call")]),
                lambda item_id=item_id: bob.responses.compact(model=model, input=[whole(item_id)]),
                lambda item_id=item_id: bob.responses.input_tokens.count(model=model, input=[whole(item_id)]),
            ):
                with pytest.raises(openai.NotFoundError) as info:
                    call()
                assert info.value.body == not_found("Item", item_id)
        assert store.requests[sent:] == []  # not one reached the account
        # his own item passed back whole is his: paired with what he stored (the stand-in's reply, 'after None')
        own = bob.responses.create(model=model, input="mine").output[0].id
        assert bob.responses.create(model=model, input=[whole(own)]).output_text == "after None; quoting 'after None'"
        # a store: false response's item is recorded nowhere: passed back whole, it goes on as given
        unstored = alice.responses.create(model=model, input="x", store=False).output[0].id
        assert alice.responses.create(model=model, input=[whole(unstored)], store=False).output_text == "after None"
    rows = read_rows(tmp_path / "ledger.duckdb", "WHERE principal = 'bob' AND http_status = 404")
    assert len(rows) == 2 * 5
    assert rows[0]["error"] == f"refused by isolation: response_item {said} belongs to key {VK_ALICE}"


def test_chatkit_threads_and_sessions_reach_admin_keys_only(store, tmp_path):
    """ChatKit's front end makes threads with a session's client secret, straight at the provider: tokenward never
    sees one made, so no key owns one, and a session's secret reaches every thread of its ``user``. Before: bob
    listed, read and deleted alice's user's threads through tokenward (the account's list, whole), and made a
    session for her user whose secret read them at the provider."""
    ledger = tmp_path / "ledger.duckdb"
    theirs = store.add_thread("alice-user", "my salary is 90k")["id"]
    workflow = {"id": "wf_support"}
    with proxy(store, ledger) as url, gpt(url, BOB) as bob, gpt(url, OPS) as ops:
        assert [t.id for t in bob.beta.chatkit.threads.list()] == []
        for call in (
            lambda: bob.beta.chatkit.threads.retrieve(theirs),
            lambda: bob.beta.chatkit.threads.list_items(theirs),
            lambda: bob.beta.chatkit.threads.delete(theirs),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                call()
            assert info.value.body == not_found("ChatKitThread", theirs)
        with pytest.raises(openai.PermissionDeniedError) as denied:
            bob.beta.chatkit.sessions.create(user="alice-user", workflow=workflow)
        assert denied.value.body["code"] == "isolation_refused"  # type: ignore[index]
        assert store.requests == [("GET", "/v1/chatkit/threads?limit=100")]  # only the list, filtered to nothing
        session = ops.beta.chatkit.sessions.create(user="alice-user", workflow=workflow)
        with pytest.raises(openai.NotFoundError) as info:
            bob.beta.chatkit.sessions.cancel(session.id)
        assert info.value.body == not_found("ChatSession", session.id)
        assert [t.id for t in ops.beta.chatkit.threads.list()] == [theirs]
        assert [i.id for i in ops.beta.chatkit.threads.list_items(theirs)] == [store.objects[theirs]["items"][0]["id"]]
        assert ops.beta.chatkit.sessions.cancel(session.id).status == "cancelled"
    assert theirs in store.objects  # bob's delete never reached the account
    rows = read_rows(ledger)
    assert [(r["principal"], r["method"], r["http_status"], r["outcome"]) for r in rows] == [
        ("bob", "GET", 200, "ok"),
        ("bob", "GET", 404, "rejected"),
        ("bob", "GET", 404, "rejected"),
        ("bob", "DELETE", 404, "rejected"),
        ("bob", "POST", 403, "rejected"),
        ("ops", "POST", 200, "ok"),
        ("bob", "POST", 404, "rejected"),
        ("ops", "GET", 200, "ok"),
        ("ops", "GET", 200, "ok"),
        ("ops", "POST", 200, "ok"),
    ]


def batch_file(client: openai.OpenAI, *bodies: dict[str, Any], url: str = "/v1/responses") -> str:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": b}) for i, b in enumerate(bodies)]
    return client.files.create(file=("batch.jsonl", "\n".join(lines).encode()), purpose="batch").id


def test_the_requests_a_batch_runs_name_only_the_callers_objects(store, tmp_path):
    """A batch's input file holds requests the provider runs with the account's objects: bob's own file, naming
    alice's stored response as ``previous_response_id`` (or her file in a message), ran her conversation on and
    handed him its output (before: the batch was created; its output file, his, continued her secret)."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        theirs = alice.responses.create(model="gpt-4o-mini", input="my password is hunter2").id
        secret = upload(alice, "secret.jsonl")
        own = bob.responses.create(model="gpt-4o-mini", input="hi").id
        chained = batch_file(bob, {"model": "gpt-4o-mini", "input": "ok"},
                             {"model": "gpt-4o-mini", "previous_response_id": theirs, "input": "say it again"})  # fmt: skip
        with_file = batch_file(
            bob,
            {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": secret}}]}]},
            url="/v1/chat/completions",
        )  # fmt: skip
        twice = batch_file(bob, {"model": "gpt-4o-mini", "previous_response_id": own, "input": "x"})
        store.contents[twice] = store.contents[twice].replace(b'"input"', f'"previous_response_id": "{theirs}", "input"'.encode())
        sent = len(store.requests)
        for file_id, endpoint, kind, named in (
            (chained, "/v1/responses", "Response", theirs),
            (with_file, "/v1/chat/completions", "File", secret),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                bob.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
            assert info.value.body == not_found(kind, named)
        with pytest.raises(openai.BadRequestError) as bad:
            bob.batches.create(input_file_id=twice, endpoint="/v1/responses", completion_window="24h")
        assert bad.value.body["code"] == "invalid_json"  # type: ignore[index]
        assert store.requests[sent:] == [("GET", f"/v1/files/{f}/content") for f in (chained, with_file, twice)]
        mine = batch_file(bob, {"model": "gpt-4o-mini", "previous_response_id": own, "input": "and?"})
        batch = bob.batches.create(input_file_id=mine, endpoint="/v1/responses", completion_window="24h")
        assert batch.input_file_id == mine and store.requests[-1] == ("POST", "/v1/batches")
    rows = read_rows(ledger)
    assert [(r["path"], r["http_status"]) for r in rows if r["path"] == "/v1/batches"] == [
        ("/v1/batches", 404), ("/v1/batches", 404), ("/v1/batches", 400), ("/v1/batches", 200)
    ]  # fmt: skip


def test_fine_tuned_models_and_checkpoints_are_shared_only_by_the_key_whose_job_made_them(store, tmp_path):
    """Before: ``fine_tuning/checkpoints/{name}/permissions`` named no isolated kind, so bob listed, granted (to
    any project of the account) and revoked the permissions of alice's fine-tuned model and its checkpoints, and
    (where ``DELETE models/*`` is allowed) deleted her model. A job's model (its retrieve, its list) and its
    checkpoints (their list) are now its owner's."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob, gpt(url, OPS) as ops:
        job = alice.fine_tuning.jobs.create(model="gpt-4o-mini-2024-07-18", training_file=upload(alice, "t.jsonl"))
        model = alice.fine_tuning.jobs.retrieve(job.id).fine_tuned_model
        assert model == f"ft:gpt-4o-mini-2024-07-18:org::{job.id[-4:]}"
        checkpoints = [c.fine_tuned_model_checkpoint for c in alice.fine_tuning.jobs.checkpoints.list(job.id)]
        assert checkpoints == [f"{model}:ckpt-step-10", f"{model}:ckpt-step-20"]
        granted = alice.fine_tuning.checkpoints.permissions.create(checkpoints[0], project_ids=["proj_alice"])
        (permission,) = granted.data
        sent = len(store.requests)
        for name in (model, checkpoints[0], checkpoints[1], f"{model}:ckpt-step-30"):
            for call in (
                lambda n: bob.fine_tuning.checkpoints.permissions.create(n, project_ids=["proj_bob"]),
                lambda n: bob.fine_tuning.checkpoints.permissions.list(n),
                lambda n: bob.fine_tuning.checkpoints.permissions.delete(permission.id, fine_tuned_model_checkpoint=n),
            ):
                with pytest.raises(openai.NotFoundError) as info:
                    call(name)
                assert info.value.body == not_found("Checkpoint", name)
        assert store.requests[sent:] == []
        assert store.permissions == {checkpoints[0]: [permission.model_dump(exclude_none=True)]}
        assert [p.project_id for p in ops.fine_tuning.checkpoints.permissions.list(checkpoints[0])] == ["proj_alice"]
        assert [p.project_id for p in alice.fine_tuning.checkpoints.permissions.create(model, project_ids=["p2"])] == [
            "p2"
        ]
        sent = len(store.requests)
        with pytest.raises(openai.NotFoundError) as info:  # deleting it (DELETE models/{name}) is alice's too
            bob.models.delete(model)
        assert info.value.body == not_found("Checkpoint", model) and store.requests[sent:] == []
        assert alice.models.delete(model).deleted is True
    rows = read_rows(ledger)
    note = f"refused by isolation: fine_tuned_checkpoint {model} belongs to key {VK_ALICE}"
    assert refused(rows)[:3] == [
        ("bob", "POST", f"/v1/fine_tuning/checkpoints/{model}/permissions", "rejected", note),
        ("bob", "GET", f"/v1/fine_tuning/checkpoints/{model}/permissions", "rejected", note),
        ("bob", "DELETE", f"/v1/fine_tuning/checkpoints/{model}/permissions/{permission.id}", "rejected", note),
    ]
    assert len(refused(rows)) == 13
    unknown = f"refused by isolation: fine_tuned_checkpoint {model}:ckpt-step-30 has no recorded owner"
    assert refused(rows)[-2][-1] == unknown
    assert refused(rows)[-1] == ("bob", "DELETE", f"/v1/models/{model}", "rejected", note)


def test_a_field_mask_cannot_cut_the_ids_isolation_reads_from_a_reply(store, tmp_path):
    """Before: ``X-Goog-FieldMask: object,name`` (or ``?fields=``, as Google's front ends read them) on a create left
    the new vector store's ``id`` out of the reply: nobody was recorded as its owner, so the key that made it got
    404 for it ever after (and a list whose items lost their ``id`` came back empty). A request whose reply
    isolation reads now gets 400 before it is sent; one whose reply it does not read passes as before."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice:
        mine = upload(alice, "a.jsonl")
        sent = len(store.requests)
        for call in (
            lambda: alice.vector_stores.create(name="notes", extra_headers={"X-Goog-FieldMask": "object,name"}),
            lambda: alice.vector_stores.create(name="notes", extra_query={"fields": "object,name"}),
            lambda: alice.files.list(extra_headers={"x-goog-fieldmask": "object"}),
            lambda: alice.batches.retrieve("batch_1", extra_query={"$fields": "id,status"}),
        ):
            with pytest.raises(openai.BadRequestError) as info:
                call()
            assert info.value.code == "parameter_refused"
        assert store.requests[sent:] == [] and store.objects == {mine: store.objects[mine]}
        kept = alice.files.delete(mine, extra_headers={"X-Goog-FieldMask": "id,deleted"})
        assert (kept.id, kept.deleted) == (mine, True)
    rows = read_rows(ledger)
    assert [(r["method"], r["path"], r["http_status"], r["outcome"]) for r in rows[1:]] == [
        ("POST", "/v1/vector_stores", 400, "client_error"),
        ("POST", "/v1/vector_stores", 400, "client_error"),
        ("GET", "/v1/files", 400, "client_error"),
        ("GET", "/v1/batches/batch_1", 400, "client_error"),
        ("DELETE", f"/v1/files/{mine}", 200, "ok"),
    ]


def test_a_list_cursor_is_checked_whichever_dialect_or_case_names_it(store, tmp_path):
    """Before: the cursors checked were those of the dialect the request's headers spoke, in their case: a request
    without Anthropic's headers routed to the Anthropic upstream (``x-tokenward-upstream``) sent ``after_id``
    unchecked, and the upstream's answer told bob which file ids existed (a page for alice's file, 400 for an id
    nobody has), the oracle isolation promises not to be; ``AFTER`` passed as well."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url:
        claude = anthropic.Anthropic(base_url=url, api_key=ALICE, max_retries=0)
        theirs = claude.beta.files.upload(file=("notes.txt", b"alice's notes", "text/plain")).id
        with gpt(url, ALICE) as alice:
            mine = upload(alice, "a.jsonl")
        headers = {"authorization": f"Bearer {BOB}"}
        sent = len(store.requests)
        for query, upstream, named in (
            (f"after_id={theirs}", "anthropic", theirs),
            ("after_id=file_9999", "anthropic", "file_9999"),
            (f"AFTER={mine}", "openai", mine),
            (f"before_id={mine}", "openai", mine),
        ):
            reply = httpx.get(f"{url}/v1/files?{query}", headers={**headers, "x-tokenward-upstream": upstream})
            assert (reply.status_code, reply.json()["error"]) == (404, not_found("File", named))
        assert store.requests[sent:] == []
        routed = {"authorization": f"Bearer {ALICE}", "x-tokenward-upstream": "anthropic"}
        listed = httpx.get(f"{url}/v1/files", headers=routed)
        assert [f["id"] for f in listed.json()["data"]] == [theirs]
    assert [r["http_status"] for r in read_rows(ledger)][-5:] == [404, 404, 404, 404, 200]


@pytest.mark.parametrize(
    ("stream", "store_it", "background"),
    [(False, True, False), (False, False, False), (True, True, False), (True, False, False), (False, True, True)],
    ids=["stored", "not-stored", "stream-stored", "stream-not-stored", "background"],
)
def test_a_container_code_ran_in_for_a_response_is_the_callers(store, tmp_path, stream, store_it, background):
    """Before: a container the provider started for a response's code interpreter (``"container": {"type":
    "auto"}``) was recorded for nobody, so bob, naming its id in his own code interpreter tool, ran his code in
    alice's container, among the files her code wrote; and alice got 404 for her own container. Its id, read
    from the response (a stream's last event, a background response's retrieve), is now alice's: bob's request is
    the unknown-id 404."""
    ledger = tmp_path / "ledger.duckdb"
    auto = [{"type": "code_interpreter", "container": {"type": "auto"}}]
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        create = alice.responses.create(
            model="gpt-4o-mini", input="run it", tools=auto, store=store_it, stream=stream, background=background
        )
        if background:  # queued: the output, and the container, come with its retrieve
            assert create.output == []  # type: ignore[union-attr]
            create = alice.responses.retrieve(create.id)  # type: ignore[union-attr]
        output = (list(create)[-1].response if stream else create).output  # type: ignore[union-attr]
        container = output[0].container_id  # type: ignore[union-attr]
        assert container.startswith("cntr_") and len(output) == 2
        sent = len(store.requests)
        with pytest.raises(openai.NotFoundError) as info:
            tools = [{"type": "code_interpreter", "container": container}]
            bob.responses.create(model="gpt-4o-mini", input="ls /mnt/data", tools=tools)  # type: ignore[list-item]
        assert info.value.body == not_found("Container", container)
        with pytest.raises(openai.NotFoundError):
            bob.containers.retrieve(container)
        assert store.requests[sent:] == []
        again = alice.responses.create(model="gpt-4o-mini", input="again", tools=[{"type": "code_interpreter",
                                                                                   "container": container}])  # fmt: skip
        assert again.output[0].container_id == container  # type: ignore[union-attr]
        assert alice.containers.retrieve(container).id == container
    note = f"refused by isolation: container {container} belongs to key {VK_ALICE}"
    assert [(r["principal"], r["error"]) for r in read_rows(ledger) if r["http_status"] == 404] == [
        ("bob", note),
        ("bob", note),
    ]


def test_an_audio_answer_is_named_again_only_by_the_key_it_answered(store, tmp_path):
    """Before: a chat completion's audio answer (``message.audio.id``), which the provider keeps so that a later
    turn can name it, was recorded for nobody: bob, naming alice's in an assistant message, had the model read
    her answer again. It is now alice's; bob's request is the unknown-id 404, nothing sent."""
    ledger = tmp_path / "ledger.duckdb"
    audio = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        answer = alice.chat.completions.create(**CHAT, **audio).choices[0].message.audio  # type: ignore[call-overload]
        assert answer is not None and answer.id.startswith("audio_")
        turn = [
            *CHAT["messages"],
            {"role": "assistant", "audio": {"id": answer.id}},
            {"role": "user", "content": "again?"},
        ]
        sent = len(store.requests)
        with pytest.raises(openai.NotFoundError) as info:
            bob.chat.completions.create(model="gpt-4o-mini", messages=turn, **audio)  # type: ignore[call-overload]
        assert info.value.body == not_found("Audio", answer.id) and store.requests[sent:] == []
        again = alice.chat.completions.create(model="gpt-4o-mini", messages=turn, **audio)  # type: ignore[call-overload]
        assert again.choices[0].message.audio is not None
    rows = read_rows(ledger)
    note = f"refused by isolation: chat_audio {answer.id} belongs to key {VK_ALICE}"
    assert [(r["principal"], r["http_status"], r["error"]) for r in rows] == [
        ("alice", 200, None),
        ("bob", 404, note),
        ("alice", 200, None),
    ]
