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

from tokenward.reports.ledger.state import StateStore, StoredKey

__all__ = ["create_key", "list_keys", "revoke_key"]


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


def list_keys(state: StateStore) -> list[StoredKey]:
    """Every stored key, oldest first."""
    return state.keys()
