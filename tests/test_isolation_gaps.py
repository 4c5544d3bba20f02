"""Isolation holes closed after the first round (tests/test_isolation.py's setting: two keys, an admin, one account).

Fine-tuned models run only by their job's key, upload parts joined only into their own key's uploads, audio
answers of streamed chat completions and Anthropic code execution containers recorded as the caller's, no
unchecked body on a GET or DELETE to an object, and the model list showing only the caller's fine-tuned models.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest

from tests.conftest import read_rows
from tests.object_store import ObjectStore
from tests.test_isolation import (
    ALICE,
    BOB,
    CHAT,
    OPS,
    SECRET,
    VK_ALICE,
    batch_file,
    config_for,
    gpt,
    not_found,
    proxy,
    upload,
)
from tokenward.proxy.app import create_app
from tokenward.proxy.server import running_in_thread


@pytest.fixture
def store() -> Iterator[ObjectStore]:
    with ObjectStore().running() as running:
        yield running


@pytest.fixture(autouse=True)
def account_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OBJECTS_SECRET", SECRET)


def model_not_found(model: str) -> dict[str, Any]:
    """OpenAI's 404 for a model that does not exist (or that the caller may not use)."""
    message = f"The model `{model}` does not exist or you do not have access to it."
    return {"message": message, "type": "invalid_request_error", "param": None, "code": "model_not_found"}


def fine_tune(alice: openai.OpenAI) -> str:
    """Alice's fine-tuned model (the store's job succeeds on its first retrieve)."""
    job = alice.fine_tuning.jobs.create(model="gpt-4o-mini-2024-07-18", training_file=upload(alice, "t.jsonl"))
    model = alice.fine_tuning.jobs.retrieve(job.id).fine_tuned_model
    assert model == f"ft:gpt-4o-mini-2024-07-18:org::{job.id[-4:]}"
    return model


def test_a_fine_tuned_model_runs_only_for_the_key_whose_job_made_it(store, tmp_path):
    """Before: any key could name alice's ``ft:`` model and run it (chat, streamed chat, responses, completions,
    embeddings, a fallback in ``models``, a batch line, a new fine-tuning job on top of it), billed to the
    account and reading what she trained into it. Now every one of those is OpenAI's 404 ``model_not_found``
    for bob, with a row each and nothing sent, while alice and the admin run it."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob, gpt(url, OPS) as ops:
        model = fine_tune(alice)
        checkpoint = f"{model}:ckpt-step-10"
        alice.fine_tuning.jobs.checkpoints.list(alice.fine_tuning.jobs.list().data[0].id)  # records its checkpoints
        said = [{"role": "user", "content": "hi"}]
        assert alice.chat.completions.create(model=model, messages=said).choices[0].message.content == "not stored"
        assert alice.completions.create(model=checkpoint, prompt="hi").choices[0].text == "done"
        assert ops.embeddings.create(model=model, input="hi").data[0].embedding == [0.5, 0.25]
        own = batch_file(bob, {"model": "gpt-4o-mini", "input": "hi"})
        theirs = batch_file(bob, {"model": "gpt-4o-mini", "input": "hi"}, {"model": checkpoint, "input": "hi"})
        sent = len(store.requests)
        attempts = [
            (model, lambda: bob.chat.completions.create(model=model, messages=said)),
            (model, lambda: bob.chat.completions.create(model=model, messages=said, stream=True)),
            (model, lambda: bob.responses.create(model=model, input="hi")),
            (checkpoint, lambda: bob.completions.create(model=checkpoint, prompt="hi")),
            (model, lambda: bob.embeddings.create(model=model, input="hi")),
            (model, lambda: bob.chat.completions.create(model="gpt-4o-mini", messages=said, extra_body={"models": [model]})),
            (model.upper(), lambda: bob.chat.completions.create(model=model.upper(), messages=said)),
            (checkpoint, lambda: bob.batches.create(input_file_id=theirs, endpoint="/v1/responses", completion_window="24h")),
            (model, lambda: bob.fine_tuning.jobs.create(model=model, training_file=own)),
            (f"{model}:ckpt-step-30", lambda: alice.chat.completions.create(model=f"{model}:ckpt-step-30", messages=said)),
        ]  # fmt: skip
        for name, attempt in attempts:
            with pytest.raises(openai.NotFoundError) as info:
                attempt()
            assert info.value.body == model_not_found(name)
        # the batch's input file was read to check it; nothing else reached the account
        assert store.requests[sent:] == [("GET", f"/v1/files/{theirs}/content")]
        assert bob.chat.completions.create(**CHAT).choices[0].message.content == "not stored"
    rows = read_rows(ledger)
    refused = [
        (r["principal"], r["path"], r["http_status"], r["outcome"], r["error"]) for r in rows if r["http_status"] == 404
    ]
    mine = f"refused by isolation: fine_tuned_checkpoint {model} belongs to key {VK_ALICE}"
    step = f"refused by isolation: fine_tuned_checkpoint {checkpoint} belongs to key {VK_ALICE}"
    upper = f"refused by isolation: fine_tuned_checkpoint {model.upper()} has no recorded owner"
    unknown = f"refused by isolation: fine_tuned_checkpoint {model}:ckpt-step-30 has no recorded owner"
    assert refused == [
        ("bob", "/v1/chat/completions", 404, "rejected", mine),
        ("bob", "/v1/chat/completions", 404, "rejected", mine),
        ("bob", "/v1/responses", 404, "rejected", mine),
        ("bob", "/v1/completions", 404, "rejected", step),
        ("bob", "/v1/embeddings", 404, "rejected", mine),
        ("bob", "/v1/chat/completions", 404, "rejected", mine),
        ("bob", "/v1/chat/completions", 404, "rejected", upper),
        ("bob", "/v1/batches", 404, "rejected", step),
        ("bob", "/v1/fine_tuning/jobs", 404, "rejected", mine),
        ("alice", "/v1/chat/completions", 404, "rejected", unknown),
    ]
    assert {r["endpoint"] for r in rows if r["http_status"] == 404 and r["path"] != "/v1/batches"} >= {
        "chat_completions", "responses", "completions", "embeddings"
    }  # fmt: skip


def test_the_model_list_shows_a_fine_tuned_model_only_to_its_key(store, tmp_path):
    """Before: ``GET models`` listed every fine-tuned model of the account, and ``GET models/{name}`` read any of
    them, to every key: bob learnt alice's model names (and so what to ask for). Now a non-admin key's list
    leaves out the fine-tuned models that are not its own (base models stay, in order), and reading one of
    them is OpenAI's unknown-id 404, nothing sent; the admin still sees all."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob, gpt(url, OPS) as ops:
        model = fine_tune(alice)
        assert [m.id for m in alice.models.list()] == ["gpt-4o-mini", model]
        assert [m.id for m in bob.models.list()] == ["gpt-4o-mini"]
        assert [m.id for m in ops.models.list()] == ["gpt-4o-mini", model]
        assert alice.models.retrieve(model).id == model
        assert bob.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
        sent = len(store.requests)
        with pytest.raises(openai.NotFoundError) as info:
            bob.models.retrieve(model)
        assert info.value.body == not_found("Checkpoint", model) and store.requests[sent:] == []
    rows = read_rows(ledger)
    assert [(r["principal"], r["path"], r["http_status"]) for r in rows[-6:]] == [
        ("alice", "/v1/models", 200),
        ("bob", "/v1/models", 200),
        ("ops", "/v1/models", 200),
        ("alice", f"/v1/models/{model}", 200),
        ("bob", "/v1/models/gpt-4o-mini", 200),
        ("bob", f"/v1/models/{model}", 404),
    ]


def test_an_upload_is_completed_only_with_its_own_keys_parts(store, tmp_path):
    """Before: ``part_ids`` named no isolated kind, so bob completed his own upload with alice's part and read her
    bytes back as his file. A part is now its upload's owner's: bob's complete is the unknown-id 404, nothing sent;
    his own parts still join, and alice's upload itself (its parts, its complete, its cancel) stays hers."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        hers = alice.uploads.create(bytes=6, filename="secret.txt", mime_type="text/plain", purpose="assistants")
        part = alice.uploads.parts.create(hers.id, data=b"secret")
        his = bob.uploads.create(bytes=6, filename="mine.txt", mime_type="text/plain", purpose="assistants")
        own = bob.uploads.parts.create(his.id, data=b"bobbin")
        sent = len(store.requests)
        with pytest.raises(openai.NotFoundError) as info:
            bob.uploads.complete(his.id, part_ids=[own.id, part.id])
        assert info.value.body == not_found("UploadPart", part.id)
        for call in (
            lambda: bob.uploads.parts.create(hers.id, data=b"more"),
            lambda: bob.uploads.complete(hers.id, part_ids=[own.id]),
            lambda: bob.uploads.cancel(hers.id),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                call()
            assert info.value.body == not_found("Upload", hers.id)
        assert store.requests[sent:] == []
        done = bob.uploads.complete(his.id, part_ids=[own.id])
        assert done.file is not None and bob.files.content(done.file.id).read() == b"bobbin"
        finished = alice.uploads.complete(hers.id, part_ids=[part.id])
        assert finished.file is not None and alice.files.content(finished.file.id).read() == b"secret"
    rows = read_rows(ledger)
    assert [(r["principal"], r["path"], r["http_status"]) for r in rows if r["http_status"] == 404] == [
        ("bob", f"/v1/uploads/{his.id}/complete", 404),
        ("bob", f"/v1/uploads/{hers.id}/parts", 404),
        ("bob", f"/v1/uploads/{hers.id}/complete", 404),
        ("bob", f"/v1/uploads/{hers.id}/cancel", 404),
    ]
    assert rows[4]["error"] == f"refused by isolation: upload_part {part.id} belongs to key {VK_ALICE}"
    assert len(rows) == 12


def test_a_streamed_audio_answer_is_the_callers_too(store, tmp_path):
    """Before: only a whole reply's ``message.audio.id`` was recorded; the id a stream names in its first
    ``delta.audio`` went to alice unrecorded, and an audio id nobody owns passes (the provider keeps answers
    tokenward never saw), so bob named hers in his next turn and the model read it again. It is now
    recorded before the chunk naming it is relayed: bob gets the unknown-id 404, nothing sent."""
    ledger = tmp_path / "ledger.duckdb"
    audio = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"}}
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        stream = alice.chat.completions.create(**CHAT, **audio, stream=True)  # type: ignore[call-overload]
        ids = [c.choices[0].delta.audio.id for c in stream if c.choices and getattr(c.choices[0].delta, "audio", None)]
        (answer,) = ids
        turn = [
            *CHAT["messages"],
            {"role": "assistant", "audio": {"id": answer}},
            {"role": "user", "content": "again?"},
        ]
        sent = len(store.requests)
        with pytest.raises(openai.NotFoundError) as info:
            bob.chat.completions.create(model="gpt-4o-mini", messages=turn, **audio)  # type: ignore[call-overload]
        assert info.value.body == not_found("Audio", answer) and store.requests[sent:] == []
        assert alice.chat.completions.create(model="gpt-4o-mini", messages=turn, **audio).choices  # type: ignore[call-overload]
    rows = read_rows(ledger)
    note = f"refused by isolation: chat_audio {answer} belongs to key {VK_ALICE}"
    assert [(r["principal"], r["http_status"], r["error"]) for r in rows] == [
        ("alice", 200, None),
        ("bob", 404, note),
        ("alice", 200, None),
    ]
    assert (rows[0]["input_tokens"], rows[0]["output_tokens"]) == (12, 4)


@pytest.mark.parametrize("stream", [False, True])
def test_an_anthropic_code_execution_container_is_the_callers(store, tmp_path, stream):
    """Before: the container Anthropic's code execution ran in (the reply's ``container.id``, a stream's
    ``message_delta``) was recorded for nobody, and a container nobody owns passes (the provider starts them on
    its own), so bob ran his code in alice's container, with her files in it, by naming its id (or
    ``{"id": ...}``). It is now alice's: bob gets Anthropic's 404, nothing sent; alice reuses it."""
    ledger = tmp_path / "ledger.duckdb"
    tools = [{"type": "code_execution_20250825", "name": "code_execution"}]
    said = [{"role": "user", "content": "run it"}]
    ask = {"model": "claude-sonnet-4-5", "max_tokens": 50, "messages": said, "tools": tools}
    with proxy(store, ledger) as url:
        alice = anthropic.Anthropic(base_url=url, api_key=ALICE, max_retries=0)
        bob = anthropic.Anthropic(base_url=url, api_key=BOB, max_retries=0)
        if stream:
            with alice.messages.stream(**ask) as events:  # type: ignore[arg-type]
                for _ in events:
                    pass
                container = events.get_final_message().container
        else:
            container = alice.messages.create(**ask).container  # type: ignore[arg-type]
        assert container is not None and container.id.startswith("container_")
        sent = len(store.requests)
        for given in (container.id, {"id": container.id}):
            with pytest.raises(anthropic.NotFoundError) as info:
                bob.messages.create(**ask, extra_body={"container": given})  # type: ignore[arg-type]
            assert info.value.body == {
                "type": "error",
                "error": {
                    "type": "not_found_error",
                    "message": f"No such Container object: {container.id}",
                    "code": None,
                    "param": None,
                },
            }
        assert store.requests[sent:] == []
        again = alice.messages.create(**ask, extra_body={"container": container.id})  # type: ignore[arg-type]
        assert again.container is not None and again.container.id == container.id
        alice.close()
        bob.close()
    rows = read_rows(ledger)
    note = f"refused by isolation: container {container.id} belongs to key {VK_ALICE}"
    assert [(r["principal"], r["http_status"], r["error"]) for r in rows] == [
        ("alice", 200, None),
        ("bob", 404, note),
        ("bob", 404, note),
        ("alice", 200, None),
    ]


def test_a_get_or_delete_to_an_object_carries_no_body(store, tmp_path):
    """Before: the body of a GET or DELETE to an isolated path went upstream unread, so whatever objects it named
    (an upstream that reads a DELETE's JSON, a list's filter in a GET body) were never checked. Such a body is
    now 400 ``body_not_allowed``, nothing sent, a row; an empty one passes as before."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice, gpt(url, BOB) as bob:
        mine, theirs = upload(alice, "a.jsonl"), upload(bob, "b.jsonl")
        sent = len(store.requests)
        head = {"authorization": f"Bearer {BOB}", "content-type": "application/json"}
        smuggled = json.dumps({"file_id": mine}).encode()
        for method, path in (("DELETE", f"/v1/files/{theirs}"), ("GET", "/v1/files"), ("GET", f"/v1/files/{theirs}")):
            reply = httpx.request(method, f"{url}{path}", content=smuggled, headers=head)
            assert reply.status_code == 400
            assert reply.json()["error"]["code"] == "body_not_allowed"
        chunked = httpx.request("GET", f"{url}/v1/files", content=iter([smuggled]), headers=head)
        assert chunked.status_code == 400 and store.requests[sent:] == []
        empty = httpx.request(
            "DELETE", f"{url}/v1/files/{theirs}", content=b"", headers={**head, "content-length": "0"}
        )
        assert empty.status_code == 200 and empty.json()["deleted"] is True
        assert [f.id for f in alice.files.list()] == [mine]
    rows = read_rows(ledger)
    assert [(r["method"], r["http_status"], r["outcome"]) for r in rows[2:]] == [
        ("DELETE", 400, "client_error"),
        ("GET", 400, "client_error"),
        ("GET", 400, "client_error"),
        ("GET", 400, "client_error"),
        ("DELETE", 200, "ok"),
        ("GET", 200, "ok"),
    ]


def test_a_fine_tuned_model_named_in_shared_models_runs_for_every_key(store, tmp_path):
    """``auth.shared_models``: a model the operator trained for everyone. Every key runs it, lists it and reads it;
    its permissions stay its job's key's, and a fine-tuned model not named there stays its key's alone."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice:
        shared, own = fine_tune(alice), fine_tune(alice)
    config = config_for(store, ledger)
    auth = msgspec.structs.replace(config.auth, shared_models=[shared])
    said = [{"role": "user", "content": "hi"}]
    with running_in_thread(create_app(msgspec.structs.replace(config, auth=auth))) as url, gpt(url, BOB) as bob:
        assert bob.chat.completions.create(model=shared, messages=said).choices[0].message.content == "not stored"
        assert [m.id for m in bob.models.list()] == ["gpt-4o-mini", shared]
        assert bob.models.retrieve(shared).id == shared
        sent = len(store.requests)
        with pytest.raises(openai.NotFoundError) as info:
            bob.fine_tuning.checkpoints.permissions.list(shared)
        assert info.value.body == not_found("Checkpoint", shared)
        with pytest.raises(openai.NotFoundError) as info:
            bob.chat.completions.create(model=own, messages=said)
        assert info.value.body == model_not_found(own) and store.requests[sent:] == []
    rows = read_rows(ledger)
    assert [(r["principal"], r["path"], r["http_status"]) for r in rows[-5:]] == [
        ("bob", "/v1/chat/completions", 200),
        ("bob", "/v1/models", 200),
        ("bob", f"/v1/models/{shared}", 200),
        ("bob", f"/v1/fine_tuning/checkpoints/{shared}/permissions", 404),
        ("bob", "/v1/chat/completions", 404),
    ]


def test_a_grader_runs_only_the_callers_fine_tuned_model(store, tmp_path):
    """Before: ``fine_tuning/alpha/graders/run`` (and ``validate``) named no object, so its body went upstream
    unread and bob's score-model grader ran alice's fine-tuned model. Its body is now checked: 404
    ``model_not_found``, nothing sent; alice's own grader is forwarded."""
    ledger = tmp_path / "ledger.duckdb"
    with proxy(store, ledger) as url, gpt(url, ALICE) as alice:
        model = fine_tune(alice)
        grader = {"type": "score_model", "name": "g", "model": model, "input": [{"role": "user", "content": "x"}]}
        body = {"grader": grader, "model_sample": "an answer"}
        sent = len(store.requests)
        for key, path in ((BOB, "run"), (BOB, "validate"), (ALICE, "run")):
            reply = httpx.post(
                f"{url}/v1/fine_tuning/alpha/graders/{path}", json=body, headers={"authorization": f"Bearer {key}"}
            )
            if key == BOB:
                assert (reply.status_code, reply.json()["error"]) == (404, model_not_found(model))
        assert store.requests[sent:] == [("POST", "/v1/fine_tuning/alpha/graders/run")]  # alice's only
    rows = read_rows(ledger)
    assert [(r["principal"], r["http_status"]) for r in rows[-3:]] == [("bob", 404), ("bob", 404), ("alice", 404)]
    assert rows[-1]["error"] != rows[-2]["error"]  # alice's 404 is the store's unknown path, not a refusal
