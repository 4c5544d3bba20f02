"""HTTP routes: the OpenAI and Anthropic surface under ``/v1``, a health check and metrics.

Handlers are built per app around one :class:`~tokenward.proxy.forward.Forwarder`, so there
is no module-level state. Every path but tokenward's own goes to one handler, and the forwarder
routes it on the raw path it checked (:mod:`tokenward.proxy.edge`), never on the path Litestar
decoded: what is metered and what is sent are the same bytes. It returns the forwarder's relay
(an ASGI app).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from typing import Any

from litestar import HttpMethod, Request, Response, get, route
from litestar.handlers import BaseRouteHandler
from litestar.types import ASGIApp

from tokenward.proxy.config import Config
from tokenward.proxy.errors import ProxyError, error_body
from tokenward.proxy.forward import Forwarder
from tokenward.proxy.keys import AUTH_HEADERS, Authenticator, presented_key

__all__ = ["MetricsAccess", "build_routes"]

log = logging.getLogger("tokenward.proxy")

_METHODS = [
    HttpMethod.GET,
    HttpMethod.HEAD,
    HttpMethod.POST,
    HttpMethod.PUT,
    HttpMethod.PATCH,
    HttpMethod.DELETE,
    HttpMethod.OPTIONS,
]


def build_routes(forwarder: Forwarder, *, metrics_access: MetricsAccess | None = None) -> list[BaseRouteHandler]:
    """Route handlers bound to ``forwarder``: the API (every method, every other path), ``/healthz``, ``/metrics``.

    ``/metrics`` is open unless ``metrics_access`` says otherwise.
    """

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
    async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
        """Prometheus metrics (text exposition format), for the metrics token or an admin key when required."""
        refusal = metrics_access.refusal(request.scope["headers"]) if metrics_access is not None else None
        if refusal is not None:
            headers = {"www-authenticate": 'Bearer realm="tokenward metrics"'} if refusal.status == 401 else {}
            body = error_body(refusal.message, refusal.type, refusal.code)
            return Response(body, status_code=refusal.status, media_type="application/json", headers=headers)
        recorder = forwarder.recorder
        body = recorder.metrics.render(guard=forwarder.guard, health=await asyncio.to_thread(recorder.health))
        return Response(body, media_type="text/plain; version=0.0.4")  # Litestar adds "; charset=utf-8"

    return [api, healthz, metrics]


@dataclass(frozen=True, slots=True)
class MetricsAccess:
    """Who may read ``/metrics`` (spend by model): one check per scrape.

    Open when no token is configured and auth is ``passthrough`` (anyone who reaches the proxy
    can send it traffic already). Otherwise a caller needs the metrics token, the admin token
    (``server.admin_token_env``: it opens the dashboard, which shows the same spend) or a live
    admin key: one of the config or made with ``tokenward keys create --role admin``, not
    revoked (``keys`` knows both, reloaded every 5 s). Each is presented as
    ``Authorization: Bearer <secret>`` (or ``x-api-key``) and compared by sha256 digest.

    Args:
        open: no credential is required.
        token_sha256: digest of the metrics token; ``None`` when none is usable (not configured,
            or its variable unset: then no token can match, never an open door).
        admin_sha256: digests of admin keys, used only without ``keys``.
        admin_token_sha256: digest of the admin token, ``None`` when unset.
        keys: the proxy's authenticator: its live admin keys (stored ones included, revoked ones
            not) may read ``/metrics``.
    """

    open: bool
    token_sha256: bytes | None = None
    admin_sha256: frozenset[bytes] = frozenset()
    admin_token_sha256: bytes | None = None
    keys: Authenticator | None = None

    @classmethod
    def from_config(cls, config: Config, keys: Authenticator | None = None) -> MetricsAccess:
        """The access rule ``config`` sets (``server.metrics_token_env``, ``auth.mode``, admin token and keys).

        ``keys``: the running proxy's :class:`~tokenward.proxy.keys.Authenticator` (without it
        only the config's admin keys count, revocations unseen).
        """
        env = config.server.metrics_token_env
        token = os.environ.get(env, "") if env else ""
        admin_env = config.server.admin_token_env
        admin_token = os.environ.get(admin_env, "") if admin_env else ""
        admins = frozenset(
            hashlib.sha256(k.key.encode()).digest() if k.key is not None else bytes.fromhex(k.key_sha256 or "")
            for k in config.virtual_keys
            if getattr(k, "role", "user") == "admin"  # `role: admin` keys come with the admin views
        )
        return cls(
            env is None and config.auth.mode == "passthrough",
            _digest(token) if token else None,
            admins,
            _digest(admin_token) if admin_token else None,
            keys,
        )

    def refusal(self, headers: list[tuple[bytes, bytes]]) -> ProxyError | None:
        """Why a request with these headers may not read ``/metrics`` (``None``: it may)."""
        if self.open:
            return None
        presented = next((presented_key(name, value) for name, value in headers if name in AUTH_HEADERS), None)
        if presented:
            digest = _digest(presented)
            for token in (self.token_sha256, self.admin_token_sha256):
                if token is not None and hmac.compare_digest(digest, token):
                    return None
            if self.keys is not None:
                if self.keys.admin_with_digest(digest.hex()) is not None:  # a dict lookup by digest
                    return None
            elif any(hmac.compare_digest(digest, admin) for admin in self.admin_sha256):
                return None
        return ProxyError(
            401,
            "/metrics reveals spend: send the metrics token (server.metrics_token_env), the admin token "
            "or an admin key as 'Authorization: Bearer <secret>'.",
            "invalid_api_key",
            "authentication_error",
        )


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()
