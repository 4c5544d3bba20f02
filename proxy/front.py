"""The ASGI entry point: requests for the API under ``/v1/`` go straight to the forwarder, the rest to Litestar.

Azure OpenAI's own paths (``/openai/deployments/...``, ``/openai/responses``,
:data:`~tokenward.proxy.edge.AZURE_PREFIX`) are the API too, and go to the forwarder the same way.

Why a front ahead of Litestar: for a ``/v1`` request, Litestar's routing, its ``Request``
object, its middleware stack and the send wrapper it puts around every message cost about
40 to 70 us of CPU per request (``bench/PROFILE.md``), as much as a third of what a bare relay
spends on the whole request; a streamed reply pays the send wrapper once per event. None of it
is needed there: the forwarder reads only the ASGI scope and ``receive``, routes on the raw path
itself (:func:`tokenward.proxy.edge.target`), catches its own errors and answers with a
:class:`~tokenward.proxy.relay.Relay`, which is an ASGI app. Litestar's ``api`` route calls the
very same :meth:`Forwarder.handle <tokenward.proxy.forward.Forwarder.handle>`, so a request
behaves the same whichever of the two serves it.

Litestar keeps everything else: lifespan, tokenward's own routes (``/healthz``, ``/metrics``,
``/dashboard``, ``/v1/tokenward/...``) and every path outside ``/v1/`` (the 404 in OpenAI's shape). A method
the API does not take (``TRACE``, ``PROPFIND``) under ``/v1/`` is the forwarder's recorded 405.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from litestar.types import ASGIApp, Receive, Scope, Send

from tokenward.proxy.edge import AZURE_PREFIX
from tokenward.proxy.errors import reply_error_body
from tokenward.proxy.forward import Forwarder

__all__ = ["API_METHODS", "SHUTTING_DOWN", "Front", "front"]

log = logging.getLogger("tokenward.proxy")

API_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""The methods Litestar's ``api`` route takes (``proxy/routes.py``); any other goes to Litestar."""

_OWN = b"/v1/tokenward/"
"""tokenward's own routes under ``/v1`` (``GET /v1/tokenward/budget``, ``proxy/budget_api.py``): Litestar's."""


SHUTTING_DOWN = (
    "tokenward shut down before the upstream's reply arrived (the stop's grace period, server.shutdown_grace_s, "
    "ran out); the provider may still bill this request."
)
"""What a request still waiting for its reply is told (503 ``shutting_down``) when the server cancels it."""


class _Request:
    """What the forwarder reads of a request: the ASGI ``scope`` and ``receive`` (a Litestar ``Request`` has both)."""

    __slots__ = ("receive", "scope")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive


class Front:
    """ASGI app: ``/v1/...`` to ``forwarder``, everything else (lifespan included) to ``app``.

    Args:
        app: the Litestar app (:func:`tokenward.proxy.app.create_app`).
        forwarder: its forwarder (``app.state.forwarder``).
    """

    __slots__ = ("app", "forwarder")

    def __init__(self, app: ASGIApp, forwarder: Forwarder) -> None:
        self.app = app
        self.forwarder = forwarder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI connection scope."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # type: ignore[arg-type]
            return
        raw: bytes = scope.get("raw_path") or scope["path"].encode()
        if not (raw.startswith(b"/v1/") or raw.startswith(AZURE_PREFIX)) or raw.startswith(_OWN):
            await self.app(scope, receive, send)  # type: ignore[arg-type]
            return
        try:
            if scope["method"] in API_METHODS:
                relay = await self.forwarder.handle(_Request(scope, receive))  # type: ignore[arg-type]
            else:  # TRACE, PROPFIND, ...: refused, and recorded like every other API request
                relay = self.forwarder.method_not_allowed(_Request(scope, receive))  # type: ignore[arg-type]
            await relay(scope, receive, send)
        except asyncio.CancelledError as exc:  # the stop's grace ran out: the row is recorded (interrupted)
            await _stopped(scope, send, exc)
        except Exception as exc:
            await _fail(scope, send, exc)

    @property
    def state(self) -> Any:
        """The Litestar app's state (``forwarder``, ``recorder``, ``config``, ...)."""
        return self.app.state  # type: ignore[attr-defined]


async def _fail(scope: Scope, send: Send, exc: Exception) -> None:
    """Answer a failure inside tokenward (a bug: the forwarder and relay catch what they expect) with a 500.

    As Litestar's exception handler would: in OpenAI's error shape (and Anthropic's, for a request in
    its dialect) when the reply has not started. When it has, the server refuses a second
    ``http.response.start`` (the ASGI spec's message order, which uvicorn enforces) and the original
    error goes on to the server, which closes the connection: a cut reply, as the client would see
    from a failing upstream.
    """
    log.error("unexpected error", exc_info=exc)
    await _answer(scope, send, exc, 500, "tokenward failed to handle the request", "proxy_error")


async def _stopped(scope: Scope, send: Send, exc: asyncio.CancelledError) -> None:
    """Answer a request the server cancelled at the end of its stop's grace period, if its reply has not started.

    uvicorn cancels the requests still in flight when ``server.shutdown_grace_s`` runs out, and
    would answer one that had no reply yet with its own plain-text 500. The forwarder has
    recorded its row by then (``interrupted``, the provider may bill it); the client gets 503
    ``shutting_down`` in its dialect (an SDK's retry reaches another replica, or this one once it
    is back), with ``connection: close``. A reply already started is cut, as before: the
    cancellation goes on to the server, which closes the connection.
    """
    await _answer(scope, send, exc, 503, SHUTTING_DOWN, "shutting_down", [(b"connection", b"close")])


async def _answer(
    scope: Scope,
    send: Send,
    exc: BaseException,
    status: int,
    message: str,
    code: str,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Send tokenward's own error reply in the request's dialect; re-raise ``exc`` when the reply had started."""
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    body = reply_error_body(raw_path, scope["headers"], status, message, "server_error", code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    try:
        await send({"type": "http.response.start", "status": status, "headers": headers})
    except Exception:
        raise exc from None
    await send({"type": "http.response.body", "body": body, "more_body": False})


def front(app: Any) -> Any:
    """``app`` behind a :class:`Front` when it is a tokenward app (it has ``state.forwarder``), else ``app``."""
    forwarder = getattr(getattr(app, "state", None), "forwarder", None)
    return Front(app, forwarder) if isinstance(forwarder, Forwarder) else app
