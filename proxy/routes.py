"""HTTP routes: the OpenAI surface under ``/v1`` and a health check.

Handlers are built per app around one :class:`~tokenward.proxy.forward.Forwarder`, so there
is no module-level state. Each ``/v1`` handler returns the forwarder's relay (an ASGI app).
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import HttpMethod, Request, Response, get, post, route
from litestar.handlers import BaseRouteHandler
from litestar.types import ASGIApp

from tokenward.proxy.forward import METERED_ENDPOINTS, Endpoint, Forwarder

__all__ = ["build_routes"]

_PASSTHROUGH_METHODS = [
    HttpMethod.GET,
    HttpMethod.POST,
    HttpMethod.PUT,
    HttpMethod.PATCH,
    HttpMethod.DELETE,
    HttpMethod.OPTIONS,
]


def build_routes(forwarder: Forwarder) -> list[BaseRouteHandler]:
    """Route handlers bound to ``forwarder``.

    One per metered endpoint (other methods on its path pass through), a ``/v1`` catch-all, a
    404 for everything else, ``/healthz`` and ``/metrics``.
    """
    handlers: list[BaseRouteHandler] = []
    for path, endpoint in METERED_ENDPOINTS.items():
        handlers.append(_metered_handler(forwarder, path, endpoint))
        handlers.append(_other_methods_handler(forwarder, path))

    @route(
        "/v1/{path:path}",
        http_method=_PASSTHROUGH_METHODS,
        name="passthrough",
        request_max_body_size=None,
        status_code=200,
    )
    async def passthrough(request: Request[Any, Any, Any]) -> ASGIApp:
        """Forward any other ``/v1`` request to the upstream unchanged (not metered)."""
        return await forwarder.passthrough(request)

    @route(
        ["/", "/v1", "/{path:path}"],
        http_method=_PASSTHROUGH_METHODS,
        name="not_found",
        request_max_body_size=None,
        status_code=200,
    )
    async def not_found(request: Request[Any, Any, Any]) -> ASGIApp:
        """Anything outside the API: a 404 in OpenAI's error shape (and, like every request, a row)."""
        return forwarder.not_found(request)

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

    handlers += [passthrough, not_found, healthz, metrics]
    return handlers


def _other_methods_handler(forwarder: Forwarder, path: str) -> BaseRouteHandler:
    async def handler(request: Request[Any, Any, Any]) -> ASGIApp:
        return await forwarder.passthrough(request)

    handler.__doc__ = f"Forward other methods on ``/v1/{path}`` (e.g. GET to list stored completions), unmetered."
    methods = [m for m in _PASSTHROUGH_METHODS if m not in (HttpMethod.POST, HttpMethod.OPTIONS)]
    # status_code only satisfies Litestar's check for DELETE; the relay sends the upstream's status
    return route(f"/v1/{path}", http_method=methods, name=f"{path}-other", request_max_body_size=None, status_code=200)(
        handler
    )


def _metered_handler(forwarder: Forwarder, path: str, endpoint: Endpoint) -> BaseRouteHandler:
    async def handler(request: Request[Any, Any, Any]) -> ASGIApp:
        return await forwarder.metered(request, endpoint)

    handler.__doc__ = f"Forward and meter ``POST /v1/{path}`` ({endpoint.name})."
    return post(f"/v1/{path}", name=endpoint.name, request_max_body_size=None)(handler)
