"""Virtual keys stored in the state store (``tokenward keys create/list/revoke``).

A key is shown once, when created; only its sha256 is stored. A running proxy reloads stored
keys and revocations every 5 seconds from the state store, which no reader of the ledger can
block: a created key works, and a revoked one (stored or from the config file) stops working,
without a restart.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from tokenward.reports.ledger.state import StateStore

__all__ = ["ConfigKey", "ListedKey", "create_key", "list_keys", "revoke_key"]


@dataclass(frozen=True, slots=True)
class ConfigKey:
    """A key of the config file's ``virtual_keys``, as ``keys list`` shows it (its sha256, never the key)."""

    name: str
    key_sha256: str
    team: str | None = None
    project: str | None = None
    role: str = "user"
    expires_at: dt.datetime | None = None


@dataclass(frozen=True, slots=True)
class ListedKey:
    """One line of ``tokenward keys list``: a stored key or a config key, and what it is now.

    ``source``: ``stored`` (``keys create``), ``config`` (the file's ``virtual_keys``) or
    ``config, removed`` (a config key revoked and no longer in the file: only its name and
    revocation are known). ``created_at`` is ``None`` for config keys.
    """

    name: str
    source: str
    team: str | None
    project: str | None
    role: str
    created_at: dt.datetime | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None

    def state(self, now: dt.datetime) -> str:
        """``live``, ``expired`` (its expiry is past: 401 ``key_expired``) or ``revoked 2026-12-02 15:47 UTC``."""
        if self.revoked_at is not None:
            return f"revoked {self.revoked_at.astimezone(dt.UTC):%Y-%m-%d %H:%M} UTC"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "live"


def create_key(
    state: StateStore,
    name: str,
    *,
    team: str | None,
    project: str | None,
    now: dt.datetime,
    role: str = "user",
    expires_at: dt.datetime | None = None,
) -> str:
    """Create a key named ``name`` and return it (the only time it is visible); ``expires_at``: when it stops working.

    Raises:
        ValueError: an empty name, a key (live or revoked) already has that name, or ``expires_at``
            is not after ``now``.
    """
    if not name.strip():
        raise ValueError("a key needs a name")
    if expires_at is not None and expires_at <= now:
        raise ValueError(f"the expiry {expires_at.isoformat(timespec='seconds')} has passed already")
    key = "tw-" + secrets.token_urlsafe(32)
    digest = hashlib.sha256(key.encode()).hexdigest()
    state.create_key(name, digest, team=team, project=project, role=role, now=now, expires_at=expires_at)
    return key


def revoke_key(state: StateStore, name: str, *, now: dt.datetime, configured: dict[str, str] | None = None) -> bool:
    """Revoke the stored key ``name``, or the config key ``name`` (``configured``: name -> sha256).

    Returns:
        False when there is no live key by that name.
    """
    if configured and name in configured:
        return state.revoke(name, configured[name], now)
    return state.revoke(name, None, now)


def list_keys(state: StateStore | None, configured: Sequence[ConfigKey] | None = None) -> list[ListedKey]:
    """Every key a proxy knows of: ``configured`` (the config file's, in order), then the stored ones, oldest first.

    A config key revoked with ``keys revoke NAME --config`` shows its revocation. Other revoked
    config keys are listed from their revocation record (name and time only): ``config, removed``
    when ``configured`` is given (the key has left the file), ``config`` when it is ``None`` (not
    known). ``state`` ``None``: no state store yet (nothing created or revoked): the config's keys only.
    """
    revocations = state.config_revocations() if state is not None else {}
    listed: list[ListedKey] = []
    seen: set[str] = set()
    for key in configured or ():
        digest = key.key_sha256.lower()
        seen.add(digest)
        revoked = revocations.get(digest)
        at = revoked[1] if revoked is not None else None
        listed.append(ListedKey(key.name, "config", key.team, key.project, key.role, None, key.expires_at, at))
    source = "config" if configured is None else "config, removed"
    for digest, (name, at) in sorted(revocations.items(), key=lambda item: item[1][1]):
        if digest not in seen:
            listed.append(ListedKey(name or "vk-" + digest[:12], source, None, None, "-", None, None, at))
    for stored in state.keys() if state is not None else ():
        listed.append(
            ListedKey(
                stored.name, "stored", stored.team, stored.project, stored.role,
                stored.created_at, stored.expires_at, stored.revoked_at,
            )
        )  # fmt: skip
    return listed
