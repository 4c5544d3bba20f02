"""Errors tokenward itself answers with, in OpenAI's error shape.

Every refusal or failure that tokenward (not the upstream) reports is a
:class:`ProxyError`, rendered as ``{"error": {"message", "type", "code", "param"}}`` with the
matching HTTP status, both by :func:`error_reply` (inside the relay) and by the Litestar
exception handlers in :data:`EXCEPTION_HANDLERS` (anything raised in a route). Upstream error
replies are never rewritten: they reach the client exactly as the upstream sent them.
"""

from __future__ import annotations

import logging

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

__all__ = ["EXCEPTION_HANDLERS", "ProxyError", "error_body"]

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
