r"""The request edge: what a client's request line names, and the one upstream URL it may reach.

Design note. A proxy that glues ``base_url + raw_path`` lets the client write the URL: ``%2f@host``
becomes userinfo and host, ``..`` climbs out of the base path once the HTTP client normalises it,
and ``//`` shifts what follows the base (``shared/NOTES.md`` section 6). And when routing reads the
decoded path while the upstream reads the raw one, ``/v1/./chat/completions`` is routed as
"other" but served as chat. So this module does three things, in this order, on bytes:

1. :func:`target` checks the raw path against a strict grammar (no dot segments, no empty
   segments, no encoded ``/`` ``\`` ``.`` ``%``, no encoded unreserved characters or control
   characters, no ``@`` ``;`` ``\`` or spaces) and refuses anything else with
   :class:`EdgeError` (400 ``invalid_path``). A path that passes has one meaning for every RFC 3986
   reader, so it is routed *and* sent as is: the metered-endpoint lookup and the upstream see the
   same bytes.
2. :func:`parse_base` parses each upstream ``base_url`` once into scheme, host, port and path.
3. :meth:`Base.url` builds the upstream URL from those components plus the checked tail, with the
   query string byte for byte (yarl's ``encoded=True``: nothing is re-quoted), and then checks
   that the result, read back by a second parser, still has the base's origin and path prefix.

Which unmetered endpoints may pass in ``virtual_keys`` mode is :class:`UnmeteredPolicy`; the
metered endpoints are :data:`METERED_ENDPOINTS`. Pure: no I/O, no Litestar or HTTP client imports.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urlsplit

from yarl import URL

__all__ = [
    "ACCOUNT_PARAMETERS",
    "AZURE_PREFIX",
    "DEPLOYMENTS_PREFIX",
    "DIRECT_ENDPOINTS",
    "FREE_ENDPOINTS",
    "METERED_ENDPOINTS",
    "Base",
    "EdgeError",
    "Endpoint",
    "Target",
    "UnmeteredPolicy",
    "account_parameter",
    "parameter_names",
    "parse_base",
    "reply_format_parameter",
    "request_dialect",
    "target",
]


class EdgeError(ValueError):
    """A request (or a base URL) the edge refuses; ``status`` and ``code`` say how to answer it."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A metered endpoint: its ledger name, its dialect, and whether streams need usage asked for."""

    name: str
    dialect: str
    asks_stream_usage: bool


METERED_ENDPOINTS: dict[str, Endpoint] = {
    "chat/completions": Endpoint("chat_completions", "openai", True),
    "completions": Endpoint("completions", "openai", True),
    "embeddings": Endpoint("embeddings", "openai", False),
    "responses": Endpoint("responses", "openai", False),
    # a compaction runs the model over the conversation and bills its usage (a Responses usage object)
    "responses/compact": Endpoint("responses_compact", "openai", False),
    "messages": Endpoint("anthropic_messages", "anthropic", False),
    # Anthropic's legacy Text Completions: its reply carries no usage, so both sides are counted offline
    "complete": Endpoint("anthropic_complete", "anthropic", False),
    "images/generations": Endpoint("images", "media", False),
    "images/edits": Endpoint("images", "media", False),
    "images/variations": Endpoint("images", "media", False),
    "audio/speech": Endpoint("audio_speech", "media", False),
    "audio/transcriptions": Endpoint("audio_transcriptions", "media", False),
    "audio/translations": Endpoint("audio_translations", "media", False),
}
"""Metered endpoints (``POST`` only) by lower-case path below ``/v1``. Add a row to meter one more.

The ``media`` dialect's endpoints take JSON or ``multipart/form-data`` bodies
(:mod:`tokenward.proxy.media`)."""

FREE_ENDPOINTS: tuple[str, ...] = (
    "GET models",
    "GET models/*",
    "POST messages/count_tokens",
    "POST responses/input_tokens",
)
"""The default ``auth.allow_unmetered``: endpoints that cost nothing and create nothing.

Model lists and model lookups (OpenAI and Anthropic, ``HEAD`` included), Anthropic's token
counting and OpenAI's input-token counting are free at the provider (docs.anthropic.com
"Token counting"; platform.openai.com "Counting tokens"). ``DELETE models/...`` (deleting a
fine-tuned model) is left out on purpose, hence the ``GET``.
"""

DIRECT_ENDPOINTS: frozenset[str] = frozenset(
    {"realtime/client_secrets", "realtime/sessions", "realtime/transcription_sessions", "realtime/calls"}
)
"""Endpoints whose ``POST`` opens spending straight at the provider, past tokenward, for minutes to hours.

Realtime's client secrets (``ek_...``, valid up to 2 hours) let a browser or any holder open
Realtime sessions at ``api.openai.com`` with the account's quota; ``realtime/calls`` hands a
WebRTC peer a media session with the provider. None of that spend passes tokenward again: one
row, no usage, no budget (platform.openai.com/docs/api-reference/realtime-sessions, checked
2026-12-02). So they pass only an ``allow_unmetered`` entry that names them exactly, without a
wildcard (``POST realtime/client_secrets``): ``*`` or ``realtime/*`` does not let them pass.
"""

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_FORBIDDEN_ESCAPES = frozenset(range(0x20)) | {0x7F, ord("/"), ord("\\"), ord("%")} | _UNRESERVED
# Segments of unreserved characters, sub-delims other than ";", ":" and percent escapes.
_PATH = re.compile(rb"(?:/[A-Za-z0-9\-._~!$&'()*+,=:%]+)+")
_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")
_DOT_SEGMENT = re.compile(rb"/\.\.?(?=/|$)")
_QUERY = re.compile(rb"[!\"$-~]*")  # printable ASCII but "#"
_PREFIX = b"/v1/"
AZURE_PREFIX = b"/openai/"
"""Azure OpenAI's own paths (``AzureOpenAI(azure_endpoint=...)``): ``/openai/{tail}``, ``/openai/v1/{tail}``."""
DEPLOYMENTS_PREFIX = b"/openai/deployments/"
"""Azure OpenAI deployment URLs (``AzureOpenAI(azure_endpoint=...)``): ``/openai/deployments/{name}/...``."""
_AZURE_V1 = "v1/"
_NOT_AZURE_TAILS = frozenset({"deployments", "v1"})
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class Target:
    """A checked request line.

    ``path`` is the raw path as sent (``/v1/chat/completions``), ``tail`` the part below ``/v1/``
    (``chat/completions``), still percent-encoded as the client sent it; ``query`` the raw query
    string (``""`` for none); ``endpoint`` the metered endpoint it names, or ``None``.
    ``azure`` is ``None`` under ``/v1/``; for Azure OpenAI's own paths it is the API root the client
    used below the resource's ``/openai`` path: ``""`` for ``/openai/{tail}`` (the pre-v1 API the
    ``AzureOpenAI`` client calls, ``?api-version=...``) and ``"v1/"`` for ``/openai/v1/{tail}``.
    ``tail`` is then the same as under ``/v1/`` (``responses``, ``files/file-1``), so metering and
    object isolation read it alike. ``deployment`` is the Azure deployment of a
    ``/openai/deployments/{deployment}/{tail}`` path. Such requests go only to an Azure upstream,
    at :meth:`Base.azure_url`.
    """

    method: str
    path: str
    tail: str
    query: str
    endpoint: Endpoint | None
    deployment: str | None = None
    azure: str | None = None


def target(raw_path: bytes, method: str, query: bytes = b"") -> Target | None:
    """Check a request's raw path and query (bytes as on the request line).

    Returns:
        The :class:`Target`, or ``None`` for a well-formed path outside ``/v1/`` and
        :data:`AZURE_PREFIX` (a 404). Under :data:`DEPLOYMENTS_PREFIX`, only a ``POST`` to a metered
        OpenAI-dialect endpoint of one deployment is a target
        (``/openai/deployments/gpt-4o/chat/completions``); anything else there is a 404 too, and so
        is an Anthropic-dialect endpoint under :data:`AZURE_PREFIX` (``/openai/messages``).

    Raises:
        EdgeError: 400 ``invalid_path`` for a path that could mean different things to tokenward
            and to the upstream (see the module note), 400 ``invalid_query`` for a query string
            with bytes outside printable ASCII, 400 ``method_override_refused`` for a ``_method``
            parameter, 400 ``parameter_refused`` for a parameter that makes the upstream read the
            body by another media type (``$ct``) or, on a metered endpoint, answer in another shape
            (``alt``, ``fields``, ``callback``).
    """
    if not _plain(raw_path):
        if raw_path == b"/":
            return None
        raise EdgeError(400, _why_refused(raw_path), "invalid_path")
    if query and _QUERY.fullmatch(query) is None:
        message = "The query string holds a space, '#', a control character or a non-ASCII byte: percent-encode it."
        raise EdgeError(400, message, "invalid_query")
    if query and (b"%" in query or b"method" in query.lower()) and _overrides_method(query):
        message = (
            "tokenward does not forward a _method query parameter: an upstream that honours it would act on "
            "another method than the one tokenward checked. Send the request with the method you mean."
        )
        raise EdgeError(400, message, "method_override_refused")
    deployment = azure = None
    if raw_path.startswith(_PREFIX):
        path = raw_path.decode("ascii")
        tail = path[4:]
        endpoint = METERED_ENDPOINTS.get(tail.lower()) if method == "POST" else None
    elif raw_path.startswith(DEPLOYMENTS_PREFIX):
        if method != "POST":
            return None
        path = raw_path.decode("ascii")
        deployment, _, tail = path[len(DEPLOYMENTS_PREFIX) :].partition("/")
        azure = ""
        endpoint = METERED_ENDPOINTS.get(tail.lower())
        if endpoint is None or endpoint.dialect == "anthropic":
            return None  # a deployment serves the OpenAI API's model endpoints, nothing else
    elif raw_path.startswith(AZURE_PREFIX):
        path = raw_path.decode("ascii")
        tail = path[len(AZURE_PREFIX) :]
        azure = _AZURE_V1 if tail[:3].lower() == _AZURE_V1 else ""
        tail = tail[len(azure) :]
        if not tail or tail.partition("/")[0].lower() in _NOT_AZURE_TAILS:
            return None
        endpoint = METERED_ENDPOINTS.get(tail.lower()) if method == "POST" else None
        if endpoint is not None and endpoint.dialect == "anthropic":
            return None  # Azure OpenAI serves the OpenAI API, not Anthropic's
    else:
        return None
    if query and (refused := _steering_parameter(query, endpoint is not None)) is not None:
        raise refused
    return Target(method, path, tail, query.decode("ascii"), endpoint, deployment, azure)


def _overrides_method(query: bytes) -> bool:
    """Whether a query string has a ``_method`` parameter (Rails, Laravel, Express), in any case or encoding."""
    return b"_method" in parameter_names(query)


def parameter_names(query: bytes) -> frozenset[bytes]:
    """The names of a raw query string's parameters, percent-decoded and in lower case (``&`` or ``;`` between them)."""
    return frozenset(unquote_to_bytes(part.partition(b"=")[0]).lower() for part in re.split(rb"[&;]", query))


# Google's API front ends (Gemini's OpenAI-compatible endpoint, Vertex AI's) read "system parameters"
# from any request's query string: https://cloud.google.com/apis/docs/system-parameters (checked 2026-12-02).
_CONTENT_TYPE_OVERRIDES = frozenset({b"$ct"})
"""Parameters that make the upstream read the body by another media type than the ``Content-Type`` tokenward read."""
_REPLY_FORMATS = frozenset({b"alt", b"$alt", b"fields", b"$fields", b"callback", b"$callback"})
"""Parameters that make a reply protobuf, a field mask of itself (``usage`` left out) or JSONP: not what is metered."""
ACCOUNT_PARAMETERS = frozenset({b"userproject", b"$userproject", b"key", b"$key", b"access_token", b"oauth_token"})
"""Parameters naming the project billed (``$userProject``) or a credential (``key``, ``access_token``): with
tokenward's credential (``virtual_keys`` mode) the client may choose neither (see :func:`account_parameter`)."""


def _steering_parameter(query: bytes, metered: bool) -> EdgeError | None:
    """The refusal for a parameter that changes how the upstream reads the body or, on a metered endpoint, the reply."""
    names = parameter_names(query)
    if names & _CONTENT_TYPE_OVERRIDES:
        return EdgeError(
            400,
            f"tokenward does not forward the {min(names & _CONTENT_TYPE_OVERRIDES).decode()!r} parameter: the upstream "
            "would read the body by another media type than its Content-Type, which tokenward read. Send the "
            "Content-Type you mean.",
            "parameter_refused",
        )
    if metered and names & _REPLY_FORMATS:
        return EdgeError(
            400,
            f"tokenward does not forward the {min(names & _REPLY_FORMATS).decode()!r} parameter to a metered endpoint: "
            "the reply would not be the JSON or event stream whose usage it records.",
            "parameter_refused",
        )
    return None


def reply_format_parameter(query: bytes) -> str | None:
    """The first (in sort order) parameter of a raw query string that reshapes the reply (``alt``, ``fields``, ...).

    Google's front ends answer such a request with a field mask of the reply, protobuf or JSONP: a
    reply tokenward reads (a list it filters by owner, a create whose id it records) is then not
    the JSON it reads. ``None`` when there is none.
    """
    found = parameter_names(query) & _REPLY_FORMATS if query else None
    return min(found).decode("latin-1") if found else None


def account_parameter(query: bytes) -> str | None:
    """The first (in sort order) parameter of a raw query string in :data:`ACCOUNT_PARAMETERS`, decoded; or ``None``."""
    found = parameter_names(query) & ACCOUNT_PARAMETERS if query else None
    return min(found).decode("latin-1") if found else None


def _plain(raw_path: bytes) -> bool:
    """Whether a path is ``/``-separated non-empty segments that every reader splits the same way."""
    return (
        _PATH.fullmatch(raw_path) is not None
        and (b"%" not in raw_path or _escapes_allowed(raw_path))
        and (b"/." not in raw_path or _DOT_SEGMENT.search(raw_path) is None)
    )


def _escapes_allowed(raw_path: bytes) -> bool:
    escapes = _ESCAPE.findall(raw_path)
    if len(escapes) != raw_path.count(b"%"):
        return False
    return not any(int(e, 16) in _FORBIDDEN_ESCAPES for e in escapes) and _utf8(raw_path)


def _utf8(raw_path: bytes) -> bool:
    """Whether a path's escapes spell UTF-8: no overlong form (``%C0%AF``, ``%C0%AE``), lone byte or surrogate.

    A lenient decoder reads an overlong form as the ASCII character it encodes, so ``%C0%AE%C0%AE%C0%AF``
    is ``../`` to it (the classic IIS traversal) while every strict reader sees three odd bytes.
    """
    try:
        unquote_to_bytes(raw_path).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _why_refused(raw_path: bytes) -> str:
    """The message for a refused path: which rule it broke."""
    shown = raw_path[:200].decode("ascii", "backslashreplace")
    for byte in raw_path:
        if byte < 0x21 or byte > 0x7E:
            return f"The request path {shown!r} holds a space, a control character or a non-ASCII byte."
    if not raw_path.startswith(b"/"):
        return f"The request path {shown!r} must start with '/'."
    for char, name in ((b"\\", "a backslash"), (b"@", "'@'"), (b";", "';'")):
        if char in raw_path:
            return f"The request path {shown!r} holds {name}, which tokenward does not forward in a path."
    if b"//" in raw_path or raw_path.endswith(b"/"):
        return f"The request path {shown!r} has an empty segment ('//' or a trailing '/')."
    if _DOT_SEGMENT.search(raw_path):
        return f"The request path {shown!r} has a '.' or '..' segment."
    escapes = _ESCAPE.findall(raw_path)
    if len(escapes) == raw_path.count(b"%"):
        for escape in escapes:
            if int(escape, 16) in _FORBIDDEN_ESCAPES:
                return (
                    f"The request path {shown!r} percent-encodes {chr(int(escape, 16))!r} (%{escape.decode()}): "
                    "encoded '/', '\\', '.', '%', letters, digits and control characters are refused."
                )
        if not _utf8(raw_path):
            return (
                f"The request path {shown!r} percent-encodes bytes that are not UTF-8 "
                "(an overlong form reads as '/' or '.' to a lenient decoder)."
            )

    return f"The request path {shown!r} is not a plain path (segments of letters, digits, '-._~:' and %XX escapes)."


@dataclass(frozen=True, slots=True)
class Base:
    """An upstream's ``base_url`` parsed once.

    ``host`` is as it appears in a URL (IPv6 in brackets), ``port`` the effective port, ``path``
    the base path without a trailing slash (``""`` or ``/v1``).
    """

    scheme: str
    host: str
    port: int
    path: str

    def url(self, tail: str, query: str = "") -> URL:
        """The upstream URL for a checked tail (:attr:`Target.tail`) and raw query string.

        Raises:
            EdgeError: 400 ``invalid_path`` when the built URL does not keep this base's origin
                and path (a tail that did not come from :func:`target`).
        """
        url = URL.build(
            scheme=self.scheme,
            host=self.host,
            port=self.port,
            path=f"{self.path}/{tail}",
            query_string=query,
            encoded=True,
        )
        self.check(url)
        return url

    def azure_url(self, found: Target) -> URL:
        """The Azure OpenAI URL of an Azure :class:`Target` (``found.azure`` is not ``None``).

        Azure's paths live under the resource's ``/openai`` path
        (learn.microsoft.com/azure/ai-foundry/openai/reference, checked 2026-12-02), whichever
        form the base takes: ``https://r.openai.azure.com``, ``.../openai`` or ``.../openai/v1``
        (the v1 API's base) all give ``https://r.openai.azure.com/openai/deployments/{deployment}/{tail}``
        for a deployment, ``.../openai/{tail}`` for the pre-v1 API and ``.../openai/v1/{tail}``
        for the v1 API, each with the client's query (``api-version``) byte for byte.

        Raises:
            EdgeError: 400 ``invalid_path`` when the built URL does not stay under that ``/openai`` path.
        """
        root = self.path[:-3] if self.path.lower().endswith("/v1") else self.path
        if not root.lower().endswith("/openai"):
            root += "/openai"
        if found.deployment is not None:
            tail = f"deployments/{found.deployment}/{found.tail}"
        else:
            tail = f"{found.azure or ''}{found.tail}"
        return Base(self.scheme, self.host, self.port, root).url(tail, found.query)

    def check(self, url: URL) -> None:
        """Check that ``url`` (and its text, read back with :func:`urllib.parse.urlsplit`) stays under this base.

        Raises:
            EdgeError: 400 ``invalid_path`` when the origin differs, or the path does not start with
                the base path or holds a segment a client could normalise away (``..``, ``.``, ``//``).
        """
        prefix = self.path + "/"
        text = urlsplit(str(url))
        if (
            url.scheme != self.scheme
            or url.host_subcomponent != self.host
            or url.port != self.port
            or url.user is not None
            or not url.raw_path.startswith(prefix)
            or not _plain(url.raw_path.encode())
            or text.scheme != self.scheme
            or text.username is not None
            or text.hostname != self.host.strip("[]")
            or (text.port or _DEFAULT_PORTS[self.scheme]) != self.port
            or not text.path.startswith(prefix)
        ):
            raise EdgeError(400, "The request path would leave the upstream's base URL.", "invalid_path")


def parse_base(base_url: str) -> Base:
    """Parse an upstream ``base_url`` (``https://api.openai.com/v1``).

    Raises:
        ValueError: not an absolute http(s) URL, or it carries userinfo, a query, a fragment or a
            path that :func:`target` would refuse.
    """
    url = URL(base_url.rstrip("/"), encoded=True)
    if url.scheme not in ("http", "https") or not url.raw_host:
        raise ValueError("base_url must be an absolute http(s) URL such as https://api.openai.com/v1")
    if url.user is not None or url.password is not None:
        raise ValueError("base_url must not carry a user or password: use api_key_env")
    if url.raw_query_string or url.raw_fragment:
        raise ValueError("base_url must not carry a query string or a fragment")
    path = url.raw_path.rstrip("/")
    if path and not _plain(path.encode()):
        raise ValueError(f"base_url path {path!r} must be plain segments (no '//', '.', '..' or encoded '/')")
    assert url.port is not None  # http(s) always has one
    host = url.host_subcomponent
    assert host is not None
    return Base(url.scheme, host.lower(), url.port, path)


class UnmeteredPolicy:
    """Which endpoints tokenward does not meter may pass (``auth.allow_unmetered``).

    Each entry is ``[METHOD ]PATTERN``: a glob (``*`` matches anything, ``/`` included) over the
    path below ``/v1``, compared in lower case; without a method any method matches. ``GET``
    entries cover ``HEAD`` too, and ``OPTIONS`` always passes (it can neither cost nor change
    anything).

    Raises:
        ValueError: an entry with an unknown method, an empty pattern or a leading ``/``.
    """

    __slots__ = ("_by_method", "_named", "entries")

    def __init__(self, entries: Iterable[str]) -> None:
        self.entries = tuple(entries)
        globs: dict[str, list[str]] = {method: [] for method in _METHODS}
        named: set[tuple[str, str]] = set()
        for entry in self.entries:
            method, pattern = _split_entry(entry)
            for name in (method,) if method else _METHODS:
                globs[name].append(fnmatch.translate(pattern.lower()))
                named.add((name, pattern.lower()))
        self._by_method = {m: re.compile("|".join(g)) for m, g in globs.items() if g}
        self._named = frozenset(named)

    def allows(self, method: str, tail: str) -> bool:
        """Whether ``method`` on ``/v1/<tail>`` may pass unmetered.

        A ``POST`` to one of :data:`DIRECT_ENDPOINTS` passes only an entry naming it exactly.
        """
        if method == "OPTIONS":
            return True
        lower = tail.lower()
        if method == "POST" and lower in DIRECT_ENDPOINTS:
            return (method, lower) in self._named
        regex = self._by_method.get("GET" if method == "HEAD" else method)
        return regex is not None and regex.match(lower) is not None


def _split_entry(entry: str) -> tuple[str | None, str]:
    words = entry.split()
    method = words[0].upper() if len(words) == 2 else None
    pattern = words[-1] if words and len(words) <= 2 else ""
    if method is not None and method not in _METHODS:
        raise ValueError(f"allow_unmetered entry {entry!r}: unknown method {method!r}")
    if not pattern or pattern.startswith("/") or (method is None and pattern.upper() in _METHODS):
        raise ValueError(f"allow_unmetered entry {entry!r}: give a path below /v1 such as 'files/*' (no leading '/')")
    return method, pattern


def request_dialect(tail: str, anthropic_headers: bool) -> str:
    """The API dialect a request speaks: ``anthropic`` or ``openai``.

    Anthropic-only paths (``messages``, ``messages/...``, ``complete``) are Anthropic's; so is any
    request carrying Anthropic's headers (``anthropic-version``, ``anthropic-beta``, or
    ``x-api-key`` without ``authorization``: ``anthropic_headers``), such as the Anthropic SDK's
    ``GET /v1/models``.
    """
    lower = tail.lower()
    if anthropic_headers or lower == "messages" or lower.startswith("messages/") or lower == "complete":
        return "anthropic"
    return "openai"
