"""Where requests name provider objects (paths, bodies, replies), the owner cache, and the state store's owner table."""

from __future__ import annotations

import asyncio
import datetime as dt
import json

import pytest

from tokenward.proxy.edge import target
from tokenward.proxy.errors import ProxyError
from tokenward.proxy.isolation import Isolation, ObjectNotFound, OwnerCache
from tokenward.proxy.keys import Identity
from tokenward.proxy.objects import (
    CHECKPOINT,
    Capture,
    DuplicateMember,
    access,
    captured,
    form_documents,
    may_reference,
    references,
    selects_stored,
    video_sources,
)
from tokenward.reports.ledger.state import SqliteState

NOW = dt.datetime(2025, 6, 1, 12, tzinfo=dt.UTC)


def summary(method: str, tail: str) -> tuple[object, ...] | None:
    found = access(method, tail)
    if found is None:
        return None
    capture = found.capture
    kind = found.kind.name if found.kind else None
    caught = (capture.kind.name, capture.fields, capture.parent) if capture else None
    return kind, found.ids, found.lists, caught, found.reads_body


@pytest.mark.parametrize(
    ("method", "tail", "expected"),
    [
        ("POST", "files", ("file", (), False, ("file", ("id",), False), False)),  # multipart: streamed unread
        ("GET", "files", ("file", (), True, None, False)),
        ("GET", "Files/file-1/content", ("file", ("file-1",), False, None, False)),
        ("DELETE", "files/file-1", ("file", ("file-1",), False, None, False)),
        ("HEAD", "files", None),
        ("OPTIONS", "batches", None),
        ("POST", "batches", ("batch", (), False, ("batch", ("id",), False), True)),
        (
            "GET",
            "batches/batch_1",
            ("batch", ("batch_1",), False, ("file", ("output_file_id", "error_file_id"), True), False),
        ),
        (
            "POST",
            "batches/batch_1/cancel",
            ("batch", ("batch_1",), False, ("file", ("output_file_id", "error_file_id"), True), True),
        ),
        ("POST", "uploads/upload_1/complete", ("upload", ("upload_1",), False, ("file", ("file.id",), True), True)),
        ("POST", "uploads/upload_1/parts", ("upload", ("upload_1",), False, ("upload_part", ("id",), True), False)),
        ("GET", "vector_stores/vs_1/files/file-9", ("vector_store", ("vs_1",), False, None, False)),
        ("POST", "vector_stores/vs_1/file_batches", ("vector_store", ("vs_1",), False, None, True)),
        ("GET", "chat/completions", ("chat_completion", (), True, None, False)),
        ("POST", "chat/completions", ("chat_completion", (), False, None, True)),  # metered: captured on `store`
        ("GET", "chat/completions/chatcmpl-1/messages", ("chat_completion", ("chatcmpl-1",), False, None, False)),
        ("POST", "responses/input_tokens", ("response", (), False, None, True)),
        ("GET", "responses/resp_1/input_items", ("response", ("resp_1",), False, ("response", (), True), False)),
        ("GET", "responses/resp_1", ("response", ("resp_1",), False, ("response", (), True), False)),  # its output
        ("GET", "conversations/conv_1/items", ("conversation", ("conv_1",), False, ("conversation", (), True), False)),
        ("POST", "threads/runs", ("thread", (), False, ("thread", ("thread_id",), False), True)),
        ("POST", "threads/thread_1/runs", ("thread", ("thread_1",), False, None, True)),
        ("GET", "fine_tuning/jobs", ("fine_tuning_job", (), True, None, False)),
        (
            "GET",
            "fine_tuning/jobs/ftjob-1",
            ("fine_tuning_job", ("ftjob-1",), False, ("file", ("result_files",), True), False),
        ),
        ("GET", "fine_tuning/jobs/ftjob-1/events", ("fine_tuning_job", ("ftjob-1",), False, None, False)),
        ("POST", "videos/video_1/remix", ("video", ("video_1",), False, ("video", ("id",), False), True)),
        ("POST", "containers/cntr_1/files", ("container", ("cntr_1",), False, None, True)),  # may copy a file_id
        ("POST", "videos", ("video", (), False, ("video", ("id",), False), True)),  # a form: read
        ("POST", "videos/edits", ("video", (), False, ("video", ("id",), False), True)),  # endpoints, not ids
        ("POST", "videos/Extensions", ("video", (), False, ("video", ("id",), False), True)),
        ("GET", "videos/edits", ("video", (), False, None, False)),
        ("POST", "videos/characters", ("video_character", (), False, ("video_character", ("id",), False), False)),
        ("GET", "videos/characters/char_1", ("video_character", ("char_1",), False, None, False)),
        ("POST", "messages/batches", ("message_batch", (), False, ("message_batch", ("id",), False), True)),
        ("GET", "messages/batches/msgbatch_1/results", ("message_batch", ("msgbatch_1",), False, None, False)),
        ("POST", "messages/count_tokens", (None, (), False, None, True)),
        ("POST", "fine_tuning/alpha/graders/run", (None, (), False, None, True)),  # a grader's model
        ("POST", "responses/some_new_endpoint", ("response", ("some_new_endpoint",), False, None, True)),  # an id
        ("GET", "models", (None, (), False, None, False)),  # filtered: only the caller's fine-tuned models
        ("GET", "models/gpt-4o", None),
        ("GET", "models/ft:x", ("fine_tuned_checkpoint", ("ft:x",), False, None, False)),  # its job's key's
        ("GET", "models/FT:x", ("fine_tuned_checkpoint", ("FT:x",), False, None, False)),  # in any case
        ("DELETE", "models/ft%3Ax", ("fine_tuned_checkpoint", ("ft:x",), False, None, False)),  # deleting: its key's
        ("POST", "audio/speech", None),
        ("GET", "fine_tuning/checkpoints/ft:x/permissions", ("fine_tuned_checkpoint", ("ft:x",), False, None, False)),
        (
            "POST",
            "fine_tuning/checkpoints/ft%3Ax/permissions",  # the id percent-decoded, as the upstream reads it
            ("fine_tuned_checkpoint", ("ft:x",), False, None, True),
        ),
        (
            "GET",
            "fine_tuning/jobs/ftjob-1/checkpoints",
            (
                "fine_tuning_job",
                ("ftjob-1",),
                False,
                ("fine_tuned_checkpoint", ("data[].fine_tuned_model_checkpoint", "data[].id"), True),
                False,
            ),
        ),
    ],
)
def test_access_names_the_objects_of_a_request(method, tail, expected):
    assert summary(method, tail) == expected


def test_a_fine_tuning_jobs_reply_names_its_model_as_well_as_its_files():
    for method, tail in (("GET", "fine_tuning/jobs/ftjob-1"), ("POST", "fine_tuning/jobs/ftjob-1/cancel")):
        found = access(method, tail)
        assert found is not None and found.capture is not None
        assert found.capture.also == (Capture(CHECKPOINT, ("fine_tuned_model",), parent=True),)


def test_form_fields_spell_documents_whatever_the_notation():
    fields = [
        ("prompt", "a cat"),
        ("input_reference[file_id]", "file-1"),
        ("video[id]", "video_1"),
        ("video.id", "video_2"),
        ("video", '{"id": "video_3"}'),
        ("video[id]", "video_4"),
        ("file_ids[]", "file-2"),
        ("metadata[file_id]", "not-an-object"),
        ("note", "{not json"),
    ]
    documents = form_documents(fields)
    assert documents[:3] == [{"prompt": "a cat"}, {"input_reference": {"file_id": "file-1"}}, {"video": {"id": "video_1"}}]
    assert documents[-1] == {"note": "{not json"}
    assert [(r.field, r.object_id, r.kind.name) for d in documents for r in references(d)] == [
        ("file_id", "file-1", "file"),
        ("file_ids", "file-2", "file"),
    ]
    assert [r.object_id for d in documents for r in video_sources(d)] == ["video_1", "video_2", "video_3", "video_4"]
    assert video_sources({"video": "video_5"})[0].object_id == "video_5"
    with pytest.raises(DuplicateMember, match="'id' twice"):
        form_documents([("video", '{"id": "video_1", "id": "video_2"}')])
    assert video_sources({"video": {"name": "x"}}) == video_sources([]) == []


def test_an_id_is_percent_decoded_once_the_edge_let_it_pass():
    found = target(b"/v1/files/file%3Aabc", "GET")
    assert found is not None and access("GET", found.tail).ids == ("file:abc",)  # type: ignore[union-attr]


def refs(document: object) -> list[tuple[str, str, str, bool]]:
    return [(r.field, r.object_id, r.kind.name, r.lenient) for r in references(document)]


def test_a_reasoning_item_without_its_encrypted_content_names_a_stored_item():
    by_id = {"type": "reasoning", "id": "rs_1", "summary": []}
    carried = {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAAAB-opaque"}
    empty = {"type": "reasoning", "id": "rs_3", "summary": [], "encrypted_content": ""}
    assert refs({"input": [by_id, carried, empty]}) == [
        ("id", "rs_1", "response_item", False),
        ("id", "rs_3", "response_item", False),
        ("id", "rs_2", "response_item", True),  # brought whole: only another key's is refused
    ]
    # items added to a conversation are read the same way; a client's own shapes name nothing
    assert refs({"items": [by_id]}) == [("id", "rs_1", "response_item", False)]
    assert refs({"metadata": {"x": by_id}, "inputs": [carried]}) == []


def test_references_in_request_bodies():
    chat = {
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-a"}}]}],
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"properties": {"file_id": {"type": "string"}}}},
            }
        ],
        "metadata": {"file_id": "not-an-object"},
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"file_id": "x"}}},
    }
    assert refs(chat) == [("file_id", "file-a", "file", False)]
    response = {
        "previous_response_id": "resp_1",
        "conversation": {"id": "conv_1"},
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_file", "file_id": "file-b"}, {"type": "input_image", "file_id": "file-c"}],
            }
        ],
        "tools": [
            {"type": "file_search", "vector_store_ids": ["vs_1", "vs_2"]},
            {"type": "code_interpreter", "container": {"type": "auto", "file_ids": ["file-d"]}},
            {"type": "code_interpreter", "container": "cntr_1"},
        ],
    }
    assert refs(response) == [
        ("previous_response_id", "resp_1", "response", False),
        ("conversation", "conv_1", "conversation", False),
        ("file_id", "file-b", "file", False),
        ("file_id", "file-c", "file", False),
        ("vector_store_ids", "vs_1", "vector_store", False),
        ("vector_store_ids", "vs_2", "vector_store", False),
        ("file_ids", "file-d", "file", False),
        ("container", "cntr_1", "container", True),
    ]
    assert refs({"conversation": "conv_2"}) == [("conversation", "conv_2", "conversation", False)]
    assert refs({"container": {"id": "container_1", "skills": []}}) == [("container", "container_1", "container", True)]
    assert refs({"part_ids": ["part_1", "part_2"], "md5": "x"}) == [
        ("part_ids", "part_1", "upload_part", False),
        ("part_ids", "part_2", "upload_part", False),
    ]
    tuned = {"model": "ft:gpt-4o:org::a", "testing_criteria": [{"model": " FT:o3:org::b"}, {"model": "gpt-4o"}]}
    assert refs(tuned) == [
        ("model", "ft:gpt-4o:org::a", "fine_tuned_checkpoint", False),
        ("model", " FT:o3:org::b", "fine_tuned_checkpoint", False),
    ]
    assert refs({"metadata": {"model": "ft:x"}, "model": "openai/ft:y"}) == [
        ("model", "openai/ft:y", "fine_tuned_checkpoint", False)
    ]
    anthropic = {
        "messages": [
            {"role": "user", "content": [{"type": "document", "source": {"type": "file", "file_id": "file_1"}}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {"file_id": "made-up"}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "file_2"}}],
                    }
                ],
            },
        ],
        "tools": [{"name": "n", "input_schema": {"properties": {"file_id": {"type": "string"}}}}],
    }
    assert [r[1] for r in refs(anthropic)] == ["file_1", "file_2"]
    batch = {"requests": [{"custom_id": "1", "params": anthropic}]}
    assert [r[1] for r in refs(batch)] == ["file_1", "file_2"]
    assert refs({"input_file_id": "file-e", "endpoint": "/v1/chat/completions"}) == [
        ("input_file_id", "file-e", "file", False)
    ]
    assert [r[:2] for r in refs({"training_file": "file-f", "validation_file": "file-g", "model": "gpt-4o-mini"})] == [
        ("training_file", "file-f"),
        ("validation_file", "file-g"),
    ]
    assistant = {
        "tool_resources": {"code_interpreter": {"file_ids": ["file-h"]}, "file_search": {"vector_store_ids": ["vs_3"]}}
    }
    assert [r[1] for r in refs(assistant)] == ["file-h", "vs_3"]
    thread_run = {
        "assistant_id": "asst_1",
        "thread": {"messages": [{"role": "user", "content": "x", "attachments": [{"file_id": "file-i"}]}]},
    }
    assert [r[:2] for r in refs(thread_run)] == [("assistant_id", "asst_1"), ("file_id", "file-i")]
    eval_run = {"data_source": {"type": "completions", "source": {"type": "file_id", "id": "file-j"}}}
    assert refs(eval_run) == [("id", "file-j", "file", False)]
    assert refs({"file_ids": [1, None, "file-k"], "file_id": {"nested": True}}) == [
        ("file_ids", "file-k", "file", False)
    ]
    items = {
        "input": [
            {"type": "item_reference", "id": "msg_1"},
            {"role": "user", "content": [{"type": "input_text", "text": "x"}], "id": "msg_own"},  # a message given
            {"id": "fc_2"},  # an item reference's type is optional
            {"id": "rs_3", "type": None},
            {"type": "function_call_output", "call_id": "call_1", "output": "{}"},
            {"type": "function_call", "id": "fc_4", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "reasoning", "id": "rs_5", "summary": [], "encrypted_content": "gAAAA"},
            {"type": "web_search_call", "id": "", "status": "completed"},  # no id: nothing paired
        ],
        "conversation": {"id": "conv_1"},
    }
    assert refs(items) == [  # a member before what is nested beside it, then the items of `input` by their ids
        ("conversation", "conv_1", "conversation", False),
        ("id", "msg_1", "response_item", False),
        ("id", "msg_own", "response_item", True),  # brought whole: another key's is refused, an unrecorded one passes
        ("id", "fc_2", "response_item", False),
        ("id", "rs_3", "response_item", False),
        ("id", "fc_4", "response_item", True),
        ("id", "rs_5", "response_item", True),
    ]
    conversation_items = {"items": [{"type": "message", "role": "user", "content": "x", "id": "msg_6"}, {"id": "m7"}]}
    assert refs(conversation_items) == [("id", "msg_6", "response_item", True), ("id", "m7", "response_item", False)]


def test_may_reference_is_cheap_and_never_misses_a_spelling():
    plain = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "café conversation"}]}).encode()
    assert "\\u00e9" in plain.decode() and not may_reference("responses", plain)  # an escaped é is no ASCII letter
    assert not may_reference("chat_completions", b'{"previous_response_id": "r"}')  # chat reads no such field
    assert may_reference("chat_completions", b'{"x": {"file_id": "f"}}')
    assert may_reference("anthropic_messages", b'{"container": "c"}')
    assert may_reference("other", b'{"assistant_id": "a"}')
    for body in (
        b'{"previous_response_id": "resp_1"}',
        b'{"conversation": "conv_1"}',
        b'{"tools": [{"vector_store_ids": []}]}',
        b'{"messages": [{"content": [{"file": {"file_id": "f"}}]}]}',
        b'{"previous\\u005fresponse_id": "resp_1"}',
        b'{"\\u0066ile_id": "f"}',
        b'{"container": "cntr_1"}',
        b'{"input": [{"type": "item_reference", "id": "msg_1"}]}',
        b'{"input": [{"id": "msg_1"}]}',
        b'{"input": [{"type": "item\\u005freference", "\\u0069d": "msg_1"}]}',
    ):
        assert may_reference("responses", body), body
    assert may_reference("responses_compact", b'{"input": [{"id": "msg_1"}]}')
    assert not may_reference("chat_completions", b'{"input": [{"type": "item_reference", "id": "msg_1"}]}')
    for body in (b'{"previous\\u005fresponse_id": "resp_1"}', b'{"\\u0066ile_id": "f"}'):
        assert references(json.loads(body))  # what the escape spelled is found once decoded


def test_eval_runs_selecting_stored_objects_by_filter():
    assert selects_stored(
        {"data_source": {"type": "completions", "source": {"type": "stored_completions", "model": "x"}}}
    )
    assert selects_stored({"data_source": {"type": "responses", "source": {"type": "responses"}}})
    assert not selects_stored({"data_source": {"type": "responses", "source": {"type": "file_id", "id": "file-1"}}})
    assert not selects_stored(["not", "a", "dict"])


def test_captured_reads_ids_from_replies():
    assert captured(("id",), {"id": "file-1"}) == ["file-1"]
    assert captured(("file.id",), {"id": "upload_1", "file": {"id": "file-2"}}) == ["file-2"]
    assert captured(("output_file_id", "error_file_id"), {"output_file_id": "file-3", "error_file_id": None}) == [
        "file-3"
    ]
    assert captured(("result_files",), {"result_files": ["file-4", 5, ""]}) == ["file-4"]
    assert captured(("id",), {"id": 7}) == []
    output = {"output": [{"id": "msg_1"}, {"id": "fc_2"}, {"type": "x"}, "rs_3"], "data": None}
    assert captured(("output[].id",), output) == ["msg_1", "fc_2"]
    assert captured(("data[].id", "output[].content[].id"), output) == []


# -- the owner cache and the store ------------------------------------------------------------


class CountingState(SqliteState):
    """The real SQLite store, counting the lookups that reach it."""

    lookups: int = 0

    def owners(self, object_ids):  # type: ignore[override]
        self.lookups += 1
        return super().owners(object_ids)


def test_the_state_store_keeps_the_first_owner_and_lists_the_newest(tmp_path):
    state = SqliteState(tmp_path / "state.sqlite")
    state.record_objects([("file-1", "file", "vk-a", NOW), ("file-2", "file", "vk-a", NOW + dt.timedelta(seconds=1))])
    state.record_objects([("file-1", "file", "vk-b", NOW + dt.timedelta(seconds=2))], fsync=False)  # first owner wins
    many = [(f"f-{i}", "file", "vk-c", NOW) for i in range(1200)]
    state.record_objects(many, fsync=False)
    assert state.owners(["file-1", "file-2", "nope"]) == {"file-1": "vk-a", "file-2": "vk-a"}
    assert len(state.owners([f"f-{i}" for i in range(1200)])) == 1200  # more ids than one statement binds
    assert state.recent_objects(2) == [("file-2", "file", "vk-a"), ("f-1199", "file", "vk-c")]
    assert state.owned("vk-a", "file") == {"file-1", "file-2"}
    state.close()
    assert state.owners(["file-1"]) == {"file-1": "vk-a"}  # reopens after close
    state.close()


def test_the_owner_cache_loads_evicts_and_falls_back_to_the_store(tmp_path):
    state = CountingState(tmp_path / "state.sqlite")
    state.record_objects([(f"file-{i}", "file", "vk-a", NOW + dt.timedelta(seconds=i)) for i in range(5)])

    async def scenario() -> None:
        cache = OwnerCache(state, capacity=3)
        assert await cache.load() == 3  # the three newest
        assert await cache.owners(["file-4", "file-3", "file-2"]) == {f"file-{i}": "vk-a" for i in (4, 3, 2)}
        assert state.lookups == 0
        assert await cache.owners(["file-0", "file-9"]) == {"file-0": "vk-a"}  # older and unknown: one store query
        assert state.lookups == 1
        await cache.record("file", ["file-7"], "vk-b")
        await cache.record("file", ["file-0"], "vk-b")  # recorded already: the first owner stays
        lookups = state.lookups
        assert await cache.owners(["file-7"]) == {"file-7": "vk-b"} and state.lookups == lookups
        assert await cache.owners(["file-0"]) == {"file-0": "vk-a"}
        cache.close()

    asyncio.run(scenario())


def test_a_plan_refuses_what_is_not_the_callers(tmp_path):
    state = SqliteState(tmp_path / "state.sqlite")
    state.record_objects(
        [("file-a", "file", "vk-a", NOW), ("file-b", "file", "vk-b", NOW), ("cntr_b", "container", "vk-b", NOW)]
    )
    isolation = Isolation(OwnerCache(state))
    alice, admin = Identity("alice", "vk-a"), Identity("ops", "vk-ops", admin=True)

    async def scenario() -> None:
        plan = isolation.plan(target(b"/v1/files/file-b/content", "GET"), alice, False)  # type: ignore[arg-type]
        assert plan is not None
        with pytest.raises(ObjectNotFound) as info:
            await plan.check()
        assert (info.value.status, info.value.message, info.value.code) == (404, "No such File object: file-b", None)
        assert info.value.note == "refused by isolation: file file-b belongs to key vk-b"
        assert isolation.plan(target(b"/v1/files/file-b", "GET"), admin, False) is None  # nothing to check for an admin
        listing = isolation.plan(target(b"/v1/files", "GET", b"after=file-b"), alice, False)  # type: ignore[arg-type]
        with pytest.raises(ObjectNotFound):
            await listing.check()  # type: ignore[union-attr]
        anthropic_listing = isolation.plan(target(b"/v1/files", "GET", b"after_id=file-b"), alice, True)  # type: ignore[arg-type]
        with pytest.raises(ObjectNotFound):
            await anthropic_listing.check()  # type: ignore[union-attr]
        selection = json.dumps({"data_source": {"type": "completions", "source": {"type": "stored_completions"}}})
        run = isolation.plan(target(b"/v1/evals/eval_1/runs", "POST"), alice, False)  # type: ignore[arg-type]
        with pytest.raises(ProxyError) as selecting:
            await run.check_body(selection.encode())  # type: ignore[union-attr]
        assert (selecting.value.status, selecting.value.code) == (403, "isolation_refused")
        assert isolation.plan(target(b"/v1/evals/eval_1/runs", "POST"), admin, False) is None  # admins may
        batch = isolation.plan(target(b"/v1/batches", "POST"), alice, False)
        assert batch is not None
        await batch.check_body(b'{"input_file_id": "file-a"}')
        await batch.check_body(b"")
        for body, status in ((b'{"input_file_id": "file-b"}', 404), (b"not json", 400), (b'{"a": 1, "a": 2}', 400)):
            with pytest.raises(ProxyError) as refused:
                await batch.check_body(body)
            assert refused.value.status == status
        chat = target(b"/v1/responses", "POST")
        lenient = isolation.plan_metered("responses", chat, alice, b'{"tools": [{"container": "cntr_new"}]}', None)
        await lenient.check_body(b'{"tools": [{"container": "cntr_new"}]}')  # type: ignore[union-attr]  # never recorded
        with pytest.raises(ObjectNotFound):
            await lenient.check_body(b'{"tools": [{"container": "cntr_b"}]}')  # type: ignore[union-attr]
        assert isolation.plan_metered("chat_completions", chat, alice, b'{"model": "m"}', None) is None
        assert isolation.plan_metered("embeddings", chat, alice, b'{"input": "file_id"}', None) is None

    asyncio.run(scenario())
    state.close()


def test_a_refusal_asks_the_store_once_whether_or_not_the_id_was_known(tmp_path):
    state = CountingState(tmp_path / "state.sqlite")
    state.record_objects([("file-b", "file", "vk-b", NOW)])
    isolation = Isolation(OwnerCache(state))
    alice = Identity("alice", "vk-a")

    async def refusal_lookups(object_id: str) -> int:
        before = state.lookups
        plan = isolation.plan(target(f"/v1/files/{object_id}".encode(), "GET"), alice, False)  # type: ignore[arg-type]
        with pytest.raises(ObjectNotFound):
            await plan.check()  # type: ignore[union-attr]
        return state.lookups - before

    async def scenario() -> None:
        await isolation.owners.load()
        assert isolation.owners.cached("file-b") and not isolation.owners.cached("file-nope")
        assert [await refusal_lookups("file-b"), await refusal_lookups("file-nope")] == [1, 1]

    asyncio.run(scenario())


# -- replies -------------------------------------------------------------------------------------


class FakeReply:
    """An upstream reply from a list of chunks (then, optionally, a transport error)."""

    def __init__(
        self, chunks: list[bytes], headers: list[tuple[bytes, bytes]] | None = None, error: Exception | None = None
    ) -> None:
        self.status = 200
        self.headers = headers or [(b"content-type", b"application/json")]
        self._chunks, self._error = chunks, error
        self.closed = False

    async def chunks(self):  # type: ignore[no-untyped-def]
        for chunk in self._chunks:
            yield chunk
        if self._error is not None:
            raise self._error

    async def aclose(self) -> None:
        self.closed = True


async def relayed(reply) -> bytes:  # type: ignore[no-untyped-def]
    return b"".join([chunk async for chunk in reply.chunks()])


def through(plan, ex, reply) -> bytes:  # type: ignore[no-untyped-def]
    """The bytes the relay would send for ``reply`` (one event loop: the upstream's rest is read there)."""

    async def run() -> bytes:
        return await relayed(await plan.reply(ex, reply, None))

    return asyncio.run(run())


def reply_plan(tmp_path, path: bytes, method: str = "GET", *, store=None):  # type: ignore[no-untyped-def]
    state = SqliteState(tmp_path / "state.sqlite")
    isolation = Isolation(OwnerCache(state))
    alice = Identity("alice", "vk-a")
    found = target(path, method)
    if path == b"/v1/chat/completions":
        return state, isolation.plan_metered("chat_completions", found, alice, b"{}", store)  # type: ignore[arg-type]
    if path == b"/v1/responses":
        return state, isolation.plan_metered("responses", found, alice, b"{}", store)  # type: ignore[arg-type]
    return state, isolation.plan(found, alice, False)  # type: ignore[arg-type]


def test_a_list_tokenward_cannot_filter_is_refused_not_relayed(tmp_path):
    from tokenward.proxy.exchange import Exchange

    state, plan = reply_plan(tmp_path, b"/v1/files")
    ex = Exchange(endpoint="passthrough", method="GET", path="/v1/files")
    gzipped = FakeReply(
        [b"\x1f\x8b..."], headers=[(b"content-type", b"application/json"), (b"content-encoding", b"gzip")]
    )

    async def resend(query: str) -> FakeReply:
        raise AssertionError("a page that was not filtered has no next page")

    for reply in (gzipped, FakeReply([b'{"object": "list"}']), FakeReply([b"[1, 2]"]), FakeReply([b"<html>"])):
        with pytest.raises(ProxyError) as info:
            asyncio.run(plan.reply(ex, reply, resend))  # type: ignore[union-attr]
        assert (info.value.status, info.value.code) == (502, "list_not_filtered") and reply.closed
    state.close()


def test_a_create_reply_is_relayed_byte_for_byte_and_its_id_recorded_first(tmp_path, monkeypatch):
    from tokenward.proxy import isolation as module
    from tokenward.proxy.exchange import Exchange
    from tokenward.proxy.upstream import Failure, FailureKind, UpstreamError

    state, plan = reply_plan(tmp_path, b"/v1/files", "POST")
    ex = Exchange(endpoint="passthrough", method="POST", path="/v1/files")
    body = [b'{"id": "fi', b'le-1", "object": "file"}']
    out = asyncio.run(plan.reply(ex, FakeReply(body), None))  # type: ignore[union-attr]
    assert state.owners(["file-1"]) == {"file-1": "vk-a"}  # before a byte was relayed
    assert asyncio.run(relayed(out)) == b"".join(body)
    broken = UpstreamError(Failure(FailureKind.DISCONNECTED, True, "reset"))
    with pytest.raises(UpstreamError):  # the client sees the break where the upstream broke off
        through(plan, ex, FakeReply([b'{"id": "file-2"'], error=broken))
    whole = [b'{"id": "file-4", ', b'"object": "file"}']  # a reply relayed whole is read in one call
    assert asyncio.run(asyncio.run(plan.reply(ex, FakeReply(whole), None)).read()) == b"".join(whole)  # type: ignore[union-attr]
    with pytest.raises(UpstreamError):
        asyncio.run(asyncio.run(plan.reply(ex, FakeReply([b'{"id": "file-5"'], error=broken), None)).read())  # type: ignore[union-attr]
    monkeypatch.setattr(module, "CAPTURE_MAX_BYTES", 8)
    long = [b'{"id": "file-3", ', b'"object": "file", ', b'"purpose": "batch"}']
    assert through(plan, ex, FakeReply(long)) == b"".join(long)
    assert state.owners(["file-2", "file-3", "file-5"]) == {}  # a broken or too long reply: no owner, admins only
    state.close()


def test_a_stored_stream_is_held_until_its_first_event_names_the_completion(tmp_path):
    from tokenward.proxy.exchange import Exchange

    state, plan = reply_plan(tmp_path, b"/v1/chat/completions", "POST", store=True)
    ex = Exchange(endpoint="chat_completions", method="POST", path="/v1/chat/completions")
    sse = [(b"content-type", b"text/event-stream")]
    chunks = [
        b": keep-alive\n\n",
        b'data: {"id": "chatcmpl',
        b'-9", "object": "chat.completion.chunk"}\n',
        b"\ndata: [DONE]\n\n",
    ]
    assert through(plan, ex, FakeReply(chunks, headers=sse)) == b"".join(chunks)
    assert state.owners(["chatcmpl-9"]) == {"chatcmpl-9": "vk-a"}
    state.close()


def test_a_response_streams_items_are_recorded_before_its_last_event_is_relayed(tmp_path):
    """Item ids come from ``output_item.added`` and the last event, however the reads split them; one write."""
    from tokenward.proxy.exchange import Exchange

    state, plan = reply_plan(tmp_path, b"/v1/responses", "POST")
    ex = Exchange(endpoint="responses", method="POST", path="/v1/responses")
    sse = [(b"content-type", b"text/event-stream")]
    completed = (
        b'{"type": "response.completed", "response": {"id": "resp_1", "output": [{"id": "msg_2"}, {"id": "rs_3"}]}}'
    )
    chunks = [
        b'event: response.created\ndata: {"type": "response.created", "response": {"id": "resp_1"}}\n\n',
        b'event: response.output_item.added\ndata: {"type": "response.output_item.added", "item": {"id": "ms',
        b'g_2"}}\n\ndata: {"type": "response.output_text.delta", "delta": "\\"response.completed\\""}\n\n',
        b"event: response.completed\ndata: " + completed[:40],
        completed[40:] + b"\n\n",
    ]
    seen = []

    async def run() -> bytes:
        relayed = await plan.reply(ex, FakeReply(chunks, headers=sse), None)
        out = []
        async for chunk in relayed.chunks():
            seen.append(state.owners(["resp_1", "msg_2", "rs_3"]))
            out.append(chunk)
        return b"".join(out)

    assert asyncio.run(run()) == b"".join(chunks)
    mine = {"resp_1": "vk-a"}
    assert seen == [mine, mine, mine, mine, {**mine, "msg_2": "vk-a", "rs_3": "vk-a"}]
    assert [kind for _, kind, _ in state.recent_objects(10)] == ["response_item"] * 2 + ["response"]
    state.close()
