"""Which provider objects a request names, creates or lists (pure: no I/O, no HTTP imports).

Design note. Every virtual key behind one proxy shares the provider account, so the provider
cannot tell key A's files from key B's: tokenward must. It records which key created which
object id (:mod:`tokenward.proxy.isolation`), and this module says, for one request, where
object ids are:

* in the path: ``/v1/<collection>/<id>/...`` (:data:`KINDS`; the id after the collection is
  checked for every method, sub-resources such as ``vector_stores/{id}/files`` included);
* in the query of a list: the ``after``/``before`` cursors (``after_id``/``before_id`` for
  Anthropic);
* in the body: :func:`references` walks a decoded JSON body for the fields that name objects
  (:data:`REFERENCE_FIELDS`: ``file_id``, ``input_file_id``, ``training_file``, ``file_ids``,
  ``vector_store_ids``, ``previous_response_id``, ``conversation``, ``assistant_id``, ...),
  wherever they appear (message content parts, tool resources, batch requests), except
  inside client-defined shapes (``metadata``, JSON schemas, tool inputs); and the stored
  items of earlier responses a Responses ``input`` names (``{"type": "item_reference", "id"}``);
* in the reply: a create's id (:class:`Capture`), and objects the provider makes for an
  object (a batch's output and error files, a fine-tuning job's result files, the file an
  upload completes into, a response's output items and the input items it lists).

A segment that is neither a known sub-endpoint (:attr:`Kind.reserved`) nor a recorded id is
treated as an id: a new sub-endpoint of a known collection is refused, not let through.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

__all__ = [
    "AUDIO",
    "CHECKPOINT",
    "FILE",
    "KINDS",
    "RESPONSE_ITEM",
    "REFERENCE_FIELDS",
    "UPLOAD_PART",
    "Access",
    "Capture",
    "DuplicateMember",
    "Kind",
    "Reference",
    "access",
    "captured",
    "derived_capture",
    "fine_tuned",
    "form_documents",
    "kind_named",
    "may_reference",
    "references",
    "selects_stored",
    "video_sources",
]


@dataclass(frozen=True, slots=True)
class Kind:
    """A kind of provider object and the collection path it lives under.

    ``name`` is what the state store records (``file``), ``label`` what a 404 says ("No such
    File object"), ``collection`` the lower-case path below ``/v1`` (``fine_tuning/jobs``).
    ``GET <collection>`` lists objects (filtered per key; for a kind the provider does not list,
    its error passes, and a list it may serve one day is filtered); ``creates``: ``POST
    <collection>`` creates one, whose id is the reply's ``id``; ``reserved``: segments after the
    collection that name sub-endpoints, not ids; ``max_limit``: the largest page the provider
    serves (a filtered list asks for it); ``derived``: reply fields naming files the provider
    made for the object; ``models``: reply fields naming the fine-tuned models it made for the
    object (recorded as :data:`CHECKPOINT`, whose permissions name them).
    """

    name: str
    label: str
    collection: str
    creates: bool = True
    reserved: frozenset[str] = frozenset()
    max_limit: int = 100
    derived: tuple[str, ...] = ()
    models: tuple[str, ...] = ()


FILE = Kind("file", "File", "files", max_limit=10_000)
_UPLOAD = Kind("upload", "Upload", "uploads")
_BATCH = Kind("batch", "Batch", "batches", derived=("output_file_id", "error_file_id"))
_VECTOR_STORE = Kind("vector_store", "VectorStore", "vector_stores")
_CHAT = Kind("chat_completion", "ChatCompletion", "chat/completions", creates=False)  # POST: metered, `store`
_RESPONSE = Kind("response", "Response", "responses", creates=False, reserved=frozenset({"input_tokens", "compact"}))
_CONVERSATION = Kind("conversation", "Conversation", "conversations")
_ASSISTANT = Kind("assistant", "Assistant", "assistants")
_THREAD = Kind("thread", "Thread", "threads", reserved=frozenset({"runs"}))
_FINE_TUNE = Kind(
    "fine_tuning_job", "FineTuningJob", "fine_tuning/jobs", derived=("result_files",), models=("fine_tuned_model",)
)
CHECKPOINT = Kind("fine_tuned_checkpoint", "Checkpoint", "fine_tuning/checkpoints", creates=False)
"""A fine-tuned model or one of its checkpoints (``ft:gpt-4o-mini-2024-07-18:org::B7R9VjQd``, ``...:ckpt-step-88``):
made by the provider for a fine-tuning job, so it belongs to the job's owner; its permissions
(``fine_tuning/checkpoints/{name}/permissions``) share it with other projects of the account."""
_CONTAINER = Kind("container", "Container", "containers")
_VIDEO = Kind("video", "Video", "videos", reserved=frozenset({"edits", "extensions"}))  # POST: a new video
_CHARACTER = Kind("video_character", "Character", "videos/characters")
_EVAL = Kind("eval", "Eval", "evals")
_MESSAGE_BATCH = Kind("message_batch", "MessageBatch", "messages/batches", max_limit=1000)
# ChatKit's threads are made by its front end with a session's client secret, straight at the
# provider: tokenward never sees one made, so they reach admin keys only (and so may a session,
# whose secret reaches every thread of its ``user``: ``Plan.check`` in :mod:`tokenward.proxy.isolation`)
_CHATKIT_SESSION = Kind("chatkit_session", "ChatSession", "chatkit/sessions")
_CHATKIT_THREAD = Kind("chatkit_thread", "ChatKitThread", "chatkit/threads", creates=False)

RESPONSE_ITEM = Kind("response_item", "Item", "responses/*/items", creates=False)
"""A stored response's input or output item (``msg_...``, ``fc_...``, ``rs_...``): no collection of its own,
reached only by an ``item_reference`` in a later request's ``input`` (not in :data:`KINDS`: no path names one)."""

AUDIO = Kind("chat_audio", "Audio", "chat/completions/*/audio", creates=False)
"""A chat completion's audio answer (``choices[].message.audio.id``, ``audio_...``): kept by the provider for a
multi-turn conversation, in which an assistant message names it (``{"role": "assistant", "audio": {"id": ...}}``)
and the model reads it again (platform.openai.com/docs/guides/audio). No path names one (not in :data:`KINDS`)."""

UPLOAD_PART = Kind("upload_part", "UploadPart", "uploads/*/parts", creates=False)
"""One part of an upload (``part_...``, the reply to ``POST uploads/{id}/parts``): it belongs to the upload's
owner, and ``POST uploads/{id}/complete`` names the parts to join by ``part_ids``
(platform.openai.com/docs/api-reference/uploads/complete). No path names one (not in :data:`KINDS`)."""

KINDS: tuple[Kind, ...] = (
    FILE,
    _UPLOAD,
    _BATCH,
    _VECTOR_STORE,
    _CHAT,
    _RESPONSE,
    _CONVERSATION,
    _ASSISTANT,
    _THREAD,
    _FINE_TUNE,
    CHECKPOINT,
    _CONTAINER,
    _VIDEO,
    _CHARACTER,
    _EVAL,
    _MESSAGE_BATCH,
    _CHATKIT_SESSION,
    _CHATKIT_THREAD,
)
"""Every isolated kind. OpenAI: files, uploads, batches, vector stores, stored chat completions,
stored responses, conversations, assistants, threads, fine-tuning jobs and the fine-tuned models and
checkpoints they make, containers, videos,
evals, video characters, ChatKit sessions and threads; Anthropic: files (the same ``/v1/files`` paths) and
message batches."""

_BY_COLLECTION = {kind.collection: kind for kind in KINDS}
_BY_NAME = {kind.name: kind for kind in (*KINDS, RESPONSE_ITEM, AUDIO, UPLOAD_PART)}
_REFERENCING = frozenset(
    {"messages/count_tokens", "fine_tuning/alpha/graders/run", "fine_tuning/alpha/graders/validate"}
)
"""Not objects, but bodies that may name some: a grader's ``model`` (a fine-tuned one is its key's)."""
_STREAMED_UPLOADS = {("files", ""), ("uploads", "parts"), ("videos/characters", "")}
"""Multipart uploads (kind, sub-endpoint): streamed through unread; their forms name no object.
(``containers/{id}/files`` is read: it takes a ``file_id`` to copy, as JSON or as a form field.)"""
_FORMS = frozenset({"", "edits", "extensions"})
"""Video creates whose forms may name objects (``input_reference[file_id]``, ``video[id]``): read and checked."""


@dataclass(frozen=True, slots=True)
class Capture:
    """Where a reply names objects to record: ``fields`` (dotted paths to a string or a list of strings).

    ``items``: paths to the response items the reply holds (``output[].id``: ``[]`` walks a
    list), recorded as :data:`RESPONSE_ITEM`; in a stream they are read from its
    ``response.output_item.added`` events and its last event. ``parent``: the new objects
    belong to the owner of the object in the path (a batch's output file belongs to whoever
    owns the batch, even when an admin reads it); otherwise to the caller. ``also``: captures of
    other kinds from the same reply.
    """

    kind: Kind
    fields: tuple[str, ...]
    parent: bool = False
    items: tuple[str, ...] = ()
    also: tuple[Capture, ...] = ()
    """More objects of other kinds the same reply names (a fine-tuning job's files and its models)."""
    streamed: tuple[str, ...] = ()
    """Where a stream's events name objects of ``kind`` (``choices[].delta.audio.id``): each is recorded
    before the chunk holding it is relayed."""


_CREATED = ("id",)


@dataclass(frozen=True, slots=True)
class Access:
    """What one request does with provider objects (see :func:`access`).

    ``ids`` are the object ids in the path (the first one is the object itself; checked for
    every method); ``lists`` marks a list to filter; ``capture`` where the reply names objects
    to record; ``reads_body``: the body may reference objects (read and check it);
    ``reads_form``: a ``multipart/form-data`` body is read as a form and its text fields checked
    (otherwise a body is checked as JSON).
    """

    kind: Kind | None
    ids: tuple[str, ...] = ()
    lists: bool = False
    capture: Capture | None = None
    reads_body: bool = False
    reads_form: bool = False
    models: bool = False
    """A model list (``GET models``): the fine-tuned models in it that are not the caller's are left out."""


def access(method: str, tail: str) -> Access | None:
    """What ``method /v1/<tail>`` does with provider objects; ``None``: nothing.

    ``tail`` is :attr:`tokenward.proxy.edge.Target.tail` (checked, percent-encoded as sent);
    collections match in lower case, ids exactly (percent-decoded).
    """
    segments = tail.split("/")
    kind = _BY_COLLECTION.get("/".join(segments[:2]).lower()) if len(segments) > 1 else None
    taken = 2
    if kind is None:
        kind = _BY_COLLECTION.get(segments[0].lower())
        taken = 1
    writes = method in ("POST", "PUT", "PATCH")
    if kind is None and segments[0].lower() == "models":
        if len(segments) == 1 and method == "GET":
            return Access(None, models=True)  # every key sees the base models, only its own fine-tuned ones
        if len(segments) == 2 and (method == "DELETE" or fine_tuned(unquote(segments[1]))):
            return Access(CHECKPOINT, ids=(unquote(segments[1]),))  # a fine-tuned model: its job's key's
    if kind is None:
        return Access(None, reads_body=writes) if tail.lower() in _REFERENCING else None
    rest = segments[taken:]
    if not rest:
        if method == "GET":
            return Access(kind, lists=True)
        if method == "POST":
            capture = Capture(kind, _CREATED) if kind.creates else None
            reads = (kind.collection, "") not in _STREAMED_UPLOADS
            return Access(kind, capture=capture, reads_body=reads, reads_form=kind is _VIDEO)
        return None  # HEAD, OPTIONS, DELETE, ... on a collection: no object named, listed or created
    first = rest[0].lower()
    if first in kind.reserved:
        capture = None
        if kind is _THREAD and method == "POST":
            capture = Capture(_THREAD, ("thread_id",))
        elif kind is _VIDEO and method == "POST" and len(rest) == 1:  # videos/edits, videos/extensions
            capture = Capture(_VIDEO, _CREATED)
        forms = kind is _VIDEO and writes and len(rest) == 1 and first in _FORMS
        return Access(kind, capture=capture, reads_body=writes, reads_form=forms)
    object_id = unquote(rest[0])
    sub = rest[1].lower() if len(rest) > 1 else ""
    return Access(
        kind,
        ids=(object_id,),
        capture=_sub_capture(kind, method, sub, len(rest)),
        reads_body=writes and (kind.collection, sub) not in _STREAMED_UPLOADS,
        reads_form=kind is _CONTAINER and writes and sub == "files" and len(rest) == 2,
    )


def _sub_capture(kind: Kind, method: str, sub: str, depth: int) -> Capture | None:
    """What a reply on ``<collection>/<id>[/<sub>]`` creates: derived files, a completed upload's file, a remix."""
    if depth > 2:
        return None
    if (kind.derived or kind.models) and ((method == "GET" and not sub) or (method == "POST" and sub == "cancel")):
        return derived_capture(kind, parent=True)
    if kind is _FINE_TUNE and method == "GET" and sub == "checkpoints":  # the job's checkpoints, by name and id
        return Capture(CHECKPOINT, ("data[].fine_tuned_model_checkpoint", "data[].id"), parent=True)
    if kind is _UPLOAD and method == "POST" and sub == "complete":
        return Capture(FILE, ("file.id",), parent=True)
    if kind is _UPLOAD and method == "POST" and sub == "parts" and depth == 2:  # the part's id: the upload's owner's
        return Capture(UPLOAD_PART, _CREATED, parent=True)
    if kind is _VIDEO and method == "POST" and sub == "remix":
        return Capture(_VIDEO, _CREATED)
    if method == "GET" and kind is _RESPONSE:  # a retrieved (background) response's output, its input items
        path = {"": "output[].id", "input_items": "data[].id"}.get(sub)
        ran = (Capture(_CONTAINER, ("output[].container_id",), parent=True),) if not sub else ()  # its code's
        return Capture(_RESPONSE, (), parent=True, items=(path,), also=ran) if path else None
    if kind is _CONVERSATION and sub == "items" and method in ("GET", "POST"):
        return Capture(_CONVERSATION, (), parent=True, items=("data[].id",))
    return None


def derived_capture(kind: Kind, *, parent: bool) -> Capture | None:
    """What a reply showing ``kind`` objects names that the provider made for them: files, fine-tuned models.

    ``parent``: they belong to the owner of the object in the path (else to the caller).
    ``None`` for a kind with neither.
    """
    files = Capture(FILE, kind.derived, parent=parent) if kind.derived else None
    models = Capture(CHECKPOINT, kind.models, parent=parent) if kind.models else None
    if files is not None and models is not None:
        return Capture(FILE, kind.derived, parent=parent, also=(models,))
    return files or models


def captured(fields: tuple[str, ...], document: Any) -> list[str]:
    """The object ids ``fields`` name in a decoded reply (strings, or lists of strings; others skipped).

    A name ending in ``[]`` walks the list it names: ``output[].id`` is every output item's ``id``.
    """
    found: list[str] = []
    for path in fields:
        values = [document]
        for name in path.split("."):
            walks = name.endswith("[]")
            name = name.removesuffix("[]")
            values = [value.get(name) if isinstance(value, dict) else None for value in values]
            if walks:
                values = [item for value in values if isinstance(value, list) for item in value]
        for value in values:
            if isinstance(value, str) and value:
                found.append(value)
            elif isinstance(value, list):
                found.extend(v for v in value if isinstance(v, str) and v)
    return found


def kind_named(name: str) -> Kind:
    """The kind recorded as ``name`` (``KeyError`` for none)."""
    return _BY_NAME[name]


# -- body references ------------------------------------------------------------------------

REFERENCE_FIELDS: dict[str, Kind] = {
    "file_id": FILE,
    "file_ids": FILE,
    "input_file_id": FILE,
    "training_file": FILE,
    "validation_file": FILE,
    "vector_store_id": _VECTOR_STORE,
    "vector_store_ids": _VECTOR_STORE,
    "previous_response_id": _RESPONSE,
    "conversation": _CONVERSATION,
    "assistant_id": _ASSISTANT,
    "container": _CONTAINER,
    "part_ids": UPLOAD_PART,
}
"""Body fields that name objects, anywhere in a request body, and the kind each names.

A field's value is an id string, a list of them, or (``conversation``) an object with an ``id``;
``{"type": "file_id", "id": ...}`` (an eval's file source) names a file too, and
``{"type": "item_reference", "id": ...}`` (or an ``input`` item with an ``id``, no ``role`` and no
or a null ``type``: the API's ``type`` is optional there; or a ``reasoning`` item without its
``encrypted_content``, which the provider reads from its store) a stored response item
(platform.openai.com/docs/api-reference/responses/create, ``input`` > Item reference). ``container`` is
lenient (see :attr:`Reference.lenient`): containers the provider makes on its own (Responses'
and Anthropic's code execution) are never recorded."""

_CLIENT_SHAPES = frozenset({"metadata", "parameters", "input_schema", "schema", "json_schema", "arguments"})
"""Members whose content the client defines (no provider object is named in them)."""

_MARKERS: dict[str, tuple[bytes, ...]] = {
    "chat_completions": (b"file_id", b'"audio"'),
    "anthropic_messages": (b"file_id", b'"container"'),
    "responses": (
        b"file_id",
        b"vector_store_id",
        b"previous_response_id",
        b'"conversation"',
        b'"container"',
        b'"id"',  # item references (typed or not) and conversation objects
    ),
    "responses_compact": (b"file_id", b"previous_response_id", b'"conversation"', b'"id"'),
    "images": (b"file_id",),
}
"""What :func:`may_reference` looks for per metered endpoint: the fields of :data:`REFERENCE_FIELDS`
that endpoint reads (``file_id`` also finds ``file_ids`` and ``input_file_id``). Each is one scan of
the body, so the chat path pays for one."""
_ALL_MARKERS = tuple(dict.fromkeys(m for markers in _MARKERS.values() for m in markers)) + (b"assistant_id",)
_ASCII_ESCAPE = re.compile(rb"\\u00[0-7]")


@dataclass(frozen=True, slots=True)
class Reference:
    """An object id a request body names: the field, the id, its kind.

    ``lenient``: refused only when recorded as another key's (an id the provider made without
    tokenward seeing it, such as an automatic container, passes).
    """

    field: str
    object_id: str
    kind: Kind
    lenient: bool = False


def may_reference(endpoint: str, body: bytes) -> bool:
    r"""Whether a metered request body may name an object (cheap; a false positive only costs a full decode).

    Looks for the reference fields ``endpoint`` reads (:data:`_MARKERS`; every field for another
    endpoint) and for a ``\u00XX`` escape of an ASCII character, with which a member name can be
    spelled without its letters.
    """
    for marker in _MARKERS.get(endpoint, _ALL_MARKERS):
        if marker in body:
            return True
    return b"\\u00" in body and _ASCII_ESCAPE.search(body) is not None


def references(document: Any) -> list[Reference]:
    """Every object a decoded request body names (see :data:`REFERENCE_FIELDS`), in document order.

    Then the items of a top-level ``input`` (Responses) or ``items`` (conversations) list that
    carry an ``id``: one with no ``role`` and no type is an item reference (the type is
    optional); one that brings its content (an earlier output message, function call, tool call
    passed back) is lenient (:attr:`Reference.lenient`): the provider pairs it with what it
    stored under that id (a message with its reasoning item: "Item 'msg_...' was provided
    without its required 'reasoning' item"), so another key's is refused, while items of
    ``store: false`` responses, which tokenward never records, pass.
    """
    found = list(_walk(document))
    if not isinstance(document, dict):
        return found
    for name in ("input", "items"):
        listed = document.get(name)
        if not isinstance(listed, list):
            continue
        for item in listed:
            if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not item["id"]:
                continue
            if item.get("type") is None and "role" not in item:  # an item reference may leave out its type
                found.append(Reference("id", item["id"], RESPONSE_ITEM))
            elif item.get("type") != "item_reference" and not _stored_by_id(item):  # those: _walk's, strict
                found.append(Reference("id", item["id"], RESPONSE_ITEM, lenient=True))
    return found


def _stored_by_id(item: dict[str, Any]) -> bool:
    """A reasoning item the provider reads from its store by ``id``: one that does not bring its ``encrypted_content``.

    A reasoning item passed back carries only its summary; with ``store`` on, the model goes on from
    the stored reasoning, and without it the item must bring ``encrypted_content`` (openai-python's
    ``ResponseReasoningItemParam``: "especially important when ``store`` is ``false``";
    platform.openai.com/docs/guides/reasoning, read 2026-12-01).
    """
    return item.get("type") == "reasoning" and not item.get("encrypted_content")


def _walk(document: Any) -> Iterator[Reference]:
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(reversed(node))
            continue
        if not isinstance(node, dict):
            continue
        typed = node.get("type")
        if typed == "file_id" and isinstance(node.get("id"), str):
            yield Reference("id", node["id"], FILE)
        elif (typed == "item_reference" or _stored_by_id(node)) and isinstance(node.get("id"), str):
            yield Reference("id", node["id"], RESPONSE_ITEM)
        children = []
        for name, value in node.items():
            kind = REFERENCE_FIELDS.get(name)
            if kind is not None:
                yield from _named(name, value, kind)
            elif name == "audio" and isinstance(value, dict) and isinstance(value.get("id"), str):
                yield Reference("audio", value["id"], AUDIO, lenient=True)  # an earlier audio answer
            elif name == "model" and isinstance(value, str) and fine_tuned(value):  # run, trained on, graded by
                yield Reference("model", value, CHECKPOINT)
            if name in _CLIENT_SHAPES or (name == "input" and isinstance(value, dict)):  # a tool call's input
                continue
            if isinstance(value, dict | list):
                children.append(value)
        stack.extend(reversed(children))


def _named(field: str, value: Any, kind: Kind) -> Iterator[Reference]:
    lenient = kind is _CONTAINER
    if isinstance(value, str):
        yield Reference(field, value, kind, lenient)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, str):
                yield Reference(field, item, kind, lenient)
    elif isinstance(value, dict) and kind in (_CONVERSATION, _CONTAINER) and isinstance(value.get("id"), str):
        yield Reference(field, value["id"], kind, lenient)  # {"id": ...}: Anthropic's container with its skills


_FINE_TUNED = re.compile(r"(?:^|/)\s*ft:", re.IGNORECASE)


def fine_tuned(model: str) -> bool:
    """Whether ``model`` names a fine-tuned model or checkpoint of the account (``ft:gpt-4o-mini-...:org::id``).

    OpenAI names every model its fine-tuning jobs make ``ft:<base>:<org>:<suffix>:<id>``, a
    checkpoint the same plus ``:ckpt-step-<n>`` (platform.openai.com/docs/guides/fine-tuning).
    Matched in any case, after a provider prefix (``openai/ft:...``) or leading blanks too: an
    upstream that is lenient about either must not run another key's model by that spelling.
    """
    return _FINE_TUNED.search(model) is not None


def selects_stored(document: Any) -> bool:
    """Whether an eval run's body selects stored objects by filter rather than by id.

    A run's ``data_source.source`` of type ``stored_completions`` or ``responses`` makes the
    provider pick stored chat completions or responses by model, metadata and time, from every
    key's objects alike (platform.openai.com/docs/api-reference/evals/createRun).
    """
    source = document.get("data_source") if isinstance(document, dict) else None
    inner = source.get("source") if isinstance(source, dict) else None
    return isinstance(inner, dict) and inner.get("type") in ("stored_completions", "responses")


_FORM_NAME = re.compile(r"[^\[\].]+")


class DuplicateMember(ValueError):
    """A JSON value in a form field names a member twice (the message names it)."""


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for name, value in pairs:
        if name in document:
            raise DuplicateMember(f"a JSON value in a form field names the member {name!r} twice")
        document[name] = value
    return document


def form_documents(fields: Iterable[tuple[str, str]]) -> list[Any]:
    """A form's text fields as the JSON documents they spell, one per field, for :func:`references`.

    A name is split at brackets and dots, as form parsers read it: ``input_reference[file_id]=f``
    is ``{"input_reference": {"file_id": "f"}}``, ``video[id]=v`` is ``{"video": {"id": "v"}}``,
    ``file_ids[]=a`` is ``{"file_ids": "a"}``. A value that is a JSON object or array is decoded
    (some servers read JSON in form fields). One document per field, repeated names included, so
    no value hides behind another field of the same name.

    Raises:
        DuplicateMember: a JSON value names a member twice (a server might read the other one).
    """
    documents: list[Any] = []
    for name, value in fields:
        leaf: Any = value
        if value[:1] in ("{", "["):
            try:
                leaf = json.loads(value, object_pairs_hook=_unique_members)
            except DuplicateMember:
                raise
            except (ValueError, RecursionError):
                pass
        for part in reversed(_FORM_NAME.findall(name) or [name]):
            leaf = {part: leaf}
        documents.append(leaf)
    return documents


def video_sources(document: Any) -> list[Reference]:
    """The video a video edit or extension starts from: ``video`` as ``{"id": ...}`` (``video[id]`` in a form) or an id.

    (platform.openai.com/docs/api-reference/videos: ``POST /videos/edits`` and ``/videos/extensions``
    take ``video``, an uploaded file or a reference to a completed video.)
    """
    video = document.get("video") if isinstance(document, dict) else None
    if isinstance(video, dict):
        video = video.get("id")
    return [Reference("video", video, _VIDEO)] if isinstance(video, str) and video else []
