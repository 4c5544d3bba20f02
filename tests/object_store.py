"""A provider account's object store as a real HTTP upstream: files, batches, vector stores, stored chat
completions and responses, videos and video characters, containers and their files (OpenAI), files, message batches and Messages with code execution containers (Anthropic, under ``/anthropic``); uploads
and their parts, text completions and embeddings.

It behaves like the provider where isolation depends on it: one account (every key's objects in one
place), lists newest first with ``after``/``limit`` cursors (``after_id`` for Anthropic) and a page cap
(:attr:`ObjectStore.max_page`, like the provider's largest ``limit``), 404 for unknown ids, 400 for a
body naming a file that does not exist. :attr:`ObjectStore.requests` logs ``(method, path)``, :attr:`ObjectStore.headers`
the headers of each.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

USAGE = {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16}
RESPONSE_USAGE = {
    "input_tokens": 12,
    "output_tokens": 4,
    "total_tokens": 16,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens_details": {"reasoning_tokens": 0},
}


class ObjectStore:
    """The upstream; run it with :meth:`running` (``url`` is its OpenAI base, ``anthropic_url`` Anthropic's)."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}  # id -> object, in creation order
        self.contents: dict[str, bytes] = {}
        self.vector_store_files: dict[str, list[str]] = {}
        self.requests: list[tuple[str, str]] = []
        self.headers: list[dict[str, str]] = []
        self.permissions: dict[str, list[dict[str, Any]]] = {}
        self.audio: set[str] = set()  # chat completions' audio answers, kept for multi-turn  # fine-tuned model or checkpoint -> its grants  # each request's headers (names lower-cased), as requests
        self.max_page = 100
        self.refuses_large_pages = False  # answer 400 to a limit over max_page (instead of serving max_page)
        self.items: dict[str, dict[str, Any]] = {}  # stored responses' input and output items, by id
        self.input_items: dict[str, list[dict[str, Any]]] = {}  # response id -> its input items
        self.stream_pause = 0.0  # seconds between a Responses stream's events (each then its own read)
        self._serial = itertools.count(1)
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def anthropic_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/anthropic/v1"

    @contextmanager
    def running(self) -> Iterator[ObjectStore]:
        ready = threading.Event()
        thread = threading.Thread(target=lambda: asyncio.run(self._main(ready)), daemon=True, name="object-store")
        thread.start()
        assert ready.wait(10)
        try:
            yield self
        finally:
            assert self._loop is not None and self._stop is not None
            self._loop.call_soon_threadsafe(self._stop.set)
            thread.join(10)

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.set()
        await self._stop.wait()
        await runner.cleanup()

    # -- helpers ---------------------------------------------------------------------------------

    def new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._serial):04d}"

    def add(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj.setdefault("created_at", next(self._serial))
        self.objects[obj["id"]] = obj
        return obj

    def add_file(self, name: str, data: bytes, purpose: str, *, anthropic: bool = False) -> dict[str, Any]:
        if anthropic:
            obj = {"id": self.new_id("file_"), "type": "file", "filename": name, "size_bytes": len(data)}
            obj.update(mime_type="application/octet-stream", created_at="2025-01-01T00:00:00Z", dialect="anthropic")
        else:
            obj = {"id": self.new_id("file-"), "object": "file", "bytes": len(data), "filename": name}
            obj.update(purpose=purpose, status="processed")
        self.contents[obj["id"]] = data
        return self.add(obj)

    def of(self, object_id: str, kind: str) -> dict[str, Any]:
        obj = self.objects.get(object_id)
        if obj is None or obj.get("object", obj.get("type")) != kind:
            raise _error(404, f"No such {kind} object: {object_id}")
        return obj

    def page(self, request: web.Request, kind: str, *, anthropic: bool = False) -> web.Response:
        items = [o for o in reversed(self.objects.values()) if o.get("object", o.get("type")) == kind]
        if kind == "file":  # OpenAI and Anthropic files share the path, not the account
            items = [o for o in items if (o.get("dialect") == "anthropic") == anthropic]
        after = request.query.get("after_id" if anthropic else "after")
        if after:
            ids = [o["id"] for o in items]
            if after not in ids:
                raise _error(400, f"unknown cursor {after}")
            items = items[ids.index(after) + 1 :]
        limit = int(request.query.get("limit", "20"))
        if limit > self.max_page and self.refuses_large_pages:
            raise _error(400, f"limit must be at most {self.max_page}")
        limit = min(limit, self.max_page)
        page, more = items[:limit], len(items) > limit
        body: dict[str, Any] = {"data": page, "has_more": more}
        body.update(first_id=page[0]["id"] if page else None, last_id=page[-1]["id"] if page else None)
        if not anthropic:
            body = {"object": "list", **body}
        return web.json_response(body)

    def need_file(self, file_id: Any) -> None:
        if file_id not in self.objects:
            raise _error(400, f"Invalid file id: {file_id}")

    # -- the API ---------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs))
        self.headers.append({name.lower(): value for name, value in request.headers.items()})
        try:
            return _masked(request, await self._route(request))
        except web.HTTPException as exc:
            return web.Response(status=exc.status, text=exc.text, content_type="application/json")

    async def _route(self, request: web.Request) -> web.StreamResponse:
        anthropic = request.path.startswith("/anthropic/")
        parts = request.path.split("/")[3 if anthropic else 2 :]
        method = request.method
        if parts[0] == "files":
            return await self._files(request, method, parts, anthropic)
        if anthropic and parts == ["messages"]:
            return await self._anthropic_messages(request)
        if parts[0] == "uploads":
            return await self._uploads(request, method, parts[1:])
        if parts == ["completions"] or parts == ["embeddings"]:
            return await self._inference(request, parts[0])
        if anthropic and parts[:2] == ["messages", "batches"]:
            return await self._message_batches(request, method, parts[2:])
        if parts[0] == "batches":
            return await self._batches(request, method, parts)
        if parts[0] == "vector_stores":
            return await self._vector_stores(request, method, parts)
        if parts[:2] == ["chat", "completions"]:
            return await self._chat(request, method, parts[2:])
        if parts[0] == "responses":
            return await self._responses(request, method, parts[1:])
        if parts[0] == "videos":
            return await self._videos(request, method, parts[1:])
        if parts[0] == "containers":
            return await self._containers(request, method, parts[1:])
        if parts[0] == "chatkit":
            return await self._chatkit(request, method, parts[1:])
        if parts[0] == "models" and method == "GET":  # the base model and every fine-tuned one of the account
            tuned = [o["fine_tuned_model"] for o in self.objects.values() if o.get("fine_tuned_model")]
            models = [{"id": m, "object": "model", "created": 1, "owned_by": "org"} for m in ["gpt-4o-mini", *tuned]]
            if len(parts) == 1:
                return web.json_response({"object": "list", "data": models})
            return web.json_response(next(m for m in models if m["id"] == parts[1]))
        if parts[0] == "models" and method == "DELETE":  # a fine-tuned model (and its checkpoints) deleted
            job = next((o for o in self.objects.values() if o.get("fine_tuned_model") == parts[1]), None)
            if job is None:
                raise _error(404, f"The model '{parts[1]}' does not exist")
            job["fine_tuned_model"] = None
            return web.json_response({"id": parts[1], "object": "model", "deleted": True})
        if parts[:2] == ["fine_tuning", "jobs"]:
            return await self._fine_tuning_jobs(request, method, parts[2:])
        if parts[:2] == ["fine_tuning", "checkpoints"]:
            return await self._permissions(request, method, parts[2:])
        raise _error(404, f"unknown path {request.path}")

    async def _files(self, request: web.Request, method: str, parts: list[str], anthropic: bool) -> web.Response:
        if len(parts) == 1 and method == "POST":
            form = await request.post()
            upload = form["file"]
            assert isinstance(upload, web.FileField)
            return web.json_response(
                self.add_file(upload.filename, upload.file.read(), str(form.get("purpose", "")), anthropic=anthropic)
            )
        if len(parts) == 1:
            return self.page(request, "file", anthropic=anthropic)
        obj = self.of(parts[1], "file")
        if len(parts) == 3 and parts[2] == "content":
            return web.Response(body=self.contents[obj["id"]], content_type="application/octet-stream")
        if method == "DELETE":
            del self.objects[obj["id"]]
            deleted = {"id": obj["id"], "deleted": True}
            return web.json_response(
                {**deleted, "type": "file_deleted"} if anthropic else {**deleted, "object": "file"}
            )
        return web.json_response(obj)

    async def _uploads(self, request: web.Request, method: str, rest: list[str]) -> web.Response:
        """Uploads: parts (multipart ``data``) joined by ``complete`` in the order of its ``part_ids``, into a file.

        Like one account, it takes any of the account's parts, whichever upload they were added to.
        """
        if not rest:
            body = await request.json()
            upload = {"id": self.new_id("upload_"), "object": "upload", "status": "pending", "file": None}
            upload.update(bytes=body["bytes"], filename=body["filename"], purpose=body["purpose"], expires_at=9)
            return web.json_response(self.add(upload))
        upload = self.of(rest[0], "upload")
        if rest[1:] == ["parts"]:
            form = await request.post()
            data = form["data"]
            assert isinstance(data, web.FileField)
            part = {"id": self.new_id("part_"), "object": "upload.part", "upload_id": upload["id"]}
            self.contents[part["id"]] = data.file.read()
            return web.json_response(self.add(part))
        if rest[1:] == ["complete"]:
            body = await request.json()
            data = b"".join(self.contents[self.of(p, "upload.part")["id"]] for p in body["part_ids"])
            upload.update(status="completed", file=self.add_file(upload["filename"], data, upload["purpose"]))
        elif rest[1:] == ["cancel"]:
            upload["status"] = "cancelled"
        return web.json_response(upload)

    async def _inference(self, request: web.Request, endpoint: str) -> web.Response:
        """Text completions and embeddings of whatever model is named (a fine-tuned one included)."""
        body = await request.json()
        if endpoint == "embeddings":
            data = [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}]
            usage = {"prompt_tokens": 12, "total_tokens": 12}
            return web.json_response({"object": "list", "data": data, "model": body["model"], "usage": usage})
        choice = {"text": "done", "index": 0, "logprobs": None, "finish_reason": "stop"}
        completion = {"id": self.new_id("cmpl-"), "object": "text_completion", "created": 1, "model": body["model"]}
        return web.json_response({**completion, "choices": [choice], "usage": USAGE})

    async def _anthropic_messages(self, request: web.Request) -> web.StreamResponse:
        """Messages; code execution runs in the container named (an id, or ``{"id": ...}``) or in a new one.

        The reply names it as ``container``; a stream, in its ``message_delta`` event's ``delta``.
        """
        body = await request.json()
        given = body.get("container")
        given = given.get("id") if isinstance(given, dict) else given
        runs = any(str(t.get("type", "")).startswith("code_execution") for t in body.get("tools", []))
        container = None
        if isinstance(given, str):
            container = self.of(given, "anthropic.container")
        elif runs:
            container = self.add({"id": self.new_id("container_"), "type": "anthropic.container"})
        shown = {"id": container["id"], "expires_at": "2025-01-01T01:00:00Z"} if container else None
        usage = {"input_tokens": 12, "output_tokens": 4}
        message = {"id": self.new_id("msg_"), "type": "message", "role": "assistant", "model": body["model"]}
        message.update(content=[{"type": "text", "text": "ran"}], stop_reason="end_turn", stop_sequence=None)
        if not body.get("stream"):
            return web.json_response({**message, "usage": usage, "container": shown})
        start = {**message, "content": [], "stop_reason": None, "usage": {"input_tokens": 12, "output_tokens": 1}}
        events: list[tuple[str | None, dict[str, Any]]] = [
            ("message_start", {"type": "message_start", "message": start}),
            ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ran"}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None, "container": shown}, "usage": {"output_tokens": 4}}),
            ("message_stop", {"type": "message_stop"}),
        ]  # fmt: skip
        return await _stream(request, events)

    async def _batches(self, request: web.Request, method: str, parts: list[str]) -> web.Response:
        if len(parts) == 1 and method == "POST":
            body = await request.json()
            self.need_file(body.get("input_file_id"))
            output = self.add_file("batch_output.jsonl", b'{"id": "out"}\n', "batch_output")
            batch = {"id": self.new_id("batch_"), "object": "batch", "endpoint": body["endpoint"]}
            batch.update(input_file_id=body["input_file_id"], completion_window="24h", status="validating")
            batch["pending_output_file_id"] = output["id"]  # shown once the batch "completes" (on retrieve)
            return web.json_response(self.add(batch))
        if len(parts) == 1:
            return self.page(request, "batch")
        batch = self.of(parts[1], "batch")
        if len(parts) == 3 and parts[2] == "cancel":
            batch["status"] = "cancelling"
        elif batch["status"] == "validating":
            batch.update(status="completed", output_file_id=batch.pop("pending_output_file_id"))
        return web.json_response({k: v for k, v in batch.items() if k != "pending_output_file_id"})

    async def _vector_stores(self, request: web.Request, method: str, parts: list[str]) -> web.Response:
        counts = {"in_progress": 0, "completed": 0, "failed": 0, "cancelled": 0, "total": 0}
        if len(parts) == 1 and method == "POST":
            body = await request.json()
            for file_id in body.get("file_ids", []):
                self.need_file(file_id)
            store = {
                "id": self.new_id("vs_"),
                "object": "vector_store",
                "name": body.get("name"),
                "status": "completed",
            }
            store.update(file_counts=counts, usage_bytes=0, last_active_at=0, metadata={})
            self.vector_store_files[store["id"]] = list(body.get("file_ids", []))
            return web.json_response(self.add(store))
        if len(parts) == 1:
            return self.page(request, "vector_store")
        store = self.of(parts[1], "vector_store")
        files = self.vector_store_files[store["id"]]
        if len(parts) == 2 and method == "DELETE":
            del self.objects[store["id"]]
            return web.json_response({"id": store["id"], "object": "vector_store.deleted", "deleted": True})
        if len(parts) == 2:
            return web.json_response(store)
        if method == "POST":  # vector_stores/{id}/files
            body = await request.json()
            self.need_file(body.get("file_id"))
            files.append(body["file_id"])
        data = [
            {"id": f, "object": "vector_store.file", "vector_store_id": store["id"], "status": "completed"}
            for f in files
        ]
        if method == "POST":
            return web.json_response(data[-1])
        return web.json_response({"object": "list", "data": data, "has_more": False})

    async def _chat(self, request: web.Request, method: str, rest: list[str]) -> web.StreamResponse:
        if not rest and method == "POST":
            body = await request.json()
            completion = {
                "id": self.new_id("chatcmpl-"),
                "object": "chat.completion",
                "model": "gpt-4o-mini-2024-07-18",
            }
            message: dict[str, Any] = {"role": "assistant", "content": "stored" if body.get("store") else "not stored"}
            for given in body["messages"]:  # an earlier audio answer named: it must exist
                if isinstance(given.get("audio"), dict) and given["audio"].get("id") not in self.audio:
                    raise _error(400, f"Audio with id {given['audio'].get('id')} not found")
            if "audio" in body.get("modalities", []):
                message.update(content=None, audio={"id": self.new_id("audio_"), "data": "UklGRg==", "expires_at": 9})
                message["audio"]["transcript"] = "the answer"
                self.audio.add(message["audio"]["id"])
            completion["choices"] = [{"index": 0, "message": message, "finish_reason": "stop"}]
            completion.update(usage=USAGE, created=1)
            if body.get("store"):
                self.add({**completion, "request_messages": body["messages"]})
            if not body.get("stream"):
                return web.json_response(completion)
            return await _stream(request, _chat_events(completion))
        if not rest:
            return self.page(request, "chat.completion")
        stored = self.of(rest[0], "chat.completion")
        shown = {k: v for k, v in stored.items() if k != "request_messages"}
        if method == "DELETE":
            del self.objects[stored["id"]]
            return web.json_response({"id": stored["id"], "object": "chat.completion.deleted", "deleted": True})
        if rest[1:] == ["messages"]:
            messages = [{"id": f"{stored['id']}-{i}", **m} for i, m in enumerate(stored["request_messages"])]
            return web.json_response({"object": "list", "data": messages, "has_more": False})
        return web.json_response(shown)

    async def _responses(self, request: web.Request, method: str, rest: list[str]) -> web.StreamResponse:
        if not rest and method == "POST":
            body = await request.json()
            previous = body.get("previous_response_id")
            if previous is not None:
                self.of(previous, "response")
            inputs, quoted = self._input_items(body.get("input"))
            response = {"id": self.new_id("resp_"), "object": "response", "model": "gpt-4o-mini-2024-07-18"}
            said = f"after {previous}" + "".join(f"; quoting {text!r}" for text in quoted)
            text = {"type": "output_text", "text": said, "annotations": []}
            item = {"id": self.new_id("msg_"), "type": "message", "role": "assistant", "status": "completed"}
            response.update(status="completed", output=[{**item, "content": [text]}], usage=RESPONSE_USAGE)
            for tool in body.get("tools", []):  # code ran in a container: the one named, or a new one (auto)
                if tool.get("type") == "code_interpreter":
                    given = tool.get("container")
                    container = self.of(given, "container") if isinstance(given, str) else self.add(
                        {"id": self.new_id("cntr_"), "object": "container", "name": "auto"}
                    )
                    call = {"id": self.new_id("ci_"), "type": "code_interpreter_call", "status": "completed"}
                    response["output"].insert(0, {**call, "container_id": container["id"], "code": "print(1)"})
            response.update(created_at=1, previous_response_id=previous)
            if body.get("background"):  # its output is there once it is retrieved
                self.add(dict(response))
                response.update(status="queued", output=[])
            elif body.get("store", True):
                self.add(dict(response))
                self.input_items[response["id"]] = inputs
                self.items.update((i["id"], i) for i in [*inputs, *response["output"]])
            if not body.get("stream"):
                return web.json_response(response)
            started = {**item, "status": "in_progress", "content": []}
            events = [
                {"type": "response.created", "sequence_number": 0, "response": {**response, "status": "in_progress"}},
                {"type": "response.output_item.added", "sequence_number": 1, "output_index": 0, "item": started},
                {"type": "response.output_item.done", "sequence_number": 2, "output_index": 0, "item": item},
                {"type": "response.completed", "sequence_number": 3, "response": response},
            ]
            return await _stream(request, [(e["type"], e) for e in events], self.stream_pause)
        stored = self.of(rest[0], "response")
        if rest[1:] == ["input_items"]:
            data = self.input_items[stored["id"]]
            first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
            return web.json_response(
                {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": False}
            )
        if method == "DELETE":
            del self.objects[stored["id"]]
            return web.json_response({"id": stored["id"], "object": "response.deleted", "deleted": True})
        return web.json_response(stored)

    def _input_items(self, given: Any) -> tuple[list[dict[str, Any]], list[str]]:
        """A request's input as the items the provider stores, and the texts of the stored items it references."""
        if isinstance(given, str):
            given = [{"role": "user", "content": [{"type": "input_text", "text": given}]}]
        items: list[dict[str, Any]] = []
        quoted: list[str] = []
        for part in given or []:
            by_id = part.get("type") == "reasoning" and not part.get("encrypted_content")  # read from the store
            item_id = part.get("id")
            found = self.items.get(item_id) if isinstance(item_id, str) else None  # the account's, whoever's
            if (part.get("type") in (None, "item_reference") and "role" not in part) or by_id:
                if found is None:
                    raise _error(404, f"Item with id '{part['id']}' not found.")
                quoted.append(found["content"][0]["text"])
                continue
            if found is not None:  # passed back with its content: paired with what the account stored under its id
                quoted.append(found["content"][0]["text"])  # (as the provider pairs a message with its reasoning)
                continue
            items.append({"id": self.new_id("msg_"), "type": "message", "status": "completed", **part})
        return items, quoted

    async def _videos(self, request: web.Request, method: str, rest: list[str]) -> web.Response:
        """Videos as the API takes them: multipart forms (``input_reference[file_id]``, ``video[id]`` or a file)."""
        if rest[:1] == ["characters"]:
            if len(rest) == 1:
                form = await request.post()
                assert isinstance(form["video"], web.FileField)
                character = {"id": self.new_id("char_"), "object": "character", "name": form["name"]}
                return web.json_response(self.add(character))
            return web.json_response(self.of(rest[1], "character"))
        if method == "POST" and (not rest or rest[0] in ("edits", "extensions")):
            form = await request.post()
            source = form.get("video[id]")
            if source is not None:
                self.of(str(source), "video")
            if form.get("input_reference[file_id]") is not None:
                self.need_file(form["input_reference[file_id]"])
            video = {"id": self.new_id("video_"), "object": "video", "status": "queued", "prompt": form["prompt"]}
            video.update(model="sora-2", progress=0, seconds="4", size="720x1280", remixed_from_video_id=source)
            return web.json_response(self.add(video))
        if not rest:
            return self.page(request, "video")
        return web.json_response(self.of(rest[0], "video"))

    async def _containers(self, request: web.Request, method: str, rest: list[str]) -> web.Response:
        """Containers; a container file is an upload or a copy of a file named by ``file_id`` (JSON or a form field)."""
        if not rest and method == "POST":
            body = await request.json()
            return web.json_response(self.add({"id": self.new_id("cntr_"), "object": "container", "name": body["name"]}))
        if not rest:
            return self.page(request, "container")
        container = self.of(rest[0], "container")
        if rest[1:] == ["files"] and method == "POST":
            if request.content_type == "application/json":
                fields: Any = await request.json()
            else:
                fields = await request.post()
            upload = fields.get("file")
            if isinstance(upload, web.FileField):
                data = upload.file.read()
            else:
                self.need_file(fields.get("file_id"))
                data = self.contents[fields["file_id"]]
            entry = {"id": self.new_id("cfile_"), "object": "container.file", "container_id": container["id"]}
            entry.update(bytes=len(data), path=f"/mnt/data/{entry['id']}", source="user")
            self.contents[entry["id"]] = data
            return web.json_response(self.add(entry))
        if len(rest) == 4 and rest[1] == "files" and rest[3] == "content":
            entry = self.of(rest[2], "container.file")
            return web.Response(body=self.contents[entry["id"]], content_type="application/octet-stream")
        return web.json_response(container)

    async def _chatkit(self, request: web.Request, method: str, rest: list[str]) -> web.Response:
        """ChatKit sessions (each with a client secret scoped to its ``user``) and threads (made by ChatKit's
        front end with that secret, straight at the provider: :meth:`add_thread` plays it)."""
        if rest == ["sessions"] and method == "POST":
            body = await request.json()
            session = {"id": self.new_id("cksess_"), "object": "chatkit.session", "user": body["user"]}
            session.update(client_secret=self.new_id("ek_"), status="active", workflow=body["workflow"])
            return web.json_response(self.add(session))
        if rest[:1] == ["sessions"] and rest[2:] == ["cancel"]:
            session = self.of(rest[1], "chatkit.session")
            session["status"] = "cancelled"
            return web.json_response(session)
        if rest == ["threads"]:
            return self.page(request, "chatkit.thread")
        thread = self.of(rest[1], "chatkit.thread")
        if rest[2:] == ["items"]:
            return web.json_response({"object": "list", "data": thread["items"], "has_more": False})
        if method == "DELETE":
            del self.objects[thread["id"]]
            return web.json_response({"id": thread["id"], "object": "chatkit.thread.deleted", "deleted": True})
        return web.json_response(thread)

    def add_thread(self, user: str, text: str) -> dict[str, Any]:
        """A ChatKit thread of ``user``'s, as ChatKit's front end makes one (never through tokenward)."""
        item = {"id": self.new_id("cthi_"), "object": "chatkit.thread_item", "type": "chatkit.user_message"}
        item.update(content=[{"type": "input_text", "text": text}])
        thread = {"id": self.new_id("cthr_"), "object": "chatkit.thread", "title": None, "user": user}
        thread.update(status={"type": "active"}, items=[item])
        return self.add(thread)

    async def _fine_tuning_jobs(self, request: web.Request, method: str, rest: list[str]) -> web.Response:
        """Fine-tuning jobs: a job succeeds on its first retrieve, making its model and two checkpoints."""
        if not rest and method == "POST":
            body = await request.json()
            self.need_file(body.get("training_file"))
            job = {"id": self.new_id("ftjob-"), "object": "fine_tuning.job", "model": body["model"]}
            job.update(training_file=body["training_file"], status="running", fine_tuned_model=None, result_files=[])
            return web.json_response(self.add(job))
        if not rest:
            return self.page(request, "fine_tuning.job")
        job = self.of(rest[0], "fine_tuning.job")
        if job["status"] == "running":
            name = f"ft:{job['model']}:org::{job['id'][-4:]}"
            job.update(status="succeeded", fine_tuned_model=name, result_files=[self.add_file("r.csv", b"s\n", "")["id"]])
            for step in (10, 20):
                checkpoint = {"id": self.new_id("ftckpt_"), "object": "fine_tuning.job.checkpoint", "step_number": step}
                checkpoint.update(fine_tuned_model_checkpoint=f"{name}:ckpt-step-{step}", fine_tuning_job_id=job["id"])
                self.add(checkpoint)
        if rest[1:] == ["checkpoints"]:
            data = [o for o in self.objects.values() if o.get("fine_tuning_job_id") == job["id"]]
            return web.json_response({"object": "list", "data": data, "has_more": False})
        return web.json_response(job)

    async def _permissions(self, request: web.Request, method: str, rest: list[str]) -> web.Response:
        """A fine-tuned model's (or checkpoint's) permissions: the projects it is shared with."""
        names = {o["fine_tuned_model"] for o in self.objects.values() if o.get("fine_tuned_model")}
        names |= {o["fine_tuned_model_checkpoint"] for o in self.objects.values() if "fine_tuned_model_checkpoint" in o}
        if rest[0] not in names or rest[1:2] != ["permissions"]:
            raise _error(404, f"No such checkpoint: {rest[0]}")
        granted = self.permissions.setdefault(rest[0], [])
        if method == "POST":
            for project in (await request.json())["project_ids"]:
                granted.append({"id": self.new_id("cp_"), "object": "checkpoint.permission", "project_id": project})
        elif method == "DELETE":
            granted[:] = [p for p in granted if p["id"] != rest[2]]
            return web.json_response({"id": rest[2], "object": "checkpoint.permission", "deleted": True})
        return web.json_response({"object": "list", "data": granted, "has_more": False})

    async def _message_batches(self, request: web.Request, method: str, rest: list[str]) -> web.Response:
        if not rest and method == "POST":
            body = await request.json()
            for item in body["requests"]:
                for message in item["params"]["messages"]:
                    for block in message["content"] if isinstance(message["content"], list) else []:
                        if block.get("source", {}).get("type") == "file":
                            self.need_file(block["source"]["file_id"])
            batch = {"id": self.new_id("msgbatch_"), "type": "message_batch", "processing_status": "in_progress"}
            batch.update(created_at="2025-01-01T00:00:00Z", expires_at="2025-01-02T00:00:00Z")
            counts = {"processing": len(body["requests"]), "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
            batch.update(
                request_counts=counts, results_url=None, ended_at=None, cancel_initiated_at=None, archived_at=None
            )
            return web.json_response(self.add(batch))
        if not rest:
            return self.page(request, "message_batch", anthropic=True)
        return web.json_response(self.of(rest[0], "message_batch"))


def _masked(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """A JSON reply cut to the top-level members a Google-style field mask names (``X-Goog-FieldMask``, ``fields``)."""
    mask = request.headers.get("x-goog-fieldmask") or request.query.get("fields")
    if not mask or not isinstance(response, web.Response) or response.content_type != "application/json":
        return response
    assert isinstance(response.body, bytes)
    kept = {name.strip() for name in mask.split(",")}
    return web.json_response({k: v for k, v in json.loads(response.body).items() if k in kept})


def _error(status: int, message: str) -> web.HTTPException:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}})
    cls = web.HTTPNotFound if status == 404 else web.HTTPBadRequest
    return cls(text=body, content_type="application/json")


def _chat_events(completion: dict[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
    base = {"id": completion["id"], "object": "chat.completion.chunk", "model": completion["model"], "created": 1}
    message = completion["choices"][0]["message"]
    first: dict[str, Any] = {"role": "assistant", "content": message["content"]}
    if message.get("audio"):  # the answer's audio, its id in the first delta (as the API streams it)
        first["audio"] = message["audio"]
    return [
        (None, {**base, "choices": [{"index": 0, "delta": first}]}),
        (None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        (None, {**base, "choices": [], "usage": USAGE}),
    ]


async def _stream(
    request: web.Request, events: list[tuple[str | None, dict[str, Any]]], pause: float = 0.0
) -> web.StreamResponse:
    reply = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await reply.prepare(request)
    for number, (name, data) in enumerate(events):
        if pause and number:
            await asyncio.sleep(pause)
        head = f"event: {name}\n" if name else ""
        await reply.write(f"{head}data: {json.dumps(data)}\n\n".encode())
    if all(name is None for name, _ in events):
        await reply.write(b"data: [DONE]\n\n")
    await reply.write_eof()
    return reply
