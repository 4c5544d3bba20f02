"""Errors tokenward itself answers with, in OpenAI's error shape.

Every refusal or failure that tokenward (not the upstream) reports is a
:class:`ProxyError`, rendered as ``{"error": {"message", "type", "code", "param"}}`` with the
matching HTTP status, both by the relay and by the Litestar exception handlers in
:data:`EXCEPTION_HANDLERS` (anything raised in a route). A request in Anthropic's dialect (its
path, its ``anthropic-version``/``anthropic-beta`` header or its ``x-api-key``) gets the same
document in Anthropic's error shape as well, :func:`reply_error_body`: ``{"type": "error",
"error": {"type", "message", "code", "param"}}`` with ``error.type`` from Anthropic's vocabulary
for the status, which the Anthropic SDK (``APIStatusError.type``) and Claude Code read, while
OpenAI-shaped readers still find ``error.message`` and ``error.code``. Upstream error replies are
never rewritten: they reach the client exactly as the upstream sent them.
"""

from __future__ import annotations

import logging

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

__all__ = [
    "EXCEPTION_HANDLERS",
    "ProxyError",
    "anthropic_error_type",
    "error_body",
    "reply_error_body",
    "speaks_anthropic",
]

log = logging.getLogger("tokenward.proxy")


class ProxyError(Exception):
    """A request tokenward refuses or cannot complete.

    Args:
        status: HTTP status (400 bad input, 401 unknown key, 502 upstream unreachable,
            504 upstream timeout, 500 tokenward's own failure).
        message: human-readable explanation.
        code: machine-readable code (``invalid_json``, ``invalid_api_key``, ...).
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``, ...).
        headers: extra response headers (budget refusals name the budget and what is left).
        note: what the ledger row and the log record instead of ``message``: details the
            client must not see (an upstream's address, why an id was refused).
    """

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        type: str = "invalid_request_error",
        headers: list[tuple[bytes, bytes]] | None = None,
        note: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type
        self.headers = headers or []
        self.note = note


def error_body(message: str, type: str, code: str | None, param: str | None = None) -> bytes:
    """Encode an OpenAI-shaped error document."""
    return msgspec.json.encode({"error": {"message": message, "type": type, "param": param, "code": code}})


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_ANTHROPIC_HEADERS = frozenset({b"anthropic-version", b"anthropic-beta"})
_CREDENTIALS = frozenset({b"authorization", b"x-api-key", b"api-key"})


def anthropic_error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status (its API's errors page): 429 ``rate_limit_error``, ..."""
    return _ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def speaks_anthropic(path: bytes, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request (raw ``path``, ASGI ``headers`` with lower-case names) is in Anthropic's dialect.

    As routing reads it (:func:`~tokenward.proxy.edge.request_dialect`): ``/v1/messages...`` or
    ``/v1/complete``, an ``anthropic-version``/``anthropic-beta`` header (the Anthropic SDK and
    Claude Code always send one), or ``x-api-key`` as the only credential.
    """
    tail = path.split(b"?", 1)[0].lower()
    if tail in (b"/v1/messages", b"/v1/complete") or tail.startswith(b"/v1/messages/"):
        return True
    credentials = [name for name, _ in headers if name in _CREDENTIALS]
    return any(name in _ANTHROPIC_HEADERS for name, _ in headers) or credentials == [b"x-api-key"]


def reply_error_body(
    path: bytes, headers: list[tuple[bytes, bytes]], status: int, message: str, type: str, code: str | None
) -> bytes:
    """The error document tokenward sends for one request: OpenAI's shape, and Anthropic's too for its dialect.

    Args:
        path: the request's raw path.
        headers: the request's ASGI headers.
        status: the reply's HTTP status (decides Anthropic's ``error.type``).
        message: what the client is told.
        type: OpenAI's error type, used outside Anthropic's dialect.
        code: tokenward's machine-readable code (``budget_exceeded``, ...), in both shapes.

    Returns:
        JSON bytes: ``{"error": {"message", "type", "param", "code"}}``, or for an Anthropic request
        ``{"type": "error", "error": {"type", "message", "param", "code"}}``.
    """
    if not speaks_anthropic(path, headers):
        return error_body(message, type, code)
    error = {"type": anthropic_error_type(status), "message": message, "param": None, "code": code}
    return msgspec.json.encode({"type": "error", "error": error})


def _proxy_error(_: Request, exc: ProxyError) -> Response[bytes]:
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in exc.headers}  # connection: close
    body = error_body(exc.message, exc.type, exc.code)
    return Response(body, status_code=exc.status, media_type="application/json", headers=headers)


def _http_error(_: Request, exc: HTTPException) -> Response[bytes]:
    status = exc.status_code
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
    return Response(error_body(str(exc.detail), kind, code), status_code=status, media_type="application/json")


def _unexpected(_: Request, exc: Exception) -> Response[bytes]:
    log.exception("unexpected error", exc_info=exc)
    body = error_body("tokenward failed to handle the request", "server_error", "proxy_error")
    return Response(body, status_code=500, media_type="application/json")


EXCEPTION_HANDLERS = {ProxyError: _proxy_error, HTTPException: _http_error, Exception: _unexpected}
"""Litestar app-level exception handlers: every error leaves in OpenAI's shape, never a traceback."""
