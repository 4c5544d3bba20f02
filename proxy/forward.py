"""Where a request's bytes go: client -> tokenward -> upstream (the way back is ``relay.py``).

:meth:`Forwarder.handle` checks the request line once (:func:`tokenward.proxy.edge.target`) and
routes on exactly the path that will be sent: :meth:`Forwarder.metered` handles the metered
endpoints (:data:`~tokenward.proxy.edge.METERED_ENDPOINTS`), :meth:`Forwarder.passthrough`
forwards every other ``/v1`` request untouched (in ``virtual_keys`` mode only the endpoints the
caller's ``allow_unmetered`` lets pass). Both read who is calling, pick the upstream, send the
request to the URL built from its parsed base (retrying as configured) and return a
:class:`~tokenward.proxy.relay.Relay` for the reply. For streamed chat/completions requests
tokenward asks the upstream for usage (``stream_options.include_usage``, spliced into the body)
when the client did not, and then asks for an uncompressed reply, since it edits the stream.

Every path ends the :class:`~tokenward.proxy.exchange.Exchange` once and hands it to the
recorder once, including refusals, upstream failures and client disconnects.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from decimal import Decimal
from functools import partial
from typing import Any, TypeVar
from urllib.parse import unquote

import msgspec
from litestar import Request
from litestar.exceptions import ClientException, InternalServerException
from litestar.types import Scope

from tokenward.pricing.budgets import CALENDAR_PERIODS, Budget
from tokenward.pricing.quote import worst_case
from tokenward.pricing.runs import RunRefused, parse_run_header, run_budget_name
from tokenward.pricing.settings import GuardSettings
from tokenward.pricing.usage import Usage, UsageSource
from tokenward.proxy import tokenizer
from tokenward.proxy.background import finished_response_id, note_deferred, response_id_in, settle_deferred
from tokenward.proxy.bounds import Unmetered, scan, tool_call_bounds
from tokenward.proxy.budget_api import header_name, reply_headers, usd_text
from tokenward.proxy.config import UpstreamConfig
from tokenward.proxy.degrade import Plan, degrade
from tokenward.proxy.dialects.claude_code import parse_user_id
from tokenward.proxy.edge import (
    AZURE_PREFIX,
    DIRECT_ENDPOINTS,
    METERED_ENDPOINTS,
    EdgeError,
    Endpoint,
    Target,
    account_parameter,
    reply_format_parameter,
    request_dialect,
    target,
)
from tokenward.proxy.errors import ProxyError
from tokenward.proxy.exchange import Exchange, Outcome
from tokenward.proxy.guard import BudgetGuard, BudgetRefusal
from tokenward.proxy.isolation import Isolation, ObjectNotFound
from tokenward.proxy.keys import (
    AUTH_HEADERS,
    GOOGLE_KEY_HEADER,
    Authenticator,
    Identity,
    KeyExpired,
    presented_key,
    query_credentials,
    upstream_credential,
)
from tokenward.proxy.limits import CONNECTION_SCOPE_KEY, BodyLimits, body_stream, read_body
from tokenward.proxy.media import MediaRequest, MediaRequestError, read_request
from tokenward.proxy.media import estimate as media_estimate
from tokenward.proxy.members import check_document, check_top_level, top_level_members
from tokenward.proxy.metering import Meter, count_input, count_texts, estimate, input_bytes
from tokenward.proxy.recorder import Recorder
from tokenward.proxy.relay import HOP_BY_HOP, DisconnectWatch, GiveUp, Relay, connection_options, header
from tokenward.proxy.request_coding import decode_request_body, request_encodings
from tokenward.proxy.routing import Route, Router
from tokenward.proxy.run_budgets import DynamicBudgets
from tokenward.proxy.splice import find_member, set_member
from tokenward.proxy.upstream import UpstreamClient, UpstreamError, UpstreamReply
from tokenward.reports.ledger.books import BooksUnavailable

__all__ = ["AZURE_PATHS", "METERED_ENDPOINTS", "Endpoint", "Forwarder"]

log = logging.getLogger("tokenward.proxy")
_AZURE = AZURE_PREFIX.decode()

# "Expect: 100-continue" (curl, bodies over 1 MiB) is the server's to answer, and tokenward's server
# does as it reads the body: forwarded, the upstream client held the body until the upstream's own
# 100, which a server that waits for the body never sends (nginx does not forward it either).
# Headers naming the URL, host or client of the hop *to* tokenward: a front end the upstream trusts
# (IIS URL Rewrite and Symfony/Laminas read X-Original-URL and X-Rewrite-URL as the path to serve;
# Werkzeug's ProxyFix, uvicorn --forwarded-allow-ips and Rails read the X-Forwarded-* family and
# RFC 7239's Forwarded) would serve or build URLs from the client's word instead of the request line
# tokenward checked, routed, metered and held to the caller's objects. They describe tokenward's
# client side, never the hop to the upstream, so none is forwarded, in either auth mode.
# https://learn.microsoft.com/iis/extensions/url-rewrite-module/url-rewrite-module-configuration-reference,
# https://symfony.com/doc/current/deployment/proxies.html (checked 2026-12-02)
_FORWARDING_HEADERS = frozenset(
    {
        b"x-original-url",
        b"x-rewrite-url",
        b"x-original-uri",
        b"x-original-host",
        b"x-forwarded-host",
        b"x-forwarded-server",
        b"x-forwarded-prefix",
        b"x-forwarded-path",
        b"x-forwarded-uri",
        b"x-forwarded-proto",
        b"x-forwarded-scheme",
        b"x-forwarded-port",
        b"x-forwarded-ssl",
        b"x-forwarded-for",
        b"x-url-scheme",
        b"x-real-ip",
        b"x-client-ip",
        b"x-host",
        b"forwarded",
    }
)
"""Request headers never forwarded upstream: they would let a client name the path, host or scheme served."""
_KEEP_LENGTH_DROPPED = HOP_BY_HOP | _FORWARDING_HEADERS | {b"host", b"expect"}
_NOT_FORWARDED = _KEEP_LENGTH_DROPPED | {b"content-length"}
_UPSTREAM_HEADER = b"x-tokenward-upstream"
_TAGS_HEADER = b"x-tokenward-tags"
_SESSION_HEADER = b"x-tokenward-session"
_USER_HEADER = b"x-tokenward-user"
_RUN_HEADER = b"x-tokenward-run"
_OUTPUT_LIMITS = ("max_completion_tokens", "max_tokens", "max_output_tokens", "max_tokens_to_sample")
_GENERATING = frozenset({"chat_completions", "completions", "responses"})  # Messages requires max_tokens
_ANTHROPIC_HEADERS = frozenset({b"anthropic-version", b"anthropic-beta"})
# Which organization and project of the provider account a request bills: they go with the
# credential, so in virtual_keys mode (tokenward's credential) the client may not pick them.
# https://platform.openai.com/docs/api-reference/authentication (checked 2026-12-01)
# Google's front ends (Gemini's and Vertex AI's OpenAI-compatible endpoints) bill the project named by
# X-Goog-User-Project instead of the credential's: https://cloud.google.com/apis/docs/system-parameters
_ACCOUNT_HEADERS = frozenset({b"openai-organization", b"openai-project", b"x-goog-user-project"})
# A field mask of the reply (Google's front ends): `choices` alone leaves out the usage tokenward records
_FIELD_MASK = b"x-goog-fieldmask"
# Headers a client's Connection header cannot remove from what is forwarded (RFC 9110 7.6.1 makes
# the others it names hop-by-hop): the credential the upstream checks (the client's own in
# passthrough mode: the one its row is attributed to), and what tokenward read the request by (the
# body's length, type and coding; Anthropic's headers, which chose the dialect and upstream).
_WRITES = frozenset({"POST", "PUT", "PATCH"})
"""Methods whose body isolation reads (:attr:`~tokenward.proxy.objects.Access.reads_body`); any other takes none."""
_KEPT_ON_CONNECTION = AUTH_HEADERS | _ANTHROPIC_HEADERS | {b"content-length", b"content-type", b"content-encoding"}
AZURE_PATHS = (
    "under /openai/ tokenward serves Azure OpenAI's API: a POST to a deployment's model endpoints "
    "(/openai/deployments/{deployment}/chat/completions, /completions, /embeddings, /images/... and /audio/...) "
    "and the OpenAI API's other paths with ?api-version= (/openai/responses, /openai/files, /openai/batches, ...) "
    "or under /openai/v1/; Anthropic's paths are not Azure's."
)
"""What a 404 under ``/openai/`` adds: the deployment URLs tokenward forwards, and the way to the rest."""

_ALLOWED_METHODS = b"GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"  # the 405's Allow (front.API_METHODS)
# Headers that make a server act on another method than the request line's (Google's API front
# ends, Rails/Laravel/Express/iris method-override middleware): the unmetered policy and isolation
# judged the request line's. https://github.com/googleapis/gax-java/pull/1465 (checked 2026-12-01)
_METHOD_OVERRIDES = frozenset({b"x-http-method-override", b"x-http-method", b"x-method-override"})
T = TypeVar("T")
COUNT_ON_LOOP_BYTES = 8 * 1024
"""Request bodies up to this size are decoded and counted (or sized) for a budget's bound on the event loop (at most
~0.3 ms at 30 to 47 us per KB); larger ones in a worker thread. The hop to a thread and back
costs ~80 us of CPU and ~0.1 to 0.2 ms of latency at low load (``bench/PROFILE.md``)."""
_INCLUDE_USAGE = b'"stream_options":{"include_usage":true}'
_JSON_SPACE = re.compile(rb"[ \t\r\n]*")
_RAW_MEDIA = ("audio/", "application/octet-stream")  # binary speech replies: relayed as they arrive
_OUTCOME_BY_CODE = {
    "model_not_priced": Outcome.REJECTED,
    "invalid_request": Outcome.CLIENT_ERROR,
    "budget_exceeded": Outcome.REJECTED,
    "endpoint_not_allowed": Outcome.REJECTED,
    "tool_calls_unbounded": Outcome.REJECTED,
    "websocket_not_supported": Outcome.REJECTED,
    "attribution_refused": Outcome.REJECTED,
    "isolation_refused": Outcome.REJECTED,
    "list_not_filtered": Outcome.UPSTREAM_ERROR,
    **dict.fromkeys(
        (
            "run_required",
            "run_not_allowed",
            "run_limit_too_high",
            "run_ttl_too_long",
            "run_ended",
            "run_limit_raised",
            "too_many_runs",
            "runs_unavailable",
            "budget_capacity",
        ),
        Outcome.REJECTED,
    ),
    "client_disconnected": Outcome.CLIENT_DISCONNECTED,
    "unsupported_transfer_coding": Outcome.CLIENT_ERROR,
}
_OUTCOME_BY_STATUS = {
    400: Outcome.CLIENT_ERROR,
    401: Outcome.UNAUTHORIZED,
    404: Outcome.CLIENT_ERROR,
    405: Outcome.CLIENT_ERROR,
    408: Outcome.CLIENT_ERROR,
    413: Outcome.CLIENT_ERROR,
    502: Outcome.UPSTREAM_UNREACHABLE,
    504: Outcome.UPSTREAM_TIMEOUT,
}


class _RequestHead(msgspec.Struct):
    """The request members tokenward acts on; every other member is skipped unparsed."""

    model: Any = None
    stream: Any = None
    stream_options: Any = msgspec.UNSET
    background: Any = None
    user: Any = None
    metadata: Any = None
    n: Any = None
    best_of: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    max_output_tokens: Any = None
    max_tokens_to_sample: Any = None  # Anthropic's legacy Text Completions (required there)
    service_tier: Any = None
    speed: Any = None
    inference_geo: Any = None
    store: Any = None
    models: Any = None
    fallbacks: Any = None


_HEAD_FIELDS = frozenset(_RequestHead.__struct_fields__)
_decode = msgspec.json.decode

MAX_FALLBACK_MODELS = 8
"""Fallback models (``models``, ``fallbacks``) a request under a blocking budget may name: each one
is priced for the bound, so a list of thousands would cost the event loop a bound each. Routers
that document a cap allow 3."""


@dataclass(slots=True)
class _Inbound:
    """What one pass over the client's headers found."""

    headers: list[tuple[bytes, bytes]]
    key: str | None = None
    client_request_id: str | None = None
    upstream: str | None = None
    identity: Identity | None = None
    anthropic: bool = False
    """The request carries Anthropic's headers (``anthropic-version``/``-beta``, or ``x-api-key``)."""
    run: str | None = None
    """The ``X-Tokenward-Run`` header's value."""
    claimed: dict[bytes, str] | None = None
    """Values of the headers attribution rules read (``header:``), by lower-case name."""


def _keep_reply_shape(found: Target, headers: list[tuple[bytes, bytes]]) -> None:
    """Refuse a field mask or reply format on a request whose reply isolation reads.

    A list is filtered by its items' ``id`` and a create's owner recorded from its ``id``: a mask
    leaving ``id`` out made the new object nobody's (its own key then got 404 for it), and a
    protobuf or JSONP reply could not be read at all.

    Raises:
        ProxyError: 400 ``parameter_refused``.
    """
    named = reply_format_parameter(found.query.encode()) if found.query else None
    if named is None and any(name == _FIELD_MASK for name, _ in headers):
        named = "X-Goog-FieldMask"
    if named is not None:
        message = (
            f"tokenward does not forward {named!r} here: it reads this reply (to filter a list by owner or "
            "record who owns what it creates), which must come whole, as JSON."
        )
        raise ProxyError(400, message, "parameter_refused")


_WEBSOCKET_REFUSED = (
    "tokenward does not relay WebSocket connections (the Realtime API, the Responses API's WebSocket mode): "
    "their usage could not be metered. Use the HTTP endpoints (for example POST /v1/responses with "
    "stream: true), or connect to the provider directly."
)


def _framing_refused(scope: Scope) -> ProxyError | None:
    """The refusal for a request framed by a transfer coding tokenward does not apply, or ``None``.

    The server decodes ``chunked`` and nothing else: a body sent ``Transfer-Encoding: gzip, chunked``
    reached the app still gzip-coded, with the header gone (hop-by-hop), so the upstream got the
    coded bytes as if they were the content. RFC 9112 6.1: a server receiving a transfer coding it
    does not understand should answer 501; an HTTP/1.0 message with ``Transfer-Encoding`` has faulty
    framing (400).

    A WebSocket handshake (``Upgrade: websocket``) is refused in the same pass over the headers, with
    501 ``websocket_not_supported``. tokenward relays no WebSocket (OpenAI's Realtime API, the
    Responses API's WebSocket mode). The server answers an upgrade as plain HTTP, and when it was
    forwarded so (``Upgrade`` and ``Connection`` are hop-by-hop), the handshake reached the provider
    as a GET it answered with some 4xx. The SDK then reported ``server rejected WebSocket
    connection: HTTP 400``, naming nothing. A session's usage would not be metered either.
    """
    for name, value in scope["headers"]:
        if name == b"upgrade" and any(
            token.split(b"/")[0].strip().lower() == b"websocket" for token in value.split(b",")
        ):
            return ProxyError(501, _WEBSOCKET_REFUSED, "websocket_not_supported")
        if name != b"transfer-encoding":
            continue
        if scope.get("http_version") == "1.0":
            message = "An HTTP/1.0 request cannot carry Transfer-Encoding (RFC 9112 6.1): send a Content-Length."
            return ProxyError(400, message, "invalid_framing")
        if value.lower() != b"chunked":
            shown = value[:100].decode("latin-1")
            message = (
                f"Transfer-Encoding {shown!r} is not supported: tokenward applies only 'chunked'. Send the body "
                "chunked or with a Content-Length (compress it with Content-Encoding instead)."
            )
            return ProxyError(501, message, "unsupported_transfer_coding")
    return None


def _as_identity(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    """``headers`` for a body sent decoded: no ``Content-Encoding``, a ``Content-Length`` of ``length`` bytes."""
    kept = [h for h in headers if h[0] not in (b"content-encoding", b"content-length", b"transfer-encoding")]
    return [*kept, (b"content-length", str(length).encode())]


class Forwarder:
    """Sends requests upstream and builds the reply relay.

    Args:
        client: the shared upstream client (:mod:`tokenward.proxy.upstream`).
        router: picks the upstream per request.
        auth: names the caller.
        recorder: receives every finished exchange.
        drain_timeout_s: after a client disconnects mid-stream, how long to keep reading the
            upstream for its usage report.
        unpriced_policy: the unpriced-model policy (``allow``, ``block``, ``fallback``) for an
            upstream's requests.
        guard: budgets and their reservations (``None``: no budgets).
        guard_settings: how a request's worst-case cost is bounded for blocking budgets.
        limits: request body size and time limits (:mod:`tokenward.proxy.limits`).
        isolation: keeps each virtual key to its own provider objects (``None``: passthrough mode).
        dynamic: run budgets and per-value budgets (:mod:`tokenward.proxy.run_budgets`).
        clock: epoch seconds now (on a Postgres ledger the database server's clock, so every
            replica puts a request into the same budget period).
    """

    def __init__(
        self,
        client: UpstreamClient,
        router: Router,
        auth: Authenticator,
        recorder: Recorder,
        *,
        drain_timeout_s: float = 60.0,
        unpriced_policy: Callable[[UpstreamConfig], str] = lambda _: "allow",
        guard: BudgetGuard | None = None,
        guard_settings: GuardSettings | None = None,
        limits: BodyLimits | None = None,
        isolation: Isolation | None = None,
        dynamic: DynamicBudgets | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        """Epoch seconds a request starts at (on a Postgres ledger, the database server's clock)."""
        self.client = client
        self.router = router
        self.auth = auth
        self.recorder = recorder
        self.drain_timeout_s = drain_timeout_s
        self.unpriced_policy = unpriced_policy
        self.guard = guard
        self.guard_settings = guard_settings or GuardSettings()
        self.limits = limits or BodyLimits()
        self.isolation = isolation
        self.dynamic = dynamic

    async def handle(self, request: Request[Any, Any, Any]) -> Relay:
        """Route one request on its checked raw path (every method, every path but tokenward's own).

        A path :func:`~tokenward.proxy.edge.target` refuses gets 400 ``invalid_path``, one outside
        ``/v1/`` a 404; ``POST`` to a metered endpoint goes to :meth:`metered`, anything else to
        :meth:`passthrough`. Each of these is recorded.
        """
        scope = request.scope
        raw: bytes = scope.get("raw_path") or scope["path"].encode()
        try:
            found = target(raw, scope["method"], scope["query_string"])
        except EdgeError as exc:
            shown = raw[:1000].decode("ascii", "backslashreplace")
            ex = Exchange(endpoint="unknown", method=scope["method"], path=shown, started_at=self.clock())
            return self._refuse(ex, ProxyError(exc.status, exc.message, exc.code))
        if found is None:
            return self.not_found(request)
        framing = _framing_refused(scope)
        if framing is not None:
            ex = Exchange(endpoint="unknown", method=scope["method"], path=found.path, started_at=self.clock())
            return self._refuse(ex, framing)
        if found.endpoint is not None:
            return await self.metered(request, found)
        return await self.passthrough(request, found)

    async def metered(self, request: Request[Any, Any, Any], found: Target) -> Relay:
        """Forward a request to a metered endpoint; the returned relay meters and records the reply."""
        assert found.endpoint is not None
        ex = Exchange(endpoint=found.endpoint.name, method="POST", path=found.path, started_at=self.clock())
        watch: list[DisconnectWatch] = []
        try:
            return await self._metered(request, found, found.endpoint, ex, watch)
        except BaseException as exc:
            return self._refuse(ex, exc, watch[0] if watch else None)

    async def passthrough(self, request: Request[Any, Any, Any], found: Target) -> Relay:
        """Forward any other ``/v1`` request as is (body streamed both ways); it is recorded unmetered.

        In ``virtual_keys`` mode it must be allowed by the caller's ``allow_unmetered`` (else 403
        ``endpoint_not_allowed``). It goes to an upstream of the request's dialect
        (:func:`~tokenward.proxy.edge.request_dialect`). Provider objects it names, lists or
        creates are held to the caller's own (:mod:`tokenward.proxy.isolation`).
        """
        scope = request.scope
        ex = Exchange(endpoint="passthrough", method=scope["method"], path=found.path, started_at=self.clock())
        content = None
        try:
            inbound = self._inbound(scope, ex, keep_length=True)
            assert inbound.identity is not None
            if not self.auth.passthrough and not inbound.identity.unmetered.allows(found.method, found.tail):
                raise _not_allowed(found, inbound.identity)
            self.recorder.admit(ex)
            _settle_attribution(ex, inbound.identity, inbound.claimed)
            has_body = any(name in (b"content-length", b"transfer-encoding") for name, _ in scope["headers"])
            if found.azure is not None:
                route = self.router.pick_azure(inbound.upstream, deployment=False)
            else:
                route = self.router.pick(None, inbound.upstream, request_dialect(found.tail, inbound.anthropic))
            # the upstream's dialect, not the headers', decides how its lists page (after_id or after)
            anthropic = route.dialect == "anthropic"
            plan = self.isolation.plan(found, inbound.identity, anthropic) if self.isolation else None
            body = None
            if plan is not None:
                if plan.reads_reply:
                    _keep_reply_shape(found, inbound.headers)
                await plan.check()
                if has_body and plan.reads_body:  # a body that may name objects: read it once, check it
                    body = await read_body(request.receive, scope["headers"], self.limits)
                    codings = request_encodings(scope["headers"])
                    if codings:  # checked decoded and sent decoded: the upstream's decoder may read it otherwise
                        body = await asyncio.to_thread(decode_request_body, body, codings, self.limits.max_bytes)
                        inbound.headers = _as_identity(inbound.headers, len(body))
                    await plan.check_body(body, scope["headers"])
                elif has_body and found.method not in _WRITES:  # a body nobody checks: the upstream may read it
                    body = await read_body(request.receive, scope["headers"], self.limits)
                    if body:
                        raise ProxyError(
                            400,
                            f"A {found.method} request to {found.path} takes no body: tokenward does not forward "
                            "one it has not checked for the objects it names.",
                            "body_not_allowed",
                        )
            self._attach(ex, route, inbound)
            if plan is not None:
                input_file = plan.batch_input(body)
                if input_file is not None:  # the requests it runs may name objects too
                    await plan.check_batch_lines(await self._file_content(route, input_file, ex, found))
                found = plan.prepare(found, inbound.headers)
            if has_body and body is None:
                content = body_stream(request.receive, scope["headers"], self.limits)
            await self.recorder.forwarding(ex)
            reply = await self._send(route, found, inbound.headers, content if body is None else body, ex)
            if plan is not None:
                listed = found

                def resend(query: str) -> Any:
                    return self._send(route, replace(listed, query=query), inbound.headers, None, ex)

                reply = await plan.reply(ex, reply, resend)
            finished = finished_response_id(found.method, found.tail) if 200 <= reply.status < 300 else None
            if finished is not None:  # it may show a background response finished: metered on the side
                meter = Meter("openai", header(reply.headers, b"content-encoding"))
                settle = partial(self._settle_finished, finished)
                return Relay(ex, reply, settle, meter=meter, drain_timeout_s=self.drain_timeout_s)
            return Relay(ex, reply, self.complete, drain_timeout_s=self.drain_timeout_s)
        except BaseException as exc:
            # an upload that broke off over a limit: the client hears why, not what the upstream made of it
            return self._refuse(ex, content.error if content is not None and content.error is not None else exc)

    async def _file_content(self, route: Route, file_id: str, ex: Exchange, like: Target) -> UpstreamReply:
        """The upstream's reply to ``GET files/{file_id}/content``, asked with tokenward's credential alone.

        On the API root ``like`` (the batch request) used: under Azure's ``/openai/`` paths, with
        its ``api-version`` and nothing else of its query.

        Raises:
            ProxyError: 400 ``invalid_path`` for an id that is not one plain path segment; as :meth:`_send`.
        """
        try:
            found = target(f"/v1/files/{file_id}/content".encode(), "GET")
        except (EdgeError, UnicodeEncodeError):
            found = None
        if found is None or found.tail.count("/") != 2:
            raise ProxyError(400, f"The input file id {file_id[:100]!r} is not a plain id.", "invalid_path")
        if like.azure is not None:
            version = [p for p in like.query.split("&") if p.partition("=")[0].lower() == "api-version"][:1]
            found = replace(found, azure=like.azure, query="".join(version))
        headers = [(b"accept-encoding", b"identity")] + ([route.auth_header] if route.auth_header else [])
        return await self._send(route, found, headers, None, ex)

    def method_not_allowed(self, request: Request[Any, Any, Any]) -> Relay:
        """Refuse a method the API does not take (``TRACE``, ``PROPFIND``, ...) with a 405, recorded."""
        scope = request.scope
        raw: bytes = scope.get("raw_path") or scope["path"].encode()
        path = raw[:1000].decode("ascii", "backslashreplace")
        method = scope["method"][:32]
        ex = Exchange(endpoint="unknown", method=method, path=path, started_at=self.clock())
        message = f"Method {method} is not allowed: the API takes {_ALLOWED_METHODS.decode()}."
        return self._refuse(ex, ProxyError(405, message, "method_not_allowed", headers=[(b"allow", _ALLOWED_METHODS)]))

    def not_found(self, request: Request[Any, Any, Any]) -> Relay:
        """Refuse a request outside the API with a 404 (recorded like every other request).

        A path under ``/openai/`` that is not Azure's API (a deployment's ``files``,
        ``/openai/messages``) is told what tokenward serves there, :data:`AZURE_PATHS`.
        """
        scope = request.scope
        raw: bytes = scope.get("raw_path") or scope["path"].encode()
        path = raw[:1000].decode("ascii", "backslashreplace")
        ex = Exchange(endpoint="unknown", method=scope["method"], path=path, started_at=self.clock())
        message = f"Unknown path {path}: the OpenAI-compatible API is under /v1."
        if raw.lower().startswith(b"/openai/"):  # Azure's pre-v1 paths: say which of them tokenward serves
            message = f"Unknown path {path}: {AZURE_PATHS}"
        return self._refuse(ex, ProxyError(404, message, "not_found"))

    async def _metered(
        self,
        request: Request[Any, Any, Any],
        found: Target,
        endpoint: Endpoint,
        ex: Exchange,
        watch: list[DisconnectWatch],
    ) -> Relay:
        scope = request.scope
        inbound = self._inbound(scope, ex, keep_length=False)
        self.recorder.admit(ex)  # from here on, a crash leaves this request a row
        body = await read_body(request.receive, scope["headers"], self.limits)  # one copy; not request.body()
        codings = request_encodings(scope["headers"])
        if codings:  # a compressed body (the Codex CLI's zstd): read and forwarded decoded
            body = await asyncio.to_thread(decode_request_body, body, codings, self.limits.max_bytes)
            inbound.headers = [h for h in inbound.headers if h[0] != b"content-encoding"]
        media = None
        if endpoint.dialect == "media":
            media, head = await self._read_media(found, body, scope)
            if body[:64].lstrip()[:1] == b"{":  # a JSON body (a form starts with its boundary)
                check_top_level(body)
        else:
            head = _read_head(body)
        ex.requested_model = head.model if isinstance(head.model, str) else None
        if found.deployment is not None and ex.requested_model is None:
            ex.requested_model = unquote(found.deployment)  # Azure runs the deployment: its name is the model asked
        ex.fallback_models = _fallback_models(head.models, head.fallbacks, ex.requested_model)
        ex.stream = head.stream is True
        # Anthropic: metadata.user_id (Claude Code's holds account, device and session ids)
        identity = parse_user_id(head.metadata.get("user_id")) if isinstance(head.metadata, dict) else None
        ex.session_id = ex.session_id or (identity and identity.session_id)
        if ex.end_user is None:
            user = head.user if isinstance(head.user, str) else None
            ex.end_user = user if user is not None else identity and identity.end_user
        assert inbound.identity is not None
        _settle_attribution(ex, inbound.identity, inbound.claimed)
        await self._join_run(ex, inbound)
        isolation = self.isolation
        plan = isolation.plan_metered(endpoint.name, found, inbound.identity, body, head.store) if isolation else None
        if plan is not None:
            await plan.check_body(body)
        if isolation is not None:  # a fine-tuned model is its job's key's to run
            await isolation.check_models(inbound.identity, (ex.requested_model, *ex.fallback_models))
        if found.azure is not None:
            route = self.router.pick_azure(inbound.upstream, deployment=found.deployment is not None)
        else:
            route = self.router.pick(ex.requested_model, inbound.upstream, endpoint.dialect)
        self._attach(ex, route, inbound)
        strip_usage = False
        if (
            ex.stream
            and endpoint.asks_stream_usage
            and route.config.stream_usage_mode == "ask"
            and not _asks_usage(head.stream_options)
        ):
            body = _with_include_usage(body, head.stream_options)
            strip_usage = True
            # tokenward edits this stream: ask for it uncompressed (the relay decodes it if not)
            inbound.headers = [h for h in inbound.headers if h[0] != b"accept-encoding"]
            inbound.headers.append((b"accept-encoding", b"identity"))
        if plan is not None:
            plan.prepare(found, inbound.headers)
        budget_headers, body = await self._admit(ex, head, body, endpoint, media, route, inbound.upstream)
        # the body is read: receive now only reports a disconnect, which the connection tells at no cost
        watch.append(DisconnectWatch(request.receive, request.scope.get(CONNECTION_SCOPE_KEY)))
        await self.recorder.forwarding(ex)
        reply = await self._send_while_connected(route, found, inbound.headers, body, ex, watch[0])
        if plan is not None:
            reply = await plan.reply(ex, reply, None)  # a stored completion or response: its owner first
        meter = Meter(endpoint.dialect, header(reply.headers, b"content-encoding"))
        return Relay(
            ex,
            reply,
            self.complete,
            meter=meter,
            request_body=body,
            dialect=endpoint.dialect,
            strip_usage=strip_usage,
            deferred_usage=head.background is True,
            watch=watch[0],
            drain_timeout_s=self.drain_timeout_s,
            extra_headers=budget_headers,
            raw_types=_RAW_MEDIA if media is not None else (),
            media=media,
            final_headers=self._final_headers,
        )

    async def _join_run(self, ex: Exchange, inbound: _Inbound) -> None:
        """Hold the request's ``X-Tokenward-Run`` to the caller's run policy; open the run's books.

        Raises:
            ProxyError: 400 ``invalid_run``; 403 ``run_required``, ``run_not_allowed``,
                ``run_limit_too_high``, ``run_ttl_too_long``; 409 ``run_ended``,
                ``run_limit_raised``; 429 ``too_many_runs``; 503 ``runs_unavailable`` (all with
                ``x-should-retry: false``).
        """
        identity = inbound.identity
        assert identity is not None
        if inbound.run is None and identity.runs.mode != "required":
            return
        now = dt.datetime.fromtimestamp(ex.started_at, dt.UTC)
        try:
            header = parse_run_header(inbound.run) if inbound.run is not None else None
            if self.dynamic is None:  # no books for runs: only "no run" can pass
                identity.runs.settle(header)
                if header is not None:
                    raise RunRefused(403, "Run budgets are off on this proxy: drop X-Tokenward-Run.", "run_not_allowed")
                return
            store = self.guard.store if self.guard is not None else None
            run_started = getattr(store, "run_started", None)  # shared books (PgBooks) only
            if header is not None and run_started is not None and self.dynamic.unknown(ex.key_id, header.id):
                try:  # replicas share a run's age: its ttl counts from its first request on any of them
                    first = await run_started(run_budget_name(ex.key_id, header.id), now)
                except BooksUnavailable as exc:
                    raise _books_unavailable() from exc
                self.dynamic.started_elsewhere(ex.key_id, header.id, first)
            ex.run_id = self.dynamic.join(ex.key_id, ex.principal, identity.runs, header, now)
        except RunRefused as exc:
            raise ProxyError(exc.status, exc.message, exc.code, headers=[(b"x-should-retry", b"false")]) from None

    def _final_headers(self, ex: Exchange) -> list[tuple[bytes, bytes]]:
        """Headers of a whole (not streamed) reply, once it is recorded: its cost, the budgets after it."""
        headers = [(b"x-tokenward-cost-usd", usd_text(ex.cost_usd).encode())] if ex.cost_usd is not None else []
        if self.guard is not None:
            headers += reply_headers(self.guard, _attributes(ex), dt.datetime.fromtimestamp(self.clock(), dt.UTC))
        return headers

    async def _read_media(self, found: Target, body: bytes, scope: Scope) -> tuple[MediaRequest, _RequestHead]:
        """Read an images or audio request (JSON or multipart, off the event loop) and its head.

        Raises:
            ProxyError: 400 ``invalid_request`` for a body that cannot be read.
        """
        content_type = header(scope["headers"], b"content-type")
        try:
            media = await asyncio.to_thread(read_request, found.tail, body, content_type)
        except MediaRequestError as exc:
            raise ProxyError(400, str(exc), "invalid_request") from None
        return media, _RequestHead(model=media.model, stream=media.stream, user=media.user, n=media.n)

    async def _admit(
        self,
        ex: Exchange,
        head: _RequestHead,
        body: bytes,
        endpoint: Endpoint,
        media: MediaRequest | None = None,
        route: Route | None = None,
        explicit: str | None = None,
    ) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """Reserve the request's worst-case cost against the blocking budgets in its scope.

        When it does not fit and the budgets allow it (``degrade``), a chat, completions,
        responses or messages request is rerouted to a cheaper model or its output limit lowered
        instead (:mod:`tokenward.proxy.degrade`); the body is edited byte for byte.

        Returns the budget headers for the reply (for a stream: the tightest budget in scope and
        what is left, every budget in scope; a whole reply gets those once recorded), what was
        degraded, and the body to send.

        Raises:
            ProxyError: 429 ``budget_exceeded`` when a blocking budget would go over its limit; 400
                ``model_not_priced`` for a model with no price (unless ``guard.unpriced_hold_usd``);
                429 ``budget_capacity`` when a per-value budget cannot be made.
        """
        guard = self.guard
        if guard is None:
            return [], body
        attributes = _attributes(ex)
        now = dt.datetime.fromtimestamp(ex.started_at, dt.UTC)
        extra: list[tuple[bytes, bytes]] = []
        if self.dynamic is not None and self.dynamic.templates:
            try:
                self.dynamic.check_capacity(attributes)
            except RunRefused as exc:
                raise ProxyError(exc.status, exc.message, exc.code, "insufficient_quota") from None
        if guard.in_scope(attributes, blocking_only=True):
            if len(ex.fallback_models) > MAX_FALLBACK_MODELS:  # each is priced: the bound's work grows with them
                raise ProxyError(
                    400,
                    f"The request names {len(ex.fallback_models)} fallback models; a budget that blocks bounds "
                    f"at most {MAX_FALLBACK_MODELS}.",
                    "too_many_fallback_models",
                )
            unreadable = [name for name in _sent_limits(head) if (_lax_count(getattr(head, name)) or 0) <= 0]
            if media is None and unreadable:
                # 0 and -1 mean "no limit" to some servers (llama.cpp's n_predict): nothing bounds the output
                raise ProxyError(
                    400,
                    f"{unreadable[0]} must be a positive integer: a budget that blocks needs a bound on the "
                    f"output (got {repr(getattr(head, unreadable[0]))[:40]}).",
                    "invalid_output_limit",
                )
            counts: dict[Any, Any] = {}
            if media is None:
                body, extra = self._bound_tool_calls(body, endpoint, extra)
            if media is not None:
                worst, unbounded = await self._media_worst_case(ex, media, now), media.remote_audio
            else:
                # what is left in the budget in scope with least (the bytes bound is weighed against it)
                ample = guard.tightest(attributes, now) if self.guard_settings.bytes_bound_share > 0 else None
                worst, unbounded = await self._worst_case(
                    ex, head, body, endpoint, now, counts=counts, headroom=ample[1] if ample else None
                )
            if worst is not None:
                clamped = False
                try:
                    try:
                        try:
                            ex.reservation = await guard.admit(
                                attributes, worst, now, unbounded=unbounded, request_id=ex.request_id
                            )
                        except BudgetRefusal:
                            if counts or media is not None:  # a media bound is the only one it has
                                raise
                            # bounded by bytes (nothing counted) and refused all the same: others hold
                            # the headroom; the counted bound may fit
                            worst, unbounded = await self._worst_case(ex, head, body, endpoint, now, counts=counts)
                            if worst is None:
                                raise
                            ex.reservation = await guard.admit(
                                attributes, worst, now, unbounded=unbounded, request_id=ex.request_id
                            )
                        ex.reserved_usd = ex.reservation.amount
                    except BudgetRefusal as refusal:
                        plan = None
                        if not unbounded and media is None:
                            plan = await self._degrade(
                                ex, head, body, endpoint, route, explicit, now, attributes, worst, counts
                            )
                        if plan is None:
                            headers = _budget_headers(refusal.budget, refusal.remaining) + _no_retry(refusal, now)
                            message = str(refusal) + self._assumed_limit_note(head, endpoint)
                            raise ProxyError(
                                429, message, "budget_exceeded", "insufficient_quota", headers
                            ) from refusal
                        body, extra = self._apply(ex, head, body, endpoint, route, plan)
                        attributes = _attributes(ex)
                        clamped = plan.max_output_tokens is not None
                except BooksUnavailable as exc:
                    raise _books_unavailable() from exc
                if media is None and not clamped:
                    body, extra = self._set_output_limit(head, body, endpoint, route, extra)
            else:
                await self._hold_unpriced(ex, attributes, now)
        if not ex.stream:  # a whole reply gets them once it is recorded (Relay's final_headers)
            return extra, body
        return reply_headers(guard, attributes, now) + extra, body

    def _bound_tool_calls(
        self, body: bytes, endpoint: Endpoint, extra: list[tuple[bytes, bytes]]
    ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """Bound how many billed calls the provider-run tools a request offers can make, or refuse it.

        A tool billed per call (web search, web fetch, file search, image generation) is called as
        often as the model chooses, so under a blocking budget its calls must be bounded for the
        worst case to be one (:func:`~tokenward.proxy.bounds.tool_call_bounds`; the bound prices
        each call at the entry's fee). A Responses request that bounds none is sent with
        ``max_tool_calls`` = ``guard.max_tool_calls``, an Anthropic server tool without ``max_uses``
        with ``max_uses`` = ``guard.max_tool_calls`` (the reply says so in ``x-tokenward-tool-limit``;
        the body is then re-encoded); any other request with such a tool and no bound (or a bound
        that is not a non-negative integer) is refused.

        Raises:
            ProxyError: 400 ``tool_calls_unbounded``, naming the tool and the member that bounds it.
        """
        if b'"tools"' not in body:
            return body, extra
        try:
            decoded = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError):
            return body, extra  # refused as invalid JSON where the bound counts it
        if not isinstance(decoded, dict):
            return body, extra
        _, unbounded = tool_call_bounds(decoded)
        if not unbounded:
            return body, extra
        limit = self.guard_settings.max_tool_calls
        if endpoint.name == "responses" and limit > 0 and "max_tool_calls" not in decoded:
            edited = set_member(body, "max_tool_calls", str(limit).encode())
            if edited is not None:
                return edited, [*extra, (b"x-tokenward-tool-limit", f"max_tool_calls={limit}".encode())]
        if endpoint.dialect == "anthropic" and limit > 0:  # each unbounded server tool gets its own max_uses
            tools = [t for t in decoded["tools"] if isinstance(t, dict) and t.get("type") in unbounded]
            if tools and all("max_uses" not in t for t in tools):  # a max_uses that is not a count stays refused
                for tool in tools:
                    tool["max_uses"] = limit
                header = (b"x-tokenward-tool-limit", f"max_uses={limit}".encode())
                return msgspec.json.encode(decoded), [*extra, header]
        member = "max_tool_calls" if endpoint.name.startswith("responses") else "max_uses"
        raise ProxyError(
            400,
            f"The request offers the {unbounded[0]!r} tool, which the provider bills per call, and nothing bounds "
            f"how often the model may call it; a budget that blocks needs a bound: set {member} (a non-negative "
            "integer).",
            "tool_calls_unbounded",
        )

    def _assumed_limit_note(self, head: _RequestHead, endpoint: Endpoint) -> str:
        """Why a small request's bound may be large: it set no output limit, so the default was priced."""
        if endpoint.name not in _GENERATING or _sent_limits(head):
            return ""
        return (
            f" The request sets no output limit, so {self.guard_settings.default_max_output_tokens} output tokens "
            "(guard.default_max_output_tokens) were priced: with a max_tokens it can afford it may fit."
        )

    def _set_output_limit(
        self,
        head: _RequestHead,
        body: bytes,
        endpoint: Endpoint,
        route: Route | None,
        extra: list[tuple[bytes, bytes]],
    ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """Send the output limit the bound assumed when a generating request set none.

        The bound prices ``guard.default_max_output_tokens`` of output for such a request; without
        the limit in the body the upstream's own default (a model's whole output window, 100K
        tokens and more for reasoning models) could be spent. Off with ``guard.set_output_limit``.
        """
        settings = self.guard_settings
        if (
            not settings.set_output_limit
            or endpoint.name not in _GENERATING
            or _sent_limits(head)  # sent, even if invalid: the upstream judges it
        ):
            return body, extra
        name = _limit_field(endpoint, route)
        edited = set_member(body, name, str(settings.default_max_output_tokens).encode())
        if edited is None:
            return body, extra
        return edited, [*extra, (b"x-tokenward-output-limit", f"{name}={settings.default_max_output_tokens}".encode())]

    async def _degrade(
        self,
        ex: Exchange,
        head: _RequestHead,
        body: bytes,
        endpoint: Endpoint,
        route: Route | None,
        explicit: str | None,
        now: dt.datetime,
        attributes: dict[str, Any],
        worst: Decimal,
        counts: dict[Any, Any],
    ) -> Plan | None:
        """A cheaper model or a smaller answer that fits (:func:`tokenward.proxy.degrade.degrade`)."""
        assert self.guard is not None

        async def bound(model: str | None, max_output: int) -> Decimal | None:
            if model != ex.requested_model and (
                route is None
                or model is None
                or ex.path.startswith(_AZURE)  # Azure runs the deployment the body or path names: no other model
                or self.router.pick(model, explicit, endpoint.dialect).name != route.name
            ):
                return None  # a cheaper model must be served by the same upstream
            priced, _ = await self._worst_case(
                ex, head, body, endpoint, now, model=model, max_output=max_output, counts=counts
            )
            return priced

        return await degrade(
            self.guard,
            attributes,
            worst,
            now,
            model=ex.requested_model,
            max_output_tokens=_output_limit(head, self.guard_settings.default_max_output_tokens),
            bound=bound,
            request_id=ex.request_id,
        )

    def _apply(
        self, ex: Exchange, head: _RequestHead, body: bytes, endpoint: Endpoint, route: Route | None, plan: Plan
    ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """Edit the body as ``plan`` says (byte for byte), note it on ``ex``; the body and the reply header."""
        ex.reservation = plan.reservation
        ex.reserved_usd = plan.reservation.amount
        notes, parts = [], []
        if plan.model is not None:
            body = set_member(body, "model", msgspec.json.encode(plan.model)) or body
            notes.append(f"model {ex.requested_model} -> {plan.model}")
            parts.append(f"model={plan.model};was={ex.requested_model}")
            ex.sent_model = plan.model
        if plan.max_output_tokens is not None:
            was = _output_limit(head, self.guard_settings.default_max_output_tokens)
            present = _sent_limits(head)
            if not present:  # none was sent: the field the endpoint (and upstream) reads
                present = [_limit_field(endpoint, route)]
            value = str(plan.max_output_tokens).encode()
            for name in present:
                body = set_member(body, name, value) or body
            notes.append(f"{'/'.join(present)} {was} -> {plan.max_output_tokens}")
            parts.append(f"max_tokens={plan.max_output_tokens};was={was}")
        ex.degraded = f"{'; '.join(notes)} (budget {plan.budget.name})"
        header = ", ".join(parts).encode("ascii", "backslashreplace") + b";budget=" + header_name(plan.budget.name)
        return body, [(b"x-tokenward-degraded", header)]

    async def _worst_case(
        self,
        ex: Exchange,
        head: _RequestHead,
        body: bytes,
        endpoint: Endpoint,
        now: dt.datetime,
        *,
        model: str | None = None,
        max_output: int | None = None,
        counts: dict[Any, Any] | None = None,
        headroom: Decimal | None = None,
    ) -> tuple[Decimal | None, bool]:
        """The request's cost bound (USD; ``None``: no price) and whether its input is unbounded.

        ``model`` and ``max_output`` price it as if sent for another model or with another output
        limit per choice (degrading); ``counts`` caches the token count across such calls.

        With ``headroom`` (USD left in the tightest budget in scope), the input is first bounded by
        the UTF-8 size of the texts the tokenizer would count
        (:func:`~tokenward.proxy.metering.input_bytes`), without the tokenizer: every token is at
        least one byte of text. (Not the body's size: the tools are counted as their JSON
        re-encoded, which can be longer.) That bound is used when it is at most
        ``guard.bytes_bound_share`` of the headroom, where over-reserving changes nothing; nearer
        the limit the text is counted.
        """
        model = model or ex.requested_model
        cached = counts.get(model) if counts is not None else None
        share = self.guard_settings.bytes_bound_share
        if cached is None and headroom is not None and headroom > 0 and share > 0:
            by_bytes = await _off_the_loop_if_large(body, _bytes_for_bound, endpoint.dialect, body, endpoint.name)
            bound = self._bound(ex, head, model, max_output, now, by_bytes)
            if bound is not None and bound <= headroom * Decimal(repr(share)):
                return bound, by_bytes[1].unbounded
        if cached is None:
            # the first count of an encoding reads its rank file (~1 s): never on the event loop
            loaded = tokenizer.is_loaded(tokenizer.encoding_for_model(model))
            cached = await _off_the_loop_if_large(
                body, _count_for_bound, endpoint.dialect, body, model, endpoint.name, small=loaded
            )
            if counts is not None:
                counts[model] = cached
        return self._bound(ex, head, model, max_output, now, cached), cached[1].unbounded

    def _bound(
        self,
        ex: Exchange,
        head: _RequestHead,
        model: str | None,
        max_output: int | None,
        now: dt.datetime,
        cached: tuple[int, Unmetered],
    ) -> Decimal | None:
        """:meth:`_worst_case`'s price, from the text tokens counted (or bytes) and what counting misses."""
        settings = self.guard_settings
        counted, extra = cached
        margin = settings.input_margin
        if not tokenizer.encoding_name_known(model):
            margin *= settings.foreign_tokenizer_margin
        uncounted = settings.input_margin_tokens + extra.audio_tokens + extra.opaque_tokens  # added, not scaled
        input_tokens = math.ceil(counted * margin) + uncounted
        limit = max_output if max_output is not None else _output_limit(head, settings.default_max_output_tokens)
        # a prediction's rejected tokens are billed as output beyond the limit (bounds module docstring)
        predicted = math.ceil(extra.prediction_tokens * margin)
        choices = _choices(head)
        dearest: Decimal | None = None
        # the upstream may serve the request with any of its fallback models: the bound is the dearest
        for candidate in (model, *ex.fallback_models):
            if candidate != model and not tokenizer.encoding_name_known(candidate):
                tokens = math.ceil(counted * settings.input_margin * settings.foreign_tokenizer_margin)
                tokens += uncounted
            else:
                tokens = input_tokens
            bound = worst_case(
                self.recorder.catalog,
                model=candidate,
                provider=ex.provider,
                at=now,
                input_tokens=tokens,
                max_output_tokens=(limit + predicted) * choices,
                audio_input_tokens=extra.audio_tokens,
                audio_output=extra.audio_output,
                service_tier=head.service_tier if isinstance(head.service_tier, str) else None,
                speed=head.speed if isinstance(head.speed, str) else None,
                inference_geo=head.inference_geo if isinstance(head.inference_geo, str) else None,
                fallback=ex.price_fallback,
                price_as=ex.price_as,
                images=extra.images,
                image_tokens=settings.image_tokens,
                tool_calls=extra.tool_calls,
            )
            if bound is None:
                return None  # one model the request may reach has no price: it cannot be bounded
            dearest = bound if dearest is None or bound > dearest else dearest
        return dearest

    async def _media_worst_case(self, ex: Exchange, media: MediaRequest, now: dt.datetime) -> Decimal | None:
        """The cost bound (USD; ``None``: no price) of an images or audio request (:mod:`~tokenward.proxy.media`)."""
        settings = self.guard_settings
        counted = await asyncio.to_thread(media.text_tokens)
        text = math.ceil(counted * settings.input_margin) + settings.input_margin_tokens
        return worst_case(
            self.recorder.catalog,
            model=ex.requested_model,
            provider=ex.provider,
            at=now,
            fallback=ex.price_fallback,
            price_as=ex.price_as,
            image_tokens=settings.image_tokens,
            **media.bound_args(text, settings.default_max_output_tokens),
        )

    async def _hold_unpriced(self, ex: Exchange, attributes: dict[str, Any], now: dt.datetime) -> None:
        """Refuse a request no price bounds under a blocking budget, or hold ``guard.unpriced_hold_usd`` for it.

        Raises:
            ProxyError: 400 ``model_not_priced`` naming the budgets; 429 ``budget_exceeded`` when
                the hold does not fit.
        """
        assert self.guard is not None
        hold = self.guard_settings.unpriced_hold_usd
        if hold is None:
            names = ", ".join(repr(b.name) for b in self.guard.in_scope(attributes, blocking_only=True))
            if not ex.requested_model:  # no price to add: the request itself is wrong
                raise ProxyError(400, _no_model(f"budget {names} refuses requests it cannot bound"), "missing_model")
            models = ", ".join(repr(m) for m in (ex.requested_model, *ex.fallback_models))
            raise ProxyError(
                400,
                f"tokenward has no price for model {models}, so it cannot bound what this request "
                f"may cost, and budget {names} refuses requests it cannot bound: ask your admin to add a price "
                "(or set guard.unpriced_hold_usd).",
                "model_not_priced",
            )
        try:
            ex.reservation = await self.guard.admit(attributes, hold, now, request_id=ex.request_id)
            ex.reserved_usd = ex.reservation.amount
        except BudgetRefusal as refusal:
            headers = _budget_headers(refusal.budget, refusal.remaining) + _no_retry(refusal, now)
            raise ProxyError(429, str(refusal), "budget_exceeded", "insufficient_quota", headers) from refusal
        except BooksUnavailable as exc:
            raise _books_unavailable() from exc

    def _inbound(self, scope: Scope, ex: Exchange, *, keep_length: bool) -> _Inbound:
        """One pass over the client's headers: what to forward, who is calling, what it asked.

        Raises:
            ProxyError: 400 ``ambiguous_credentials`` for more than one credential header; 401
                from :meth:`Authenticator.identify`.
        """
        passthrough = self.auth.passthrough
        dropped = _KEEP_LENGTH_DROPPED if keep_length else _NOT_FORWARDED
        inbound = _Inbound(headers=[])
        has_encoding = False
        claimed_names = self.auth.attribution_headers
        credential: tuple[bytes, bytes] | None = None
        credentials = 0
        secrets: set[str] = set()  # passthrough: every credential the upstream may check, in whatever form
        hop = connection_options(scope["headers"], _KEPT_ON_CONNECTION)
        for name, value in scope["headers"]:
            if name in dropped:
                continue
            if name in AUTH_HEADERS:
                credential = (name, value)
                credentials += 1
                if not passthrough:
                    continue
                secrets.add(upstream_credential(name, value) or "")
            elif name == GOOGLE_KEY_HEADER and passthrough:
                secrets.add(value.decode("latin-1").strip())
            elif name in _ACCOUNT_HEADERS and not passthrough:
                continue
            elif name in _METHOD_OVERRIDES:
                raise _method_override(name.decode("latin-1"))
            elif name == _FIELD_MASK and ex.endpoint != "passthrough":
                message = "tokenward does not forward X-Goog-FieldMask to a metered endpoint: the reply would omit "
                raise ProxyError(400, message + "the usage it records.", "parameter_refused")
            elif name in _ANTHROPIC_HEADERS:
                inbound.anthropic = True
            elif name == b"x-request-id":
                inbound.client_request_id = value.decode("latin-1")
            elif name == _UPSTREAM_HEADER:
                inbound.upstream = value.decode("latin-1")
                continue
            elif name == _RUN_HEADER:
                inbound.run = value.decode("latin-1")
                continue
            elif name in claimed_names:
                if inbound.claimed is None:
                    inbound.claimed = {}
                inbound.claimed[name] = value.decode("utf-8", "replace")
                continue
            elif name == _TAGS_HEADER:
                ex.tags = tuple(sorted({t.strip() for t in value.decode("utf-8", "replace").split(",") if t.strip()}))
                continue
            elif name == _SESSION_HEADER:
                ex.session_id = value.decode("utf-8", "replace")
                continue
            elif name == _USER_HEADER:
                ex.end_user = value.decode("utf-8", "replace")
                continue
            if hop and name in hop:  # named in Connection: for tokenward's hop only (read above, not forwarded)
                continue
            if name == b"accept-encoding":
                has_encoding = True
            inbound.headers.append((name, value))
        if not has_encoding:
            inbound.headers.append((b"accept-encoding", b"identity"))
        ex.client_request_id = inbound.client_request_id
        if passthrough:
            secrets.update(query_credentials(scope["query_string"]))
            secrets.discard("")
        if (credentials > 1 and not passthrough) or len(secrets) > 1:
            raise ProxyError(
                400,
                "The request carries more than one credential (authorization, x-api-key, api-key, x-goog-api-key, "
                "?key=): send exactly one, so that the key tokenward attributes is the key the upstream uses.",
                "ambiguous_credentials",
            )
        if credential is not None:
            inbound.anthropic = inbound.anthropic or credential[0] == b"x-api-key"
            inbound.key = upstream_credential(*credential) if passthrough else presented_key(*credential)
        if passthrough:  # one caller, one fingerprint, whichever form its one credential took
            inbound.key = next(iter(secrets), None)
        try:
            identity = inbound.identity = self.auth.identify(inbound.key)
        except KeyExpired as exc:  # the row says whose key it was (before: "anonymous")
            ex.principal, ex.key_id = exc.identity.principal, exc.identity.key_id
            ex.team, ex.project = exc.identity.team, exc.identity.project
            raise
        if not passthrough and inbound.key is not None and len(inbound.key) >= 8:
            _keep_key_here(inbound, scope, ex)
        if not passthrough and (named := account_parameter(scope["query_string"])) is not None:
            raise ProxyError(
                400,
                f"tokenward does not forward the {named!r} parameter: it names the project billed or a credential, "
                "and tokenward's credential decides both. Send your key only as 'Authorization: Bearer <key>'.",
                "parameter_refused",
            )
        ex.principal, ex.key_id = identity.principal, identity.key_id
        ex.team, ex.project = identity.team, identity.project
        ex.org, ex.pool = identity.org, identity.pool
        return inbound

    def _attach(self, ex: Exchange, route: Route, inbound: _Inbound) -> None:
        ex.upstream = route.name
        ex.provider = route.config.catalog_provider
        ex.price_as = route.config.price_as
        policy = self.unpriced_policy(route.config)
        ex.price_fallback = policy == "fallback"
        if policy == "block" and ex.endpoint != "passthrough":
            at = dt.datetime.fromtimestamp(ex.started_at, dt.UTC)
            model, catalog = ex.requested_model, self.recorder.catalog
            if catalog.resolve(model, ex.provider, at, fallback=False, requested=model, price_as=ex.price_as) is None:
                if not model:
                    raise ProxyError(400, _no_model("requests for unpriced models are blocked"), "missing_model")
                raise ProxyError(
                    400,
                    f"tokenward has no price for model {ex.requested_model!r} at upstream {route.name!r}, "
                    "and requests for unpriced models are blocked: ask your admin to add a price.",
                    "model_not_priced",
                )
        if not self.auth.passthrough:
            if route.auth_header is None:
                raise ProxyError(
                    500,
                    f"Upstream {route.name!r} has no API key: set {route.config.api_key_env or 'api_key_env'}.",
                    "upstream_key_missing",
                    "server_error",
                )
            name = route.auth_header[0]
            if name not in AUTH_HEADERS:  # a header of the upstream's own (x-goog-api-key): the client's goes
                inbound.headers = [h for h in inbound.headers if h[0] != name]
            inbound.headers.append(route.auth_header)

    async def _send_while_connected(
        self,
        route: Route,
        found: Target,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        ex: Exchange,
        watch: DisconnectWatch,
    ) -> UpstreamReply:
        """:meth:`_send`, unless the client leaves before the reply begins.

        Then the upstream still gets ``drain_timeout_s`` to answer (a reply that comes is read
        for its usage, as after any disconnect); after that the upstream request is abandoned,
        and the row says the provider may have billed it (its budget reservation is released).

        Raises:
            ProxyError: as :meth:`_send`; 499 ``client_disconnected`` when the upstream was abandoned.
        """
        # No extra task per request: the watch's pending future starts a timer when the client goes,
        # and the timer cancels this request's task where it waits for the upstream.
        give_up = GiveUp(watch, self.drain_timeout_s)
        give_up.waiting = True
        try:
            return await self._send(route, found, headers, body, ex)
        except asyncio.CancelledError:
            if not give_up.given_up():
                raise
            ex.maybe_billed = True
            raise ProxyError(
                499, "The client disconnected before the upstream answered.", "client_disconnected"
            ) from None
        finally:
            give_up.waiting = False
            give_up.stop()

    async def _send(
        self, route: Route, found: Target, headers: list[tuple[bytes, bytes]], content: Any, ex: Exchange
    ) -> UpstreamReply:
        """Send upstream, retrying as the route allows when ``content`` can be sent again.

        The URL is the route's parsed base plus the checked tail and the raw query
        (:meth:`~tokenward.proxy.edge.Base.url`), never text glued together. Each failed attempt
        that may have reached the provider is recorded as an ``attempt`` row.

        Raises:
            ProxyError: 400 when the URL would leave the base; 502/504 once no attempt is left.
        """
        try:
            if found.azure is not None:
                url = route.base.azure_url(found)
            else:
                url = route.base.url(found.tail, found.query)
        except EdgeError as exc:
            raise ProxyError(exc.status, exc.message, exc.code) from exc
        policy = route.config
        retries = policy.retries if content is None or isinstance(content, bytes) else 0
        notes: list[str] = []
        for attempt in range(retries + 1):
            last = attempt == retries
            try:
                reply = await self.client.send(found.method, url, headers, content, route.timeouts)
            except UpstreamError as exc:
                failure = exc.failure
                if last:
                    ex.maybe_billed = failure.maybe_sent
                    code = "upstream_timeout" if failure.status == 504 else "upstream_unreachable"
                    # the client hears what happened, not where: the address stays in the row and the log
                    message = f"Upstream {route.name!r}: {failure.summary}"
                    note = f"Upstream {route.name!r}: {failure.message}"
                    raise ProxyError(failure.status, message, code, "server_error", note=note) from exc
                notes.append(failure.message)
                if failure.maybe_sent:
                    self._record_attempt(ex, attempt + 1, failure.status, failure.message)
                delay = policy.retry_backoff_s * 2**attempt
            else:
                if last or reply.status not in policy.retry_statuses or _retry_refused(reply):
                    if notes:
                        ex.error = f"succeeded after {len(notes)} retries: " + "; ".join(notes)
                    return reply
                notes.append(f"upstream answered {reply.status}")
                delay = _retry_after(reply) or policy.retry_backoff_s * 2**attempt
                await reply.aclose()
            await asyncio.sleep(min(delay, 30.0))
        raise AssertionError("unreachable")  # pragma: no cover

    def _record_attempt(self, ex: Exchange, number: int, status: int, message: str) -> None:
        attempt = ex.attempt(number)
        attempt.maybe_billed = True
        attempt.end(_OUTCOME_BY_STATUS.get(status, Outcome.UPSTREAM_UNREACHABLE), status, message)
        self.recorder.finish(attempt)  # the request's own row (awaited) follows it in the log

    def _refuse(self, ex: Exchange, exc: BaseException, watch: DisconnectWatch | None = None) -> Relay:
        """End ``ex`` for a request that got no upstream reply, and build the error reply."""
        gone = watch is not None and watch.gone()
        if watch is not None:
            watch.close()
        if isinstance(exc, ProxyError):
            error = exc
            outcome = _OUTCOME_BY_CODE.get(exc.code) or _OUTCOME_BY_STATUS.get(exc.status, Outcome.PROXY_ERROR)
        elif isinstance(exc, ClientException | InternalServerException) and "disconnect" in str(exc).lower():
            error = ProxyError(499, "client disconnected", "client_disconnected")
            outcome = Outcome.CLIENT_DISCONNECTED
        else:
            if not isinstance(exc, Exception):
                if isinstance(exc, asyncio.CancelledError):  # the server stopped before the upstream answered
                    ex.end(Outcome.INTERRUPTED, error=f"tokenward shut down while the request was in flight ({exc})")
                else:
                    ex.end(Outcome.PROXY_ERROR, 500, f"interrupted: {type(exc).__name__}")
                ex.maybe_billed = ex.maybe_billed or ex.upstream is not None
                self.recorder.finish(ex)
                raise exc
            log.exception("request %s failed inside tokenward", ex.request_id, exc_info=exc)
            error = ProxyError(500, "tokenward failed to handle the request", "proxy_error", "server_error")
            outcome = Outcome.PROXY_ERROR
        said = error.note or error.message  # the ledger says why; the client may hear less
        if gone:  # the client left while tokenward waited for the upstream: nobody gets this reply
            ex.end(Outcome.CLIENT_DISCONNECTED, error=f"client disconnected; then {said}")
            self.recorder.finish(ex)
        else:
            ex.end(outcome, error.status, said)
            if isinstance(exc, ObjectNotFound):  # the client hears "no such object"
                ex.outcome = Outcome.REJECTED
        return Relay.refusal(ex, error, self._record_refusal)

    async def _record_refusal(self, relay: Relay) -> None:
        await self.recorder.commit(relay.ex)

    async def _settle_finished(self, response_id: str, relay: Relay) -> None:
        """Record a retrieval or cancel of a response; if it shows the response finished, settle its deferred row.

        The retrieval's own row stays ``not_metered`` (it bills nothing itself); the usage it shows
        goes to the background request's row (:func:`~tokenward.proxy.background.settle_deferred`).
        """
        assert relay.meter is not None
        try:
            result = relay.meter.finish()
            if result.usage is not None and relay.got_reply:
                await settle_deferred(
                    self.recorder.ledger.state,
                    self.recorder.catalog,
                    self.guard,
                    response_id,
                    relay.ex.upstream,
                    result.usage,
                    model=result.model,
                    service_tier=result.service_tier,
                    raw_usage=result.raw_usage,
                )
        except Exception:  # the retrieval's row is never lost to a settlement that failed
            log.exception("settling background response %s failed", response_id)
        await self.recorder.commit(ex=relay.ex)

    async def complete(self, relay: Relay) -> None:
        """Meter what the reply said, classify how it ended, and record the exchange (awaited once by the relay).

        Classification, for a metered reply:

        * an error the upstream reported inside a 2xx reply (an error event, an error chunk, a
          failed Responses object) makes an ``ok`` exchange ``upstream_error``;
        * a stream that ended without its terminal event (:attr:`Meter.complete`) makes an ``ok``
          exchange ``upstream_failed``;
        * usage reported: recorded as reported;
        * none reported, the upstream said 2xx: a body that broke off, was cut mid-body or could not
          be decoded may be billed (``maybe_billed``: price status ``usage_unknown``); a background reply's usage is
          deferred; otherwise tokens are estimated, ``estimated`` when the reply ended well and
          ``partial`` when it did not (client gone, stream cut, error event). After an error event
          only generated content is billed: an error before any content is not billed;
        * none reported, the upstream said 4xx/5xx: not billed;
        * a reply the meter fails on (a shape no dialect rule foresaw): ``usage_unknown``, with the
          failure in the row's ``error`` (the row is never lost, the reservation counts as spend).

        What the meter relayed without metering (an SSE event over its cap, an undecodable body)
        is noted in the row's ``error``.
        """
        ex, meter, request_body = relay.ex, relay.meter, relay.request_body
        if meter is None:
            await self.recorder.commit(ex)
            return
        try:
            result = meter.finish()
        except Exception as exc:  # a reply no dialect rule foresaw: the row is kept, the provider may bill it
            log.exception("metering the reply of %s failed", ex.request_id)
            ex.maybe_billed = True
            ex.error = ex.error or f"the reply could not be metered: {type(exc).__name__}: {exc}"[:500]
            await self.recorder.commit(ex)
            return
        ex.served_model = result.model or None
        ex.service_tier = result.service_tier
        ex.provider_cost = result.provider_cost
        if result.web_search_calls == 0 and b"oogle" in request_body and _offers_google_search(request_body):
            ex.unseen_tool = "Google Search grounding"
        if result.error is not None:
            ex.error = ex.error or result.error
            if ex.outcome is Outcome.OK:
                ex.outcome = Outcome.UPSTREAM_ERROR
        elif relay.streaming and not result.complete and ex.outcome is Outcome.OK:
            ex.outcome = Outcome.UPSTREAM_FAILED
            ex.error = ex.error or "the stream ended without its terminal event"
        if result.unmetered is not None:
            ex.error = f"{ex.error}; {result.unmetered}" if ex.error else result.unmetered
        if result.usage is not None:
            ex.usage = result.usage
            if relay.media is not None and result.usage.output_images and not result.usage.image_variant:
                ex.usage = replace(result.usage, image_variant=relay.media.variant)  # the reply named no size
            ex.parts = result.parts
            ex.raw_usage = result.raw_usage
            stopped = not result.complete or (result.error is not None and relay.dialect == "anthropic")
            if relay.streaming and relay.media is None and stopped:
                # a stream cut (or an Anthropic one failed) after a running usage report (message_start
                # says output_tokens 1): what it generated so far may be more than the report says
                seen = partial(
                    estimate,
                    relay.dialect,
                    request_body,
                    list(meter.kept_reply),
                    stream=True,
                    model=ex.served_model or ex.requested_model,
                    source=UsageSource.PARTIAL,
                    only_if_output=True,
                    endpoint=ex.endpoint,
                )
                await self.recorder.commit(ex, estimate=partial(_with_output_seen, result.usage, seen))
                return
            await self.recorder.commit(ex)
            return
        reply_status = relay.reply.status if relay.reply is not None else (ex.http_status or 0)
        if not 200 <= reply_status < 300:
            await self.recorder.commit(ex)
            return
        if not relay.got_reply or (not relay.streaming and not result.complete) or meter.undecodable:
            # the body broke off, was cut mid-body or could not be decoded: the provider may bill it,
            # and what it generated is not known (an estimate would count no output)
            ex.maybe_billed = True
            await self.recorder.commit(ex)
            return
        if relay.deferred_usage and result.error is None:
            ex.usage_deferred = True
            response_id = response_id_in(list(meter.kept_reply))
            if response_id is not None:  # settled when its finished response is seen (proxy.background)
                await note_deferred(self.recorder.ledger.state, ex, response_id)
            await self.recorder.commit(ex)
            return
        source = UsageSource.ESTIMATED if ex.outcome is Outcome.OK else UsageSource.PARTIAL
        if relay.media is not None:
            kept = list(meter.kept_reply)
            ex.maybe_billed = ex.maybe_billed or relay.media.remote_audio  # its estimate may find no length
            await self.recorder.commit(ex, estimate=partial(media_estimate, relay.media, kept, source=source))
            return
        job = partial(
            estimate,
            relay.dialect,
            request_body,
            list(meter.kept_reply),
            stream=relay.streaming,
            model=ex.served_model or ex.requested_model,
            source=source,
            web_search_requests=result.web_search_calls,
            tool_calls=result.tool_calls,
            only_if_output=result.error is not None,
            endpoint=ex.endpoint,
        )
        await self.recorder.commit(ex, estimate=job)


def _with_output_seen(reported: Usage, seen: Callable[[], Usage | None]) -> Usage:
    """``reported`` with the output counted in the reply so far (``seen``, a tokenizer estimate) when that is more.

    For a stream that stopped before its final usage report: the report is a running total that
    may lag the output generated. Such a usage is ``partial``.
    """
    counted = seen()
    if counted is None or counted.output_tokens <= reported.output_tokens:
        return reported
    return replace(reported, output_tokens=counted.output_tokens, source=UsageSource.PARTIAL)


def _read_head(body: bytes) -> _RequestHead:
    """The members of a JSON request body tokenward acts on.

    Raises:
        ProxyError: 400 ``invalid_json`` for an empty body, one that is not a JSON object, or one
            naming a top-level member twice in different case (:mod:`~tokenward.proxy.members`).
    """
    if not body.strip():
        raise ProxyError(400, "The request body is empty: send a JSON object.", "invalid_json")
    try:
        members = top_level_members(body)  # one scan: the case-clash check and the members read below
        return _RequestHead(**{name: _decode(raw) for name, raw in members.items() if name in _HEAD_FIELDS})
    except msgspec.ValidationError as exc:
        raise ProxyError(400, f"The request body must be a JSON object: {exc}", "invalid_json") from exc
    except msgspec.DecodeError as exc:
        raise ProxyError(400, f"We could not parse the JSON body of your request: {exc}", "invalid_json") from exc
    except RecursionError:
        raise ProxyError(400, "The JSON body of your request is nested too deeply.", "invalid_json") from None


def _keep_key_here(inbound: _Inbound, scope: Scope, ex: Exchange) -> None:
    """Keep the caller's virtual key from the upstream: drop headers holding it, refuse a URL holding it.

    Google's SDKs send their key as ``x-goog-api-key`` or ``?key=``; a client that sends its
    virtual key that way beside ``Authorization`` would hand the provider (or a relay upstream)
    a key that spends through tokenward.

    Raises:
        ProxyError: 400 ``key_in_url`` when the path or query string holds the key (the row's path
            masks it).
    """
    secret = inbound.key.encode("latin-1") if inbound.key is not None else b""
    if secret in (scope.get("raw_path") or b"") or secret in scope["query_string"]:
        ex.path = ex.path.replace(inbound.key or "", "***")  # nor does the ledger keep it
        raise ProxyError(
            400,
            "The request URL holds your virtual key, which tokenward never sends upstream: send it only as "
            "'Authorization: Bearer <key>'.",
            "key_in_url",
        )
    if any(secret in value for _, value in inbound.headers):
        inbound.headers = [h for h in inbound.headers if secret not in h[1]]


def _method_override(name: str) -> ProxyError:
    """The 400 for a request asking the upstream to act on another method (a header or ``_method``)."""
    return ProxyError(
        400,
        f"tokenward does not forward {name}: an upstream that honours it would act on another method than the "
        "one tokenward checked. Send the request with the method you mean.",
        "method_override_refused",
    )


def _not_allowed(found: Target, identity: Identity) -> ProxyError:
    """The 403 for an unmetered endpoint the caller's ``allow_unmetered`` does not let pass."""
    method = "GET" if found.method == "HEAD" else found.method
    first, _, rest = found.tail.partition("/")
    suggestion = f"{method} {first.lower()}" + ("/*" if rest else "")
    if method == "POST" and found.tail.lower() in DIRECT_ENDPOINTS:
        return ProxyError(
            403,
            f"POST /v1/{found.tail} opens spending straight at the provider that tokenward never sees (no usage, "
            "no budget), and passes only an entry naming it exactly, without a wildcard: add "
            f"'POST {found.tail.lower()}' to {identity.unmetered_setting} to let it pass.",
            "endpoint_not_allowed",
            "permission_error",
        )
    return ProxyError(
        403,
        f"tokenward does not meter {found.method} /v1/{found.tail}, and in virtual_keys mode unmetered endpoints "
        f"are refused unless allowed: add {suggestion!r} to {identity.unmetered_setting} to let it pass.",
        "endpoint_not_allowed",
        "permission_error",
    )


def _settle_attribution(ex: Exchange, identity: Identity, claimed: dict[bytes, str] | None = None) -> None:
    """Hold the client's ``end_user``, ``tags`` and ``session`` claims to the caller's rules (403 if broken).

    ``claimed``: the values of the headers the rules read (``header:``).
    """
    attribution = identity.attribution
    if not attribution.open:
        ex.end_user, ex.tags, ex.session_id = attribution.settle(ex.end_user, ex.tags, ex.session_id, claimed)



def _attributes(ex: Exchange) -> dict[str, Any]:
    """A request's budget-scope attributes before the reply (the requested model, the one sent, its fallbacks)."""
    return {
        "key": ex.principal,
        "key_id": ex.key_id,
        "team": ex.team,
        "project": ex.project,
        "org": ex.org,
        "pool": ex.pool,
        "run": ex.run_id,
        "end_user": ex.end_user,
        "model": ((ex.requested_model,) if ex.sent_model is None else (ex.requested_model, ex.sent_model))
        + ex.fallback_models,
        "upstream": ex.upstream,
        "tag": ex.tags,
    }


def _fallback_models(models: Any, fallbacks: Any, requested: str | None) -> tuple[str, ...]:
    """The models a request names besides ``model`` for the upstream to fall back on, in order.

    OpenRouter serves a request with the next of its ``models`` when one fails (over its context,
    moderated, rate limited), and its Anthropic Messages endpoint takes the same list as
    ``fallbacks``, entries ``{"model": ...}`` (https://openrouter.ai/docs/guides/routing,
    checked 2026-12-01), so each may bill it. Upstreams that know neither refuse the request.
    """
    named = [m for m in models if isinstance(m, str)] if isinstance(models, list) else []
    if isinstance(fallbacks, list):
        named += [f.get("model") if isinstance(f, dict) else f for f in fallbacks]
    return tuple(dict.fromkeys(m for m in named if isinstance(m, str) and m != requested))


def _output_limit(head: _RequestHead, default: int) -> int:
    """The request's output limit per choice: the largest valid of its output-limit fields, else ``default``.

    The largest, since an upstream may read any one of them (``max_tokens`` beside
    ``max_completion_tokens``: an OpenAI-compatible server that knows only ``max_tokens``).
    """
    limits = [
        v
        for v in map(
            _lax_count, (head.max_completion_tokens, head.max_tokens, head.max_output_tokens, head.max_tokens_to_sample)
        )
        if v is not None and v > 0
    ]
    return max(limits) if limits else default


def _offers_google_search(body: bytes) -> bool:
    """Whether a request offers Gemini's Google Search grounding (a ``tools`` entry ``{"google_search": {}}``)."""
    try:
        decoded = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return False
    tools = decoded.get("tools") if isinstance(decoded, dict) else None
    return any(
        isinstance(t, dict) and "type" not in t and any(k.lower().startswith("google") for k in t)
        for t in (tools if isinstance(tools, list) else ())
    )


def _choices(head: _RequestHead) -> int:
    """How many completions the request may generate: the larger of ``n`` and ``best_of`` (at least 1).

    ``best_of`` (completions) generates that many server-side and bills them all, returning ``n``
    (https://platform.openai.com/docs/api-reference/completions/create, checked 2026-12-01).
    """
    return max(_lax_count(head.n) or 1, _lax_count(head.best_of) or 1, 1)


def _lax_count(value: Any) -> int | None:
    """A count as a lenient upstream may read it: an int, an integral float (``100.0``) or a string of one (``"100"``).

    OpenAI refuses the last two, but OpenAI-compatible servers validating in lax mode (pydantic's
    default: vLLM, LiteLLM and others) read them as the integer, so a bound must too. ``None``
    for anything else (``true``, ``1.5``, ``"many"``).
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float | str):
        try:
            number = Decimal(value.strip() if isinstance(value, str) else repr(value))
        except ArithmeticError:
            return None
        if number.is_finite() and number == number.to_integral_value():
            return int(number.max(_LAX_FLOOR).min(_LAX_CEILING))
    return None


_LAX_CEILING, _LAX_FLOOR = Decimal(2**53), Decimal(-(2**53))  # beyond any count; bounds at it refuse anyway


def _sent_limits(head: _RequestHead) -> list[str]:
    """The output-limit fields the request sets (to any value but ``null``)."""
    return [name for name in _OUTPUT_LIMITS if getattr(head, name) is not None]


def _limit_field(endpoint: Endpoint, route: Route | None) -> str:
    """The output-limit field to add to a request that sent none.

    Responses: ``max_output_tokens``; chat at OpenAI and Azure: ``max_completion_tokens`` (their
    reasoning models refuse ``max_tokens``); anything else: ``max_tokens``.
    """
    if endpoint.name == "responses":
        return "max_output_tokens"
    if endpoint.name == "anthropic_complete":
        return "max_tokens_to_sample"
    provider = route.config.catalog_provider if route is not None else ""
    if endpoint.name == "chat_completions" and provider in ("openai", "azure", "azure-openai"):
        return "max_completion_tokens"
    return "max_tokens"


def _count_for_bound(dialect: str, body: bytes, model: str | None, endpoint: str) -> tuple[int, Unmetered]:
    """The request's text tokens and what text counting misses, from one decode (off the event loop)."""
    try:
        decoded = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        decoded = None
    check_document(decoded)  # what is counted must be what every upstream reads
    found = scan(decoded)
    found.prediction_tokens = count_texts(found.prediction_texts, model)
    return count_input(dialect, decoded, model, endpoint), found


async def _off_the_loop_if_large(body: bytes, work: Callable[..., T], *args: Any, small: bool = True) -> T:
    """``work(*args)`` on the event loop for a body up to :data:`COUNT_ON_LOOP_BYTES`, else in a worker thread.

    ``small=False`` sends even a small body's work to the thread (it would load a tokenizer).
    """
    if small and len(body) <= COUNT_ON_LOOP_BYTES:  # the thread hop would cost more than the work
        return work(*args)
    return await asyncio.to_thread(work, *args)


def _bytes_for_bound(dialect: str, body: bytes, endpoint: str) -> tuple[int, Unmetered]:
    """:func:`_count_for_bound` without the tokenizer: the UTF-8 bytes of the texts it counts (never fewer)."""
    try:
        decoded = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        decoded = None
    check_document(decoded)
    found = scan(decoded)
    found.prediction_tokens = sum(len(text.encode("utf-8", "surrogatepass")) for text in found.prediction_texts)
    return input_bytes(dialect, decoded, endpoint), found


def _books_unavailable() -> ProxyError:
    """503 ``budget_books_unavailable``: fail closed, no replica can know what the others hold."""
    message = "A hard budget applies to this request and its books cannot be reached; try again soon."
    return ProxyError(503, message, "budget_books_unavailable", "server_error", [(b"retry-after", b"5")])


def _no_model(why: str) -> str:
    """The message for a request with no string ``model`` that tokenward had to price (``why``: what refused it)."""
    return (
        "The request names no model (a 'model' member holding a string), so tokenward cannot price it, "
        f"and {why}: send the model's name."
    )


def _no_retry(refusal: BudgetRefusal, now: dt.datetime) -> list[tuple[bytes, bytes]]:
    """Headers that tell clients not to retry a budget refusal at once.

    OpenAI's and Anthropic's SDKs honour ``x-should-retry``; ``retry-after`` gives the seconds
    until a calendar period resets.
    """
    headers = [(b"x-should-retry", b"false")]
    if refusal.budget.period.kind in CALENDAR_PERIODS:
        seconds = math.ceil((refusal.resets - now).total_seconds())
        headers.append((b"retry-after", str(max(seconds, 1)).encode()))
    return headers


def _budget_headers(budget: Budget, remaining: Decimal) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-tokenward-budget", header_name(budget.name)),
        (b"x-tokenward-budget-remaining-usd", usd_text(remaining).encode()),
    ]


def _retry_refused(reply: UpstreamReply) -> bool:
    """Whether the upstream said not to retry (``x-should-retry: false``, which OpenAI and Anthropic send).

    The openai and anthropic SDKs honour it before the status (``_should_retry`` in their
    ``_base_client.py``, read 2026-12-02); tokenward's own retries do the same.
    """
    value = header(reply.headers, b"x-should-retry")
    return value is not None and value.strip().lower() == "false"


def _retry_after(reply: UpstreamReply) -> float | None:
    """Seconds from a reply's ``Retry-After`` header (the seconds form only; ``None`` when it is not a finite number).

    ``float`` also reads ``nan`` and ``inf`` (and ``1e400`` as ``inf``): a NaN made uvloop's sleep raise
    (the client got a 500) and an infinity waited the whole 30 s cap.
    """
    value = header(reply.headers, b"retry-after")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return max(seconds, 0.0) if seconds is not None and math.isfinite(seconds) else None


def _asks_usage(options: Any) -> bool:
    return isinstance(options, dict) and options.get("include_usage") is True


def _with_include_usage(body: bytes, options: Any) -> bytes:
    """The request body with ``stream_options.include_usage`` set to true, every other byte kept.

    No ``stream_options`` member: one is spliced in after the opening brace. An object: its
    ``include_usage`` is set (or added) in place. Anything else (``null``): the value is replaced.
    Only a body the splice cannot follow (never seen; it was decoded once already) is re-encoded.
    """
    if options is msgspec.UNSET:  # one new copy of the body, no slices of it
        start = body.index(b"{") + 1
        space = _JSON_SPACE.match(body, start)  # `*`: always matches, perhaps empty
        after = space.end() if space is not None else start
        empty = body[after : after + 1] == b"}"
        view = memoryview(body)
        return b"".join((view[:start], _INCLUDE_USAGE, b"" if empty else b",", view[start:]))
    member = find_member(body, "stream_options")
    if member is not None:
        if isinstance(options, dict):
            edited = set_member(body, "include_usage", b"true", member.value_start)
            if edited is not None:
                return edited
        else:
            return body[: member.value_start] + b'{"include_usage":true}' + body[member.value_end :]
    try:
        document = msgspec.json.decode(body)
    except RecursionError:
        raise ProxyError(400, "The JSON body of your request is nested too deeply.", "invalid_json") from None
    document["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return msgspec.json.encode(document)
