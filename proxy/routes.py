"""HTTP routes: the OpenAI surface under ``/v1`` and a health check.

Handlers are built per app around one :class:`~tokenward.proxy.forward.Forwarder`, so there
is no module-level state. Each ``/v1`` handler returns the forwarder's relay (an ASGI app).
"""

from __future__ import annotations

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

    One per metered endpoint, a ``/v1`` catch-all, ``/healthz`` and ``/metrics``.
    """
    handlers: list[BaseRouteHandler] = [_metered_handler(forwarder, path, ep) for path, ep in METERED_ENDPOINTS.items()]

    @route("/v1/{path:path}", http_method=_PASSTHROUGH_METHODS, name="passthrough", request_max_body_size=None)
    async def passthrough(request: Request[Any, Any, Any]) -> ASGIApp:
        """Forward any other ``/v1`` request to the upstream unchanged (not metered)."""
        return await forwarder.passthrough(request)

    @get("/healthz", name="healthz")
    async def healthz() -> dict[str, str]:
        """Liveness check: ``{"status": "ok"}``."""
        return {"status": "ok"}

    @get("/metrics", name="metrics")
    async def metrics() -> Response[bytes]:
        """Prometheus metrics (text exposition format)."""
        body = forwarder.recorder.metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    handlers += [passthrough, healthz, metrics]
    return handlers


def _metered_handler(forwarder: Forwarder, path: str, endpoint: Endpoint) -> BaseRouteHandler:
    async def handler(request: Request[Any, Any, Any]) -> ASGIApp:
        return await forwarder.metered(request, endpoint)

    handler.__doc__ = f"Forward and meter ``POST /v1/{path}`` ({endpoint.name})."
    return post(f"/v1/{path}", name=endpoint.name, request_max_body_size=None)(handler)
