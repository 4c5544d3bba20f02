"""HTTP routes: the OpenAI and Anthropic surface under ``/v1``, a health check and metrics.

Handlers are built per app around one :class:`~tokenward.proxy.forward.Forwarder`, so there
is no module-level state. Every path but tokenward's own goes to one handler, and the forwarder
routes it on the raw path it checked (:mod:`tokenward.proxy.edge`), never on the path Litestar
decoded: what is metered and what is sent are the same bytes. It returns the forwarder's relay
(an ASGI app).
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import HttpMethod, Request, Response, get, route
from litestar.handlers import BaseRouteHandler
from litestar.types import ASGIApp

from tokenward.proxy.forward import Forwarder

__all__ = ["build_routes"]

_METHODS = [
    HttpMethod.GET,
    HttpMethod.HEAD,
    HttpMethod.POST,
    HttpMethod.PUT,
    HttpMethod.PATCH,
    HttpMethod.DELETE,
    HttpMethod.OPTIONS,
]


def build_routes(forwarder: Forwarder) -> list[BaseRouteHandler]:
    """Route handlers bound to ``forwarder``: the API (every method, every other path), ``/healthz``, ``/metrics``."""

    # status_code only satisfies Litestar's checks; the relay sends the upstream's status
    @route(["/", "/{path:path}"], http_method=_METHODS, name="api", request_max_body_size=None, status_code=200)
    async def api(request: Request[Any, Any, Any]) -> ASGIApp:
        """Forward a request (metered or not), or refuse it: a 400 for a path that is not plain, a 404 outside /v1."""
        return await forwarder.handle(request)

    @get("/healthz", name="healthz")
    async def healthz() -> Response[dict[str, Any]]:
        """Health: 200 ``{"status": "ok", ...}``, or 503 ``"unavailable"`` when the ledger cannot be written.

        The body reports the ledger (``writable``, ``last_write_age_s``, ``problem``) and the
        backlog (``queued_rows`` in memory, ``spool_files`` and ``spool_rows`` on disk).
        """
        health = await asyncio.to_thread(forwarder.recorder.health)
        status = "ok" if health["writable"] else "unavailable"
        return Response({"status": status, **health}, status_code=200 if health["writable"] else 503)

    @get("/metrics", name="metrics")
    async def metrics() -> Response[bytes]:
        """Prometheus metrics (text exposition format)."""
        recorder = forwarder.recorder
        body = recorder.metrics.render(guard=forwarder.guard, health=await asyncio.to_thread(recorder.health))
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return [api, healthz, metrics]
