"""HTTP routes: the OpenAI surface under ``/v1`` and a health check.

Handlers are built per app around one :class:`~tokenward.proxy.forward.Forwarder`, so there
is no module-level state. Each ``/v1`` handler returns the forwarder's relay (an ASGI app).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from typing import Any

from litestar import HttpMethod, Request, Response, get, post, route
from litestar.handlers import BaseRouteHandler
from litestar.types import ASGIApp

from tokenward.proxy.config import Config
from tokenward.proxy.errors import ProxyError, error_body
from tokenward.proxy.forward import METERED_ENDPOINTS, Endpoint, Forwarder
from tokenward.proxy.keys import AUTH_HEADERS, presented_key

__all__ = ["MetricsAccess", "build_routes"]

log = logging.getLogger("tokenward.proxy")

_PASSTHROUGH_METHODS = [
    HttpMethod.GET,
    HttpMethod.POST,
    HttpMethod.PUT,
    HttpMethod.PATCH,
    HttpMethod.DELETE,
    HttpMethod.OPTIONS,
]


def build_routes(forwarder: Forwarder, *, metrics_access: MetricsAccess | None = None) -> list[BaseRouteHandler]:
    """Route handlers bound to ``forwarder``.

    One per metered endpoint (other methods on its path pass through), a ``/v1`` catch-all, a
    404 for everything else, ``/healthz`` and ``/metrics`` (open unless ``metrics_access`` says otherwise).
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
        refusal = metrics_access.refusal(request.scope["headers"]) if metrics_access is not None else None
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


@dataclass(frozen=True, slots=True)
class MetricsAccess:
    """Who may read ``/metrics`` (spend by model): one check per scrape.

    Open when no token is configured and auth is ``passthrough`` (anyone who reaches the proxy
    can send it traffic already). Otherwise a caller needs the metrics token, or, with virtual
    keys, an admin key; both are presented as ``Authorization: Bearer <secret>`` (or
    ``x-api-key``) and compared by sha256 digest in constant time.

    Args:
        open: no credential is required.
        token_sha256: digest of the metrics token; ``None`` when none is usable (not configured,
            or its variable unset: then no token can match, never an open door).
        admin_sha256: digests of the virtual keys whose ``role`` is ``admin``.
    """

    open: bool
    token_sha256: bytes | None = None
    admin_sha256: frozenset[bytes] = frozenset()

    @classmethod
    def from_config(cls, config: Config) -> MetricsAccess:
        """The access rule ``config`` sets (``server.metrics_token_env``, ``auth.mode``, admin keys)."""
        env = config.server.metrics_token_env
        token = os.environ.get(env, "") if env else ""
        if env and not token:
            log.warning("server.metrics_token_env names %s, which is unset: /metrics refuses every token", env)
        admins = frozenset(
            hashlib.sha256(k.key.encode()).digest() if k.key is not None else bytes.fromhex(k.key_sha256 or "")
            for k in config.virtual_keys
            if getattr(k, "role", "user") == "admin"  # `role: admin` keys come with the admin views
        )
        return cls(env is None and config.auth.mode == "passthrough", _digest(token) if token else None, admins)

    def refusal(self, headers: list[tuple[bytes, bytes]]) -> ProxyError | None:
        """Why a request with these headers may not read ``/metrics`` (``None``: it may)."""
        if self.open:
            return None
        presented = next((presented_key(name, value) for name, value in headers if name in AUTH_HEADERS), None)
        if presented:
            digest = _digest(presented)
            if self.token_sha256 is not None and hmac.compare_digest(digest, self.token_sha256):
                return None
            if any(hmac.compare_digest(digest, admin) for admin in self.admin_sha256):
                return None
        return ProxyError(
            401,
            "/metrics reveals spend: send the metrics token (server.metrics_token_env) or an admin key "
            "as 'Authorization: Bearer <secret>'.",
            "invalid_api_key",
            "authentication_error",
        )


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()
