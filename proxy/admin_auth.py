"""Who may see the operator's views (the dashboard and its JSON API): one check, reusable by any endpoint.

An admin presents one of

* the admin token, read at start from the environment variable named by ``server.admin_token_env``;
* a virtual key whose ``role`` is ``admin``, from the config or created with ``tokenward keys
  create --role admin`` (in either auth mode), as long as it is not revoked: ``tokenward keys
  revoke`` ends its admin rights within 5 s, browser sessions it opened included;

as ``Authorization: Bearer <secret>`` or ``x-api-key: <secret>`` (``tokenward top``, curl), or
as the session cookie a browser gets from the dashboard's login form (:meth:`AdminAuth.login`).

With no admin credential configured: in ``passthrough`` mode only loopback clients are served
(the proxy's own machine; behind a reverse proxy on the same host every client looks local, so
configure a token there); in ``virtual_keys`` mode nobody is (the operator must name an admin).
A token variable that is named but unset refuses everyone rather than falling back to loopback.
Secrets are compared by sha256 digest in constant time; sessions live in memory (a restart logs
browsers out) and expire after ``SESSION_TTL_S``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from litestar import Request

from tokenward.proxy.config import Config
from tokenward.proxy.errors import ProxyError
from tokenward.proxy.keys import Authenticator, presented_key

__all__ = ["SESSION_COOKIE", "SESSION_TTL_S", "AdminAuth"]

log = logging.getLogger("tokenward.admin")

SESSION_COOKIE = "tokenward_admin"
"""Name of the dashboard's session cookie (``HttpOnly``, ``SameSite=Strict``, ``Path=/dashboard``)."""

SESSION_TTL_S = 12 * 3600
"""How long a browser session lasts (seconds)."""

_MAX_SESSIONS = 256


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class AdminAuth:
    """Decides whether a request comes from an admin.

    Args:
        config: the proxy's configuration (auth mode, ``server.admin_token_env``, virtual keys).
        environ: where the admin token is read from (default: the process environment).
        keys: the proxy's :class:`~tokenward.proxy.keys.Authenticator`, which knows the stored
            keys and the revoked ones (default: one made from ``config``, config keys only).
    """

    def __init__(
        self, config: Config, environ: Mapping[str, str] | None = None, keys: Authenticator | None = None
    ) -> None:
        environ = os.environ if environ is None else environ
        self.mode = config.auth.mode
        self.token_env = config.server.admin_token_env
        token = environ.get(self.token_env, "") if self.token_env else ""
        self._token = _digest(token) if token else None
        self._keys = keys if keys is not None else Authenticator(config.auth, config.virtual_keys)
        # revoking a configured admin key never turns the dashboard into "no credential: loopback is fine"
        self._configured_admins = any(k.role == "admin" for k in config.virtual_keys)
        # session id -> (who, expiry, the admin key's sha256: checked again on each use)
        self._sessions: OrderedDict[str, tuple[str, float, str | None]] = OrderedDict()

    @property
    def _admin_keys(self) -> bool:
        return self._configured_admins or self._keys.admins_stored

    @property
    def loopback_only(self) -> bool:
        """Whether no credential is configured and loopback clients are let in (passthrough mode)."""
        return self.mode == "passthrough" and not self.token_env and not self._admin_keys

    def identify(self, secret: str) -> str | None:
        """The admin behind ``secret`` (``admin-token`` or ``key:<name>``), or ``None``."""
        return self._identified(secret)[0]

    def _identified(self, secret: str) -> tuple[str | None, str | None]:
        digest = _digest(secret)
        if self._token is not None and hmac.compare_digest(digest, self._token):
            return "admin-token", None
        name = self._keys.admin_with_digest(digest.hex())  # a dict lookup by digest: no timing to learn from
        return (f"key:{name}", digest.hex()) if name is not None else (None, None)

    def login(self, secret: str, now: float | None = None) -> str | None:
        """A new session id for ``secret`` if it is an admin credential, else ``None``."""
        who, key_sha256 = self._identified(secret)
        if who is None:
            return None
        now = time.monotonic() if now is None else now
        session = secrets.token_urlsafe(32)
        self._sessions[session] = (who, now + SESSION_TTL_S, key_sha256)
        while len(self._sessions) > _MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return session

    def _session(self, session: str, now: float) -> str | None:
        entry = self._sessions.get(session)
        if entry is None:
            return None
        who, expiry, key_sha256 = entry
        if expiry <= now or (key_sha256 is not None and self._keys.admin_with_digest(key_sha256) is None):
            del self._sessions[session]  # expired, or its key was revoked (or lost its admin role)
            return None
        return who

    def check(self, request: Request[Any, Any, Any]) -> str:
        """Let an admin through: returns who it is (``admin-token``, ``key:<name>``, ``loopback``).

        Raises:
            ProxyError: 401 without a credential (``admin_required``) or with a wrong one
                (``invalid_admin_credential``); 403 for a live virtual key without the admin role
                (``admin_role_required``), for a client that is not local when only
                loopback clients are served, or when no admin credential is configured
                (``admin_not_configured``).
        """
        if self.loopback_only:
            host = request.client.host if request.client else ""
            if _is_loopback(host):
                return "loopback"
            raise ProxyError(
                403,
                "The dashboard is served only to the proxy's own machine: set server.admin_token_env "
                "(or give a virtual key role: admin) to open it to other hosts.",
                "admin_loopback_only",
                "permission_error",
            )
        if self.token_env and self._token is None and not self._admin_keys:
            raise ProxyError(
                403,
                f"The admin token variable {self.token_env} is not set.",
                "admin_not_configured",
                "permission_error",
            )
        if self._token is None and not self._admin_keys:
            raise ProxyError(
                403,
                "No admin credential is configured: set server.admin_token_env or give a virtual key role: admin.",
                "admin_not_configured",
                "permission_error",
            )
        secret = None
        for name in (b"authorization", b"x-api-key"):
            value = request.headers.get(name.decode())
            if value:
                secret = presented_key(name, value.encode("latin-1"))
                if secret:
                    break
        if secret is not None:
            who, _ = self._identified(secret)
            if who is not None:
                return who
            key = self._keys.key_with_digest(_digest(secret).hex())
            if key is not None:  # a real key, just not an admin one: authenticated, not allowed (403, not 401)
                raise ProxyError(
                    403,
                    f"The virtual key {key!r} is not an admin key: the dashboard and its API need "
                    "the admin token or a key with role: admin.",
                    "admin_role_required",
                    "permission_error",
                )
            raise ProxyError(
                401, "That is not an admin credential.", "invalid_admin_credential", "authentication_error"
            )
        session = request.cookies.get(SESSION_COOKIE)
        if session:
            who = self._session(session, time.monotonic())
            if who is not None:
                return who
        raise ProxyError(
            401,
            "Admin credential required: send 'Authorization: Bearer <admin token or admin key>', "
            "or log in at /dashboard.",
            "admin_required",
            "authentication_error",
        )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
