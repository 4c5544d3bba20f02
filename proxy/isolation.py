"""Tenant isolation of provider objects in ``virtual_keys`` mode: each key reaches only its own.

Design note. Every virtual key shares the provider account, so the provider would serve key A
key B's files. tokenward therefore records the owner (the creating key's ``key_id``) of every
object created through it, and for each request (:meth:`Isolation.plan`, what
:mod:`tokenward.proxy.objects` finds in it):

* **ids in the path, the list cursors and the body** must be the caller's: any other id,
  another key's, one with no recorded owner or one that does not exist, gets the same 404
  (:class:`ObjectNotFound`), before anything is sent upstream, after one lookup in the store
  whether or not the id was in memory: neither the reply nor its timing is an existence oracle;
* **list replies** are filtered to the caller's objects (``data`` rewritten, ``first_id``,
  ``last_id`` and ``has_more`` adjusted). tokenward asks the upstream for its largest page and
  reads on, up to :data:`MAX_PAGES` pages, until it has ``limit`` of the caller's objects, so
  that a key's objects behind many of other keys' still show; a page can still hold fewer than
  ``limit``;
* **create replies** (JSON, at most :data:`CAPTURE_MAX_BYTES`; a stream's first event) are read
  before any of their bytes go to the client, and the new id's owner is recorded durably
  first: a crash cannot leave a client holding an id nobody owns. A response's items (the
  ids a later ``item_reference`` names) are recorded with it; a streamed response's, read from
  its ``response.output_item.added`` events and last event, in one write before that last
  event is relayed (a stream broken off before it has its items recorded at its end, or not
  at all: an unrecorded item is refused, never leaked).

A key with ``role: admin`` reaches every object and sees whole lists; what it creates is
recorded as its own. Objects with no recorded owner (created before isolation existed, directly
at the provider, or by the provider on its own) are reached by admin keys only.

Owners live in the state store (:class:`~tokenward.reports.ledger.state.StateStore`); the
request path reads an in-memory cache (:class:`OwnerCache`, loaded at start and written
through) and asks the store, off the event loop, only about ids the cache does not hold (an
object another proxy created, a hostile key's guesses).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import parse_qsl, urlencode

from multipart import parse_options_header

from tokenward.proxy.edge import Target
from tokenward.proxy.errors import ProxyError
from tokenward.proxy.exchange import Exchange
from tokenward.proxy.form import FormError, boundary_of, read_form
from tokenward.proxy.keys import Identity
from tokenward.proxy.objects import (
    AUDIO,
    CHECKPOINT,
    FILE,
    KINDS,
    RESPONSE_ITEM,
    Access,
    Capture,
    DuplicateMember,
    Kind,
    Reference,
    access,
    captured,
    derived_capture,
    fine_tuned,
    form_documents,
    may_reference,
    references,
    selects_stored,
    video_sources,
)
from tokenward.proxy.sse import Fragment, SSEDecoder, parse_event
from tokenward.proxy.upstream import Failure, FailureKind, UpstreamError, UpstreamReply
from tokenward.reports.ledger.state import StateStore

__all__ = [
    "CAPTURE_MAX_BYTES",
    "LIST_MAX_BYTES",
    "MAX_PAGES",
    "Isolation",
    "ModelNotFound",
    "ObjectNotFound",
    "OwnerCache",
    "Plan",
]

log = logging.getLogger("tokenward.proxy")

CAPTURE_MAX_BYTES = 8 * 1024 * 1024
"""A create reply (not metered) longer than this is relayed without reading its id: the object then has no owner."""
LIST_MAX_BYTES = 64 * 1024 * 1024
"""A list page longer than this cannot be filtered: the request gets 502 instead of another key's objects."""
MAX_PAGES = 5
"""Upstream pages read at most to fill one filtered list page."""

_KIND = {kind.name: kind for kind in KINDS}
_CHAT = _KIND["chat_completion"]
_RESPONSE = _KIND["response"]
_EVAL = _KIND["eval"]
_CONTAINER = _KIND["container"]
_AUDIO_ANSWERS = (Capture(AUDIO, ("choices[].message.audio.id",), streamed=("choices[].delta.audio.id",)),)
"""A chat completion's audio answers, the caller's (a later request naming another key's is refused); a stream
names each in the first ``delta.audio`` of its choice (platform.openai.com/docs/guides/audio, streaming)."""
_ANTHROPIC_CONTAINER = Capture(
    _KIND["container"], ("container.id",), streamed=("message.container.id", "delta.container.id")
)
"""The container Anthropic's code execution (or a skill) ran in: the reply's ``container.id``, in a stream the
``message_start`` message's or a ``message_delta``'s (docs.anthropic.com/en/docs/agents-and-tools/tool-use/
code-execution-tool, "Containers": a later request reuses one by naming its id). The caller's from then on."""
_CONTAINERS_RUN = (Capture(_CONTAINER, ("output[].container_id",)),)
"""A response's code interpreter calls name the container they ran in: one the provider started for the
request (``"container": {"type": "auto"}``) is the caller's from then on (platform.openai.com/docs/guides/
tools-code-interpreter: an auto container is reused by naming its id)."""
_CHATKIT_SESSION = _KIND["chatkit_session"]
_BATCH = _KIND["batch"]
_OUTPUT = ("output[].id",)
_CURSORS = frozenset({"after", "before", "after_id", "before_id"})
"""List cursors, which name an object (OpenAI's ``after``/``before``, Anthropic's ``after_id``/``before_id``)."""
_STREAM_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})
_ITEM_MARKERS = re.compile(rb"output_item\.added|response\.(?:completed|incomplete|failed)")
"""What an event must hold to be decoded by :class:`_ItemWatch` (one search per event)."""
_BODY_CHECKED = frozenset({"chat_completions", "responses", "responses_compact", "anthropic_messages"})
_JSON_CHECKED = frozenset({"images"})
"""Metered endpoints whose JSON bodies (not their multipart ones) may name files: an image edit's
``images[].file_id`` and ``mask.file_id`` (platform.openai.com/docs/api-reference/images/createEdit)."""


class ObjectNotFound(ProxyError):
    """404 for an object the caller may not reach, worded as the provider words an unknown id.

    The reply is the same whether the id is another key's, has no owner or does not exist;
    :attr:`note` (for the ledger row) says which.
    """

    def __init__(self, kind: Kind, object_id: str, owner: str | None) -> None:
        super().__init__(404, f"No such {kind.label} object: {object_id}", None)  # type: ignore[arg-type]
        whose = f"belongs to key {owner}" if owner else "has no recorded owner"
        self.note = f"refused by isolation: {kind.name} {object_id} {whose}"


class ModelNotFound(ObjectNotFound):
    """404 ``model_not_found`` for a fine-tuned model the caller may not run, worded as OpenAI words an unknown model.

    A fine-tuned model (and each of its checkpoints) is its job's key's (:data:`~tokenward.proxy.objects.CHECKPOINT`):
    another key naming it as a ``model`` hears what it would hear for a model that does not exist.
    """

    def __init__(self, model: str, owner: str | None) -> None:
        super().__init__(CHECKPOINT, model, owner)
        self.message = f"The model `{model}` does not exist or you do not have access to it."
        self.args = (self.message,)
        self.code = "model_not_found"


class OwnerCache:
    """Object id -> owner ``key_id``: an in-memory cache in front of the state store.

    Args:
        state: where owners are stored.
        capacity: ids held in memory (the most recent; older ones are read from the store).
        fsync: make each record survive power loss, not only a crash (``ledger.fsync``).
    """

    def __init__(self, state: StateStore, *, capacity: int = 200_000, fsync: bool = False) -> None:
        self.state = state
        self.capacity = capacity
        self.fsync = fsync
        self._cache: dict[str, str] = {}

    async def load(self) -> int:
        """Fill the cache with the most recent owners (at start, off the event loop); returns how many."""
        rows = await asyncio.to_thread(self.state.recent_objects, self.capacity)
        for object_id, _, key_id in reversed(rows):  # oldest first: the newest are evicted last
            self._put(object_id, key_id)
        return len(rows)

    def close(self) -> None:
        """Release the store's connection, if it keeps one."""
        close = getattr(self.state, "close", None)
        if close is not None:
            close()

    def _put(self, object_id: str, key_id: str) -> None:
        cache = self._cache
        if object_id in cache:
            return
        cache[object_id] = key_id
        if len(cache) > self.capacity:
            del cache[next(iter(cache))]

    def cached(self, object_id: str) -> bool:
        """Whether ``object_id``'s owner is in memory."""
        return object_id in self._cache

    async def lookup(self, object_id: str) -> str | None:
        """The owner the store holds for ``object_id`` (always asks the store, off the event loop)."""
        return (await asyncio.to_thread(self.state.owners, [object_id])).get(object_id)

    async def owners(self, object_ids: Iterable[str]) -> dict[str, str]:
        """Owners of the ids that have one: from memory, the rest in one store query off the loop."""
        found: dict[str, str] = {}
        missing: list[str] = []
        cache = self._cache
        for object_id in object_ids:
            owner = cache.get(object_id)
            if owner is None:
                missing.append(object_id)
            else:
                found[object_id] = owner
        if missing:
            stored = await asyncio.to_thread(self.state.owners, missing)
            for object_id, owner in stored.items():
                self._put(object_id, owner)
            found.update(stored)
        return found

    async def record(self, kind: str, object_ids: list[str], key_id: str, *, items: Sequence[str] = ()) -> None:
        """Store ``key_id`` as the owner of new objects (first owner wins), durably, before returning.

        ``items``: response items (:data:`~tokenward.proxy.objects.RESPONSE_ITEM`) recorded in the same write.

        Raises:
            Exception: whatever the store raises (the caller must not hand out the ids then).
        """
        now = dt.datetime.now(dt.UTC)
        rows = [(object_id, kind, key_id, now) for object_id in object_ids]
        rows.extend((item_id, RESPONSE_ITEM.name, key_id, now) for item_id in items)
        object_ids = [row[0] for row in rows]

        def write() -> dict[str, str]:
            self.state.record_objects(rows, fsync=self.fsync)
            return self.state.owners(object_ids)

        for object_id, owner in (await asyncio.to_thread(write)).items():
            self._put(object_id, owner)


Resend = Callable[[str], Awaitable[UpstreamReply]]
"""Sends the request again with another raw query string (the next page of a list)."""


class Isolation:
    """Decides, per request, what isolation has to do (:meth:`plan`, :meth:`plan_metered`).

    Args:
        owners: the owner cache.
        shared_models: fine-tuned models every key may run and list (``auth.shared_models``).
    """

    def __init__(self, owners: OwnerCache, *, shared_models: frozenset[str] = frozenset()) -> None:
        self.owners = owners
        self.shared_models = shared_models

    def plan(self, found: Target, identity: Identity, anthropic: bool) -> Plan | None:
        """The plan for an unmetered request (``None``: it names, lists and creates no object).

        ``anthropic``: the upstream speaks Anthropic's API (its lists page by ``after_id``, up to 1000 items).
        """
        if identity.key_id is None:
            return None
        what = access(found.method, found.tail)
        if what is None or (identity.admin and what.capture is None):
            return None
        return Plan(self.owners, what, found, identity, anthropic, self.shared_models)

    async def check_models(self, identity: Identity, models: Iterable[str | None]) -> None:
        """Refuse a metered request asking for a fine-tuned model (or checkpoint) that is not the caller's.

        ``models``: the ``model`` the request names and its fallbacks (``models``, ``fallbacks``).
        Only :func:`~tokenward.proxy.objects.fine_tuned` names are checked; an admin key runs any.

        Raises:
            ModelNotFound: 404 ``model_not_found``, before anything is sent upstream.
        """
        if identity.key_id is None or identity.admin:
            return
        wanted = [Reference("model", name, CHECKPOINT) for name in models if name and fine_tuned(name)]
        await _require(self.owners, identity.key_id, wanted, self.shared_models)

    def plan_metered(self, endpoint: str, found: Target, identity: Identity, body: bytes, store: Any) -> Plan | None:
        """The plan for a metered request: record a stored completion's or response's id, check body ids.

        A chat completion is stored when the request says ``store: true``; a response unless it
        says ``store: false`` (the Responses API stores by default).
        """
        if identity.key_id is None:
            return None
        capture = None
        if endpoint == "chat_completions":  # stored (store: true), or with an audio answer to record
            audio = _AUDIO_ANSWERS if b'"audio"' in body else ()
            if store is True or audio:
                capture = Capture(_CHAT, ("id",) if store is True else (), also=audio)
        elif endpoint == "responses" and store is not False:
            capture = Capture(_RESPONSE, ("id",), items=_OUTPUT, also=_CONTAINERS_RUN)
        elif endpoint == "responses":  # not stored, but the containers its code ran in are the caller's
            capture = Capture(_RESPONSE, (), also=_CONTAINERS_RUN)
        elif endpoint == "anthropic_messages" and _runs_code(body):
            capture = _ANTHROPIC_CONTAINER
        checked = endpoint in _BODY_CHECKED or (endpoint in _JSON_CHECKED and body.lstrip()[:1] == b"{")
        checks = not identity.admin and checked and may_reference(endpoint, body)
        if capture is None and not checks:
            return None
        what = Access(None, capture=capture, reads_body=checks)
        return Plan(self.owners, what, found, identity, False, self.shared_models)


async def _require(
    owners: OwnerCache, key_id: str, wanted: list[Reference], shared: frozenset[str] = frozenset()
) -> None:
    """Refuse the first of ``wanted`` that is not ``key_id``'s (:class:`ObjectNotFound`, :class:`ModelNotFound`).

    ``shared``: fine-tuned models anyone may name as a ``model`` (``auth.shared_models``).
    """
    wanted = [ref for ref in wanted if ref.field != "model" or ref.object_id not in shared]
    if not wanted:
        return
    ids = {ref.object_id for ref in wanted}
    cached = {object_id for object_id in ids if owners.cached(object_id)}
    found = await owners.owners(ids)
    for ref in wanted:
        owner = found.get(ref.object_id)
        if owner == key_id or (ref.lenient and owner is None):
            continue
        if ref.object_id in cached:  # as slow as an unknown id's refusal: one store lookup each
            await owners.lookup(ref.object_id)
        if ref.field == "model":
            raise ModelNotFound(ref.object_id, owner)
        raise ObjectNotFound(ref.kind, ref.object_id, owner)


class Plan:
    """What isolation does for one request: check it (:meth:`check`, :meth:`check_body`), then its :meth:`reply`."""

    __slots__ = ("access", "admin", "anthropic", "found", "key_id", "owners", "page_limit", "shared")

    def __init__(
        self,
        owners: OwnerCache,
        what: Access,
        found: Target,
        identity: Identity,
        anthropic: bool,
        shared: frozenset[str] = frozenset(),
    ) -> None:
        assert identity.key_id is not None
        self.owners = owners
        self.shared = shared
        self.access = what
        self.found = found
        self.key_id = identity.key_id
        self.admin = identity.admin
        self.anthropic = anthropic
        self.page_limit = self._page_limit() if what.lists else 0

    @property
    def reads_body(self) -> bool:
        """Whether the request body must be read and checked (it may name objects)."""
        return self.access.reads_body and not self.admin

    @property
    def reads_reply(self) -> bool:
        """Whether the reply is read before it is relayed (a list to filter, ids to record)."""
        return self.access.capture is not None or ((self.access.lists or self.access.models) and not self.admin)

    # -- the request ---------------------------------------------------------------------------

    async def check(self) -> None:
        """Refuse a path id or list cursor that is not the caller's.

        Raises:
            ObjectNotFound: 404, before anything is sent upstream.
            ProxyError: 403 ``isolation_refused`` for a ChatKit session a key that is not an admin creates.
        """
        if self.admin:
            return
        what = self.access
        if what.kind is _CHATKIT_SESSION and not what.ids and self.found.method == "POST":
            raise ProxyError(
                403,
                "A ChatKit session's client secret reaches every ChatKit thread of the session's user, whichever "
                "key made them, straight at the provider: tokenward lets only admin keys create one.",
                "isolation_refused",
                "permission_error",
            )
        assert what.kind is not None or not what.ids
        wanted = [Reference("path", object_id, what.kind) for object_id in what.ids if what.kind is not None]
        if self.found.method == "GET" and self.found.tail[:7].lower() == "models/" and what.ids[0] in self.shared:
            wanted = []  # GET models/{name} of a shared model (its permissions stay its key's)
        if what.lists and what.kind is not None and self.found.query:
            for name, value in parse_qsl(self.found.query, keep_blank_values=True):
                if value and name.lower() in _CURSORS:  # either dialect's, in any case: an upstream may read any
                    wanted.append(Reference(name, value, what.kind))
        await self._require(wanted)

    def _form_references(self, document: Any) -> list[Reference]:
        """What a form endpoint's document names: the usual fields, and for a video the video it starts from."""
        found = references(document)
        if self._video:
            found.extend(video_sources(document))
        return found

    @property
    def _video(self) -> bool:
        return self.access.kind is not None and self.access.kind.name == "video"

    async def check_body(self, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Refuse a body naming an object that is not the caller's (:func:`~tokenward.proxy.objects.references`).

        ``headers``: the request's raw headers, for its ``content-type``. Where the request takes
        forms (:attr:`~tokenward.proxy.objects.Access.reads_form`: video creates, edits and
        extensions, container files), a ``multipart/form-data`` body is read as a form, its text
        fields checked as the documents they spell (:func:`~tokenward.proxy.objects.form_documents`),
        and any other type but JSON refused (a JSON body sent as a urlencoded form could name an
        object the JSON check never sees); every other body is checked as JSON.

        Raises:
            ObjectNotFound: 404 for the first such id.
            ProxyError: 400 ``invalid_json`` for a body that is not JSON or names a member twice
                (the upstream might read the other one), 400 ``invalid_multipart`` for a form that
                cannot be read or that sends a file part under a name that takes an id
                (``video[id]``, ``file_id``: its content is not read), 400 ``invalid_content_type``
                for more than one ``content-type`` header (the upstream might read the body by the
                other) or a form endpoint's body neither a form nor JSON; 403 ``isolation_refused``
                for an eval run that selects stored objects by filter.
        """
        if not self.reads_body or not body.strip():
            return
        types = [value.decode("latin-1") for name, value in headers if name == b"content-type"]
        if len(types) > 1:
            raise ProxyError(400, "The request carries more than one Content-Type header.", "invalid_content_type")
        content_type = types[0] if types else None
        if self.access.reads_form and content_type and boundary_of(content_type):
            try:
                form = await asyncio.to_thread(read_form, body, content_type)
                documents = form_documents(form.pairs)
            except (FormError, DuplicateMember) as exc:
                raise ProxyError(400, str(exc), "invalid_multipart") from None
            for part in form.files:  # its content is not read: a file where an id goes could name anything
                (spelled,) = form_documents([(part.name, "?")])
                if references(spelled) or (self._video and isinstance(spelled.get("video"), dict)):
                    message = f"the form sends a file as {part.name!r}, which names an object: send the id as text"
                    raise ProxyError(400, message, "invalid_multipart")
            await self._require([r for document in documents for r in self._form_references(document)])
            return
        if self.access.reads_form and not _is_json(content_type):
            message = f"This endpoint takes multipart/form-data (with a boundary) or JSON, not {content_type!r}."
            raise ProxyError(400, message, "invalid_content_type")
        document = _decode_strict(body)
        if self.access.reads_form:
            await self._require(self._form_references(document))
            return
        if self.access.kind is _EVAL and selects_stored(document):
            raise ProxyError(
                403,
                "An eval run whose data source selects stored chat completions or responses by filter would read "
                "every key's objects: tokenward lets only admin keys start one. Use a file data source.",
                "isolation_refused",
                "permission_error",
            )
        await self._require(references(document))

    def batch_input(self, body: bytes | None) -> str | None:
        """The input file a batch create by a key that is not an admin runs (its lines must be checked), or ``None``.

        ``body``: the request body, decoded (already checked by :meth:`check_body`).
        """
        what = self.access
        if body is None or self.admin or what.kind is not _BATCH or what.ids or self.found.method != "POST":
            return None
        document = _decode_strict(body)
        file_id = document.get("input_file_id") if isinstance(document, dict) else None
        return file_id if isinstance(file_id, str) and file_id else None

    async def check_batch_lines(self, reply: UpstreamReply) -> None:
        """Refuse a batch whose input file's requests name objects that are not the caller's.

        ``reply`` is the upstream's answer to ``GET files/{input_file_id}/content``: each JSONL line's
        ``body`` is a request the provider runs with the account's objects (a ``previous_response_id``,
        a ``file_id`` in a message), so it is checked as the request itself would be. The file is
        read line by line, never held whole; a line that is not JSON is the provider's to refuse.

        Raises:
            ObjectNotFound: 404 for the first such id (before the batch is created).
            ProxyError: 400 ``invalid_json`` for a line naming a member twice or nested too deeply;
                502 ``batch_input_unchecked`` when the content cannot be read (not a 200, or
                compressed).
        """
        try:
            if reply.status != 200 or _encoded(reply):
                raise ProxyError(
                    502,
                    f"tokenward could not read the batch's input file to check the objects it names "
                    f"(upstream answered {reply.status}); try again.",
                    "batch_input_unchecked",
                    "server_error",
                )
            rest = b""
            async for chunk in reply.chunks():
                lines = (rest + chunk).split(b"\n")
                rest = lines.pop()
                await self._require([ref for line in lines for ref in _line_references(line)])
            await self._require(_line_references(rest))
        finally:
            await reply.aclose()

    async def _require(self, wanted: list[Reference]) -> None:
        await _require(self.owners, self.key_id, wanted, self.shared)

    def prepare(self, found: Target, headers: list[tuple[bytes, bytes]]) -> Target:
        """Adjust the outgoing request: an uncompressed reply when it is read, the largest page for a list.

        Returns the target to send (``found``, or ``found`` with the list's ``limit`` raised).
        """
        if not self.reads_reply:
            return found
        headers[:] = [h for h in headers if h[0] != b"accept-encoding"]
        headers.append((b"accept-encoding", b"identity"))
        if self.access.lists and not self.admin:
            return replace(found, query=_with_params(found.query, {"limit": str(self.page_limit)}))
        return found

    # -- the reply -----------------------------------------------------------------------------

    async def reply(self, ex: Exchange, reply: UpstreamReply, resend: Resend | None) -> UpstreamReply:
        """The reply to relay: filtered (a list), or read far enough to record the ids it creates.

        Raises:
            ProxyError: 502 ``list_not_filtered`` for a list reply tokenward cannot filter (too
                large, compressed, not a list); 500 ``owner_not_recorded`` when the store failed
                (the new object then stays unowned, reachable by admin keys only).
        """
        if reply.status == 400 and self.access.lists and not self.admin and self.page_limit > self._requested_limit():
            # an upstream serving smaller pages than tokenward asked for: ask again with the caller's limit
            assert resend is not None
            await reply.aclose()
            self.page_limit = self._requested_limit()
            reply = await resend(_with_params(self.found.query, {"limit": str(self.page_limit)}))
        if not 200 <= reply.status < 300:
            return reply
        try:
            return await self._reply(ex, reply, resend)
        except BaseException:
            await reply.aclose()
            raise

    async def _reply(self, ex: Exchange, reply: UpstreamReply, resend: Resend | None) -> UpstreamReply:
        if self.access.lists and not self.admin:
            assert resend is not None
            return await self._filtered(ex, reply, resend)
        if self.access.models and not self.admin:
            return await self._models(ex, reply)
        capture = self.access.capture
        if capture is None:
            return reply
        if _encoded(reply):
            log.warning("request %s: the reply is compressed, so its new object gets no owner", ex.request_id)
            return reply
        if (_header(reply, b"content-type") or "").strip().lower().startswith("text/event-stream"):
            return await self._capture_stream(ex, reply, capture)
        return await self._capture_body(ex, reply, capture)

    async def _capture_body(self, ex: Exchange, reply: UpstreamReply, capture: Capture) -> UpstreamReply:
        limit = None if self.access.kind is None else CAPTURE_MAX_BYTES  # a metered reply is read whole anyway
        chunks, rest, error = await _read(reply, limit)
        if rest is not None:
            log.warning("request %s: the reply is over %d bytes; its new object gets no owner", ex.request_id, limit)
            return _Replayed(reply, chunks, rest)
        if error is not None:
            return _Replayed(reply, chunks, None, error)
        body = b"".join(chunks)
        document = _loaded(body)
        if isinstance(document, dict):
            await self._record(ex, capture, captured(capture.fields, document), captured(capture.items, document))
            for more in capture.also:
                await self._record(ex, more, captured(more.fields, document))
        return _Replayed(reply, [body], None)

    async def _capture_stream(self, ex: Exchange, reply: UpstreamReply, capture: Capture) -> UpstreamReply:
        """Hold a stream's first chunks until its first event (which names the new object) is read.

        A Responses stream is then watched to its last event for the items it makes (:class:`_ItemWatch`).
        """
        decoder = SSEDecoder()
        stream = reply.chunks().__aiter__()
        chunks: list[bytes] = []
        size = 0
        object_id: str | None = None
        rest: AsyncIterator[bytes] | None = stream
        watched = capture.items or (capture.also and capture.kind is _RESPONSE)
        items = _ItemWatch(self, ex, capture, decoder) if watched else None
        named = [each for each in (capture, *capture.also) if each.streamed]
        names = _StreamWatch(self, ex, named, decoder) if named and items is None else None
        held: list[bytes] = []  # the events read before the first chunk is relayed
        try:
            while size <= CAPTURE_MAX_BYTES:
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    rest = None
                    break
                chunks.append(chunk)
                size += len(chunk)
                blocks = decoder.feed(chunk)
                held.extend(blocks)
                data = next((d for d in map(_event_data, blocks) if d is not None), None)
                if data is not None:
                    object_id = _stream_id(data)
                    if items is not None:
                        items.scan(blocks)  # the first chunk may hold later events, the last one even
                    break
        except UpstreamError as exc:
            return _Replayed(reply, chunks, None, exc)
        first = [object_id] if object_id and "id" in capture.fields else []
        if items is None:
            await self._record(ex, capture, first)
            if names is None:
                return _Replayed(reply, chunks, rest)
            await names.save(names.scan(held))
            return _Replayed(reply, chunks, None if rest is None else names.relay(rest))
        await self._record(ex, capture, first, items.take() if items.ended or rest is None else [])
        for more, made in items.take_also():
            await self._record(ex, more, made)
        return _Replayed(reply, chunks, None if rest is None or items.ended else items.relay(rest))

    async def _record(self, ex: Exchange, capture: Capture, object_ids: list[str], items: Sequence[str] = ()) -> None:
        if not object_ids and not items:
            return
        owner = await self._owner(capture)
        if owner is None:
            return  # an unowned object's files stay unowned
        try:
            await self.owners.record(capture.kind.name, object_ids, owner, items=items)
        except Exception as exc:
            log.exception("request %s: could not record the owner of %s", ex.request_id, object_ids)
            ex.maybe_billed = True
            raise ProxyError(
                500,
                "tokenward could not record who owns the object the upstream created, so it does not hand out "
                "its id; an admin key can still reach it.",
                "owner_not_recorded",
                "server_error",
            ) from exc

    async def _owner(self, capture: Capture) -> str | None:
        """Who owns what ``capture`` finds: the caller, or the owner of the object in the path (``None``: nobody)."""
        if not capture.parent:
            return self.key_id
        parent = self.access.ids[0]
        return (await self.owners.owners([parent])).get(parent)

    def _page_limit(self) -> int:
        """The page size to ask the upstream for, for a filtered list: the largest it serves, or more if asked."""
        kind = self.access.kind
        assert kind is not None
        largest = 1000 if self.anthropic else kind.max_limit
        return max(largest, self._requested_limit())

    def _requested_limit(self) -> int:
        kind = self.access.kind
        for name, value in parse_qsl(self.found.query, keep_blank_values=True):
            if name == "limit" and value.isdigit() and int(value) > 0:
                return int(value)
        return 10_000 if kind is FILE and not self.anthropic else 20  # the providers' defaults

    async def _filtered(self, ex: Exchange, reply: UpstreamReply, resend: Resend) -> UpstreamReply:
        """The caller's objects of one or more upstream pages, as one page of at most ``limit``."""
        kind = self.access.kind
        assert kind is not None
        wanted = self._requested_limit()
        after, before = ("after_id", "before_id") if self.anthropic else ("after", "before")
        backwards = any(name == before for name, _ in parse_qsl(self.found.query, keep_blank_values=True))
        query = _with_params(self.found.query, {"limit": str(self.page_limit)})
        first: dict[str, Any] | None = None
        kept: list[dict[str, Any]] = []
        page: UpstreamReply | None = reply
        for number in range(MAX_PAGES):
            assert page is not None
            document = await _list_page(page, ex)
            first = first or document
            data = [item for item in document["data"] if isinstance(item, dict) and isinstance(item.get("id"), str)]
            owners = await self.owners.owners(item["id"] for item in data)
            mine = [item for item in data if owners.get(item["id"]) == self.key_id]
            kept.extend(mine)
            await self._record_derived(ex, kind, mine)
            more = document.get("has_more") is True
            cursor = document.get("last_id") if self.anthropic else None
            cursor = cursor if isinstance(cursor, str) else (data[-1]["id"] if data else None)
            if len(kept) >= wanted or not more or backwards or cursor is None or number == MAX_PAGES - 1:
                break
            page = await resend(_with_params(query, {after: cursor}))
            if not 200 <= page.status < 300:  # the next page failed: say there is more
                await page.aclose()
                break
        assert first is not None
        has_more = more or len(kept) > wanted
        kept = kept[:wanted]
        result = dict(first, data=kept)
        for name, item in (("first_id", kept[:1]), ("last_id", kept[-1:])):
            if name in result:
                result[name] = item[0]["id"] if item else None
        if "has_more" in result or has_more:
            result["has_more"] = has_more
        body = json.dumps(result, separators=(",", ":"), ensure_ascii=False).encode()
        headers = [(n, v) for n, v in reply.headers if n not in (b"content-length", b"content-encoding")]
        headers.append((b"content-length", str(len(body)).encode()))
        return _Replayed(reply, [body], None, headers=headers)

    async def _models(self, ex: Exchange, reply: UpstreamReply) -> UpstreamReply:
        """A model list without the fine-tuned models (:func:`~tokenward.proxy.objects.fine_tuned`) not the caller's.

        The list is one page (``GET models`` takes no cursor); every other model stays, in order, and
        a list hiding none, or a reply that is not an OpenAI-style list (``data``), is relayed as sent.

        Raises:
            ProxyError: 502 ``list_not_filtered`` for a compressed or oversized reply (as for a list).
        """
        if _encoded(reply):
            await reply.aclose()
            raise _unfiltered("it came compressed although tokenward asked for identity")
        chunks, rest, error = await _read(reply, LIST_MAX_BYTES)
        if rest is not None:
            await reply.aclose()
            raise _unfiltered(f"it is over {LIST_MAX_BYTES // (1024 * 1024)} MiB")
        if error is not None:
            return _Replayed(reply, chunks, None, error)
        body = b"".join(chunks)
        document = _loaded(body)
        data = document.get("data") if isinstance(document, dict) else None
        if not isinstance(data, list):
            return _Replayed(reply, [body], None)
        tuned = [i["id"] for i in data if isinstance(i, dict) and isinstance(i.get("id"), str) and fine_tuned(i["id"])]
        owners = await self.owners.owners(tuned) if tuned else {}
        hidden = {name for name in tuned if owners.get(name) != self.key_id and name not in self.shared}
        if not hidden:
            return _Replayed(reply, [body], None)
        kept = [item for item in data if not (isinstance(item, dict) and item.get("id") in hidden)]
        body = json.dumps(dict(document, data=kept), separators=(",", ":"), ensure_ascii=False).encode()
        headers = [(n, v) for n, v in reply.headers if n not in (b"content-length", b"content-encoding")]
        headers.append((b"content-length", str(len(body)).encode()))
        return _Replayed(reply, [body], None, headers=headers)

    async def _record_derived(self, ex: Exchange, kind: Kind, items: list[dict[str, Any]]) -> None:
        """Record what the provider made for the caller's objects in a list (a batch's output, a job's models)."""
        capture = derived_capture(kind, parent=False)
        for each in (capture, *capture.also) if capture is not None else ():
            made = [object_id for item in items for object_id in captured(each.fields, item)]
            if made:
                await self._record(ex, each, made)


class _ItemWatch:
    """A Responses stream's item ids, gathered from its events as they pass, recorded before its last event.

    Reads ``response.output_item.added`` events (each names one new item) and the stream's last
    event (``response.completed``, ``.incomplete``, ``.failed``: ``response.output[].id``). A delta
    event (most of a stream: ``delta`` in its first 64 bytes, its ``event:`` line or ``type``) costs
    one short substring test, any other one search; oversized events (:class:`Fragment`) are not read.
    """

    __slots__ = ("_also", "_capture", "_decoder", "_ex", "_ids", "_plan", "ended")

    def __init__(self, plan: Plan, ex: Exchange, capture: Capture, decoder: SSEDecoder) -> None:
        self._plan = plan
        self._ex = ex
        self._capture = capture
        self._decoder = decoder
        self._ids: dict[str, None] = {}
        self._also: list[tuple[Capture, list[str]]] = []
        self.ended = False

    def scan(self, blocks: list[bytes]) -> None:
        """Gather the ids of the complete events ``blocks`` (from the decoder) hold; note the last event."""
        for block in blocks:
            if b"delta" in block[:64] or isinstance(block, Fragment) or _ITEM_MARKERS.search(block) is None:
                continue
            event = _decoded_event(block)
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "response.output_item.added":
                self._ids.update(dict.fromkeys(captured(("item.id",), event)))
            elif kind in _STREAM_ENDS:
                self._ids.update(dict.fromkeys(captured(tuple(f"response.{f}" for f in self._capture.items), event)))
                response = event.get("response")
                self._also.extend((more, captured(more.fields, response)) for more in self._capture.also)
                self.ended = True

    def take(self) -> list[str]:
        """The ids gathered and not yet taken."""
        ids, self._ids = list(self._ids), {}
        return ids

    def take_also(self) -> list[tuple[Capture, list[str]]]:
        """The objects of :attr:`Capture.also` the last event named, by capture, not yet taken."""
        also, self._also = self._also, []
        return also

    async def relay(self, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The rest of the stream, unchanged; the ids are recorded before the chunk ending its last event."""
        async for chunk in rest:
            if not self.ended:
                self.scan(self._decoder.feed(chunk))
                if self.ended:
                    await self._save()
            yield chunk
        if not self.ended:
            await self._save()

    async def _save(self) -> None:
        """Record the ids gathered; a failure leaves them unowned (refused later), not the stream broken."""
        ids, also = self.take(), self.take_also()
        if not ids and not any(made for _, made in also):
            return
        plan = self._plan
        try:
            owner = await plan._owner(self._capture)
            if owner is not None:
                if ids:
                    await plan.owners.record(RESPONSE_ITEM.name, ids, owner)
                for more, made in also:
                    if made:
                        await plan.owners.record(more.kind.name, made, owner)
        except Exception:
            log.exception("request %s: could not record the owner of %s", self._ex.request_id, ids)


class _StreamWatch:
    """Objects a stream's events name (:attr:`Capture.streamed`), each recorded before the chunk naming it is relayed.

    A chat stream's audio answers, an Anthropic stream's container. An event is decoded only when
    it holds the quoted name of what it may hold (``"audio"``, ``"container"``); oversized events
    (:class:`Fragment`) are not read. When the store fails, the stream is broken off there
    (:class:`UpstreamError`): the id never reaches the client unowned.
    """

    __slots__ = ("_captures", "_decoder", "_ex", "_markers", "_plan", "_seen")

    def __init__(self, plan: Plan, ex: Exchange, captures: list[Capture], decoder: SSEDecoder) -> None:
        self._plan = plan
        self._ex = ex
        self._captures = captures
        self._decoder = decoder
        self._markers = tuple({f'"{path.split(".")[-2]}"'.encode() for c in captures for path in c.streamed})
        self._seen: set[str] = set()

    def scan(self, blocks: list[bytes]) -> list[tuple[Capture, list[str]]]:
        """The new ids the complete events ``blocks`` name, by capture."""
        found: list[tuple[Capture, list[str]]] = []
        for block in blocks:
            if isinstance(block, Fragment) or not any(marker in block for marker in self._markers):
                continue
            event = _decoded_event(block)
            for capture in self._captures:
                new = [i for i in dict.fromkeys(captured(capture.streamed, event)) if i not in self._seen]
                if new:
                    self._seen.update(new)
                    found.append((capture, new))
        return found

    async def save(self, found: list[tuple[Capture, list[str]]]) -> None:
        """Record what :meth:`scan` found.

        Raises:
            ProxyError: 500 ``owner_not_recorded`` (before the reply starts: the client hears it).
        """
        for capture, ids in found:
            await self._plan._record(self._ex, capture, ids)

    async def relay(self, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The rest of the stream, unchanged; what a chunk names is recorded before it is yielded.

        Raises:
            UpstreamError: the store failed (the chunk naming the object is not relayed).
        """
        async for chunk in rest:
            found = self.scan(self._decoder.feed(chunk))
            if found:
                try:
                    await self.save(found)
                except ProxyError as exc:
                    raise UpstreamError(Failure(FailureKind.DISCONNECTED, True, exc.message)) from None
            yield chunk


class _Replayed:
    """An upstream reply partly (or wholly) read already: the chunks read, then the rest (or the error)."""

    __slots__ = ("_error", "_read", "_reply", "_rest", "headers", "status")

    def __init__(
        self,
        reply: UpstreamReply,
        read: list[bytes],
        rest: AsyncIterator[bytes] | None,
        error: UpstreamError | None = None,
        *,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self._reply = reply
        self._read = read
        self._rest = rest
        self._error = error
        self.status = reply.status
        self.headers = reply.headers if headers is None else headers

    async def chunks(self) -> AsyncIterator[bytes]:
        """The chunks read, then the rest of the upstream's (raises :class:`UpstreamError` where it did)."""
        read, self._read = self._read, []
        for chunk in read:
            yield chunk
        if self._error is not None:
            raise self._error
        if self._rest is not None:
            async for chunk in self._rest:
                yield chunk

    async def read(self) -> bytes:
        """The whole body: the chunks read, then the rest (raises :class:`UpstreamError` where it did)."""
        return b"".join([chunk async for chunk in self.chunks()])

    async def aclose(self) -> None:
        """Release the upstream reply."""
        await self._reply.aclose()


async def _read(
    reply: UpstreamReply, limit: int | None
) -> tuple[list[bytes], AsyncIterator[bytes] | None, UpstreamError | None]:
    """Read a reply to its end or past ``limit`` bytes.

    Returns ``(chunks, rest, error)``: ``rest`` the unread remainder (``None`` at the end), ``error``
    what broke the reply off (``None`` if nothing did).
    """
    stream = reply.chunks().__aiter__()
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in stream:
            chunks.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:
                return chunks, stream, None
    except UpstreamError as exc:
        return chunks, None, exc
    return chunks, None, None


async def _list_page(reply: UpstreamReply, ex: Exchange) -> dict[str, Any]:
    """One upstream list page, decoded (the reply is released).

    Raises:
        ProxyError: 502 ``list_not_filtered`` when it is not a readable JSON list.
    """
    try:
        if _encoded(reply):
            raise _unfiltered("it came compressed although tokenward asked for identity")
        chunks, rest, error = await _read(reply, LIST_MAX_BYTES)
        if error is not None:
            message = f"Upstream {ex.upstream!r}: {error.failure.message}"
            raise ProxyError(502, message, "upstream_failed", "server_error")
        if rest is not None:
            raise _unfiltered(f"it is over {LIST_MAX_BYTES // (1024 * 1024)} MiB: ask for a smaller limit")
        try:
            document = json.loads(b"".join(chunks))
        except (ValueError, RecursionError):
            document = None
        if not isinstance(document, dict) or not isinstance(document.get("data"), list):
            raise _unfiltered("it is not a JSON list")
        return document
    finally:
        await reply.aclose()


def _line_references(line: bytes) -> list[Reference]:
    """The objects one batch input line's request ``body`` names (none for a line that is not a JSON object)."""
    if not line.strip():
        return []
    try:
        document = json.loads(line, object_pairs_hook=_unique)
    except _DuplicateMember as exc:  # the provider might read the other one
        message = f"A line of the batch's input file names the member {str(exc)!r} twice."
        raise ProxyError(400, message, "invalid_json") from None
    except RecursionError:
        raise ProxyError(400, "A line of the batch's input file is nested too deeply.", "invalid_json") from None
    except ValueError:  # not JSON: the provider refuses the line
        return []
    body = document.get("body") if isinstance(document, dict) else None
    return references(body) if isinstance(body, dict) else []


def _unfiltered(why: str) -> ProxyError:
    return ProxyError(
        502, f"tokenward cannot filter the upstream's list reply by owner: {why}.", "list_not_filtered", "server_error"
    )


def _encoded(reply: UpstreamReply) -> bool:
    return (_header(reply, b"content-encoding") or "identity").strip().lower() != "identity"


def _header(reply: UpstreamReply, name: bytes) -> str | None:
    for key, value in reply.headers:
        if key == name:
            return value.decode("latin-1")
    return None


def _event_data(block: bytes) -> bytes | None:
    return parse_event(block)[1]


def _decoded_event(block: bytes) -> Any:
    """The JSON an event's data spells (``None`` for none, or for data that is not JSON)."""
    return _loaded(_event_data(block))


def _loaded(data: bytes | None) -> Any:
    """``data`` decoded as JSON (``None`` for none, or for bytes that are not JSON)."""
    try:
        return json.loads(data) if data is not None else None
    except (ValueError, RecursionError):
        return None


def _runs_code(body: bytes) -> bool:
    """Whether a Messages reply may name a container: the body has the tool, the field, or an escape spelling either."""
    return b"code_execution" in body or may_reference("anthropic_messages", body)


def _stream_id(data: bytes) -> str | None:
    """The object a stream's first event names: a chat chunk's ``id``, a Responses event's ``response.id``."""
    try:
        event = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(event, dict):
        return None
    inner = event.get("response")
    value = inner.get("id") if isinstance(inner, dict) else event.get("id")
    return value if isinstance(value, str) and value else None


def _with_params(query: str, params: dict[str, str]) -> str:
    """``query`` with ``params`` set (replaced where present, appended otherwise)."""
    pairs = [(name, value) for name, value in parse_qsl(query, keep_blank_values=True) if name not in params]
    return urlencode([*pairs, *params.items()])


class _DuplicateMember(ValueError):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _DuplicateMember(name)
            seen.add(name)
    return document


def _is_json(content_type: str | None) -> bool:
    """Whether ``content_type`` is JSON (``application/json``, ``+json``; parameters aside)."""
    kind = parse_options_header(content_type)[0].lower() if content_type else ""
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _decode_strict(body: bytes) -> Any:
    """Decode a request body, refusing a member named twice (the upstream might read the other one).

    Raises:
        ProxyError: 400 ``invalid_json``.
    """
    try:
        return json.loads(body, object_pairs_hook=_unique)
    except _DuplicateMember as exc:
        raise ProxyError(
            400, f"The JSON body of your request names the member {str(exc)!r} twice.", "invalid_json"
        ) from None
    except RecursionError:
        raise ProxyError(400, "The JSON body of your request is nested too deeply.", "invalid_json") from None
    except ValueError as exc:
        raise ProxyError(400, f"We could not parse the JSON body of your request: {exc}", "invalid_json") from None
