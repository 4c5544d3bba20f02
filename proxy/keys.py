"""Who is calling: virtual keys, or fingerprints of the client's own provider key.

Clients present a key the way their SDK does: ``Authorization: Bearer <key>`` (OpenAI SDKs),
``x-api-key`` (Anthropic SDKs) or ``api-key`` (Azure). In ``virtual_keys`` mode the key must
be one of the configured tokenward keys, compared by sha256 so that config files may hold only
hashes. In ``passthrough`` mode the key goes upstream untouched and usage is attributed to
``fp-`` plus the first 12 hex digits of its sha256; the key itself is never stored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from tokenward.proxy.config import VirtualKeyConfig
from tokenward.proxy.errors import ProxyError

__all__ = ["AUTH_HEADERS", "Authenticator", "Identity", "fingerprint", "key_id"]

AUTH_HEADERS = frozenset({b"authorization", b"x-api-key", b"api-key"})
"""Request headers that can carry a client's key (lower-case, as in ASGI scopes)."""


def fingerprint(key: str) -> str:
    """Short, non-reversible identifier of a provider key: ``fp-`` + 12 hex digits of its sha256."""
    return "fp-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def presented_key(name: bytes, value: bytes) -> str | None:
    """The key carried by one request header, or ``None`` if it is not an auth header with a key."""
    text = value.decode("latin-1").strip()
    if name == b"authorization":
        scheme, _, token = text.partition(" ")
        text = token.strip() if scheme.lower() == "bearer" else ""
    return text or None


def key_id(digest: str) -> str:
    """Stable id of a virtual key from its sha256 hex digest: ``vk-`` + 12 hex digits."""
    return "vk-" + digest[:12]


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is calling: principal, key id, team and project.

    ``principal`` is a virtual key's name or ``fp-...``; ``key_id`` the key's stable id
    (``vk-...`` or ``fp-...``; ``None`` without a key).
    """

    principal: str
    key_id: str | None = None
    team: str | None = None
    project: str | None = None


_ANONYMOUS = Identity("anonymous")


class Authenticator:
    """Turns a presented key into an :class:`Identity`.

    Args:
        mode: ``virtual_keys`` or ``passthrough``.
        keys: the configured virtual keys (used in ``virtual_keys`` mode).
    """

    def __init__(self, mode: str, keys: list[VirtualKeyConfig]) -> None:
        self.mode = mode
        digests = [
            (hashlib.sha256(k.key.encode()).hexdigest() if k.key is not None else (k.key_sha256 or "").lower(), k)
            for k in keys
        ]
        self._configured = {d: Identity(k.name, key_id(d), k.team, k.project) for d, k in digests}
        self._by_hash = dict(self._configured)

    def use_stored(
        self, stored: Iterable[tuple[str, str, str | None, str | None]], revoked: Iterable[str] = ()
    ) -> None:
        """Accept the keys created with ``tokenward keys`` too, and refuse revoked ones.

        ``stored`` holds ``(name, key_sha256, team, project)`` for each key not revoked; it replaces
        the stored keys known before. ``revoked`` holds the sha256 of revoked keys: a configured key
        among them is refused too (``tokenward keys revoke`` works on config keys, no restart).
        """
        by_hash = {
            digest.lower(): Identity(name, key_id(digest.lower()), team, project)
            for name, digest, team, project in stored
        }
        by_hash.update(self._configured)
        for digest in revoked:
            by_hash.pop(digest.lower(), None)
        self._by_hash = by_hash

    @property
    def passthrough(self) -> bool:
        """Whether client keys go upstream unchanged."""
        return self.mode == "passthrough"

    def identify(self, key: str | None) -> Identity:
        """Name the caller presenting ``key``.

        Raises:
            ProxyError: 401 in ``virtual_keys`` mode when the key is missing or unknown.
        """
        if self.passthrough:
            if not key:
                return _ANONYMOUS
            fp = fingerprint(key)
            return Identity(fp, fp)
        if key is None:
            raise ProxyError(
                401,
                "You didn't provide an API key. Send your tokenward virtual key as 'Authorization: Bearer <key>'.",
                "missing_api_key",
            )
        identity = self._by_hash.get(hashlib.sha256(key.encode()).hexdigest())
        if identity is None:
            shown = key[:4] + "***" + key[-4:] if len(key) > 12 else "***"
            raise ProxyError(
                401, f"Incorrect API key provided: {shown}. It is not a tokenward virtual key.", "invalid_api_key"
            )
        return identity
