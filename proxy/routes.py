"""HTTP routes: the OpenAI surface under ``/v1`` and a health check.

Handlers are built per app around one :class:`~tokenward.proxy.forward.Forwarder`, so there
is no module-level state. Each ``/v1`` handler returns the forwarder's relay (an ASGI app).
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

from litestar import HttpMethod, Request, Response, get, post, route
from litestar.handlers import BaseRouteHandler
from litestar.types import ASGIApp

from tokenward.proxy.config import ServerConfig
from tokenward.proxy.errors import ProxyError, error_body
from tokenward.proxy.forward import METERED_ENDPOINTS, Endpoint, Forwarder
from tokenward.proxy.keys import AUTH_HEADERS, Authenticator, presented_key

__all__ = ["build_routes", "metrics_token"]

log = logging.getLogger("tokenward.proxy")

_PASSTHROUGH_METHODS = [
    HttpMethod.GET,
    HttpMethod.POST,
    HttpMethod.PUT,
    HttpMethod.PATCH,
    HttpMethod.DELETE,
    HttpMethod.OPTIONS,
]


def build_routes(forwarder: Forwarder, *, metrics_token: str | None = None) -> list[BaseRouteHandler]:
    """Route handlers bound to ``forwarder``.

    One per metered endpoint (other methods on its path pass through), a ``/v1`` catch-all, a
    404 for everything else, ``/healthz`` and ``/metrics``. ``metrics_token``: the bearer token
    ``/metrics`` requires (see :func:`metrics_token`; ``None``: none configured).
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
    async def healthz() -> dict[str, str]:
        """Liveness check: ``{"status": "ok"}``."""
        return {"status": "ok"}

    @get("/metrics", name="metrics")
    async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
        """Prometheus metrics (text exposition format), for the metrics token or an admin key when required."""
        refusal = _metrics_refusal(request.scope["headers"], forwarder.auth, metrics_token)
        if refusal is not None:
            headers = {"www-authenticate": 'Bearer realm="tokenward metrics"'} if refusal.status == 401 else {}
            body = error_body(refusal.message, refusal.type, refusal.code)
            return Response(body, status_code=refusal.status, media_type="application/json", headers=headers)
        body = forwarder.recorder.metrics.render()
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


def metrics_token(server: ServerConfig) -> str | None:
    """The bearer token ``/metrics`` requires: the value of ``server.metrics_token_env``.

    Returns ``None`` when no variable is configured, and ``""`` (no token can match) when the
    variable is configured but unset or empty, so a missing secret never opens ``/metrics``.
    """
    if server.metrics_token_env is None:
        return None
    token = os.environ.get(server.metrics_token_env, "")
    if not token:
        log.warning(
            "server.metrics_token_env names %s, which is unset: /metrics refuses every token", server.metrics_token_env
        )
    return token


def _metrics_refusal(headers: list[tuple[bytes, bytes]], auth: Authenticator, token: str | None) -> ProxyError | None:
    """Why ``/metrics`` is refused to a caller (``None``: it is allowed).

    Open when no token is configured and auth is ``passthrough`` (anyone reaching the proxy
    can already send it traffic); otherwise it takes the metrics token or, in ``virtual_keys``
    mode, a key with the ``admin`` role.
    """
    if token is None and auth.passthrough:
        return None
    presented = next((presented_key(name, value) for name, value in headers if name in AUTH_HEADERS), None)
    if presented and token and hmac.compare_digest(presented.encode(), token.encode()):
        return None
    hint = "send the metrics token (server.metrics_token_env) as 'Authorization: Bearer <token>'"
    if auth.passthrough or not presented:
        return ProxyError(401, f"/metrics reveals spend: {hint}.", "invalid_api_key", "authentication_error")
    try:
        identity = auth.identify(presented)
    except ProxyError:
        return ProxyError(
            401, f"/metrics reveals spend: {hint} or an admin key.", "invalid_api_key", "authentication_error"
        )
    if getattr(identity, "role", None) == "admin":  # key roles come with tenant isolation (issue 9.3)
        return None
    return ProxyError(
        403, f"This key may not read /metrics: {hint}, or use an admin key.", "permission_denied", "permission_error"
    )
