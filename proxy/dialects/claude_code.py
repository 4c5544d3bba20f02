"""Who is calling, as Claude Code says it in an Anthropic request's ``metadata.user_id``.

Claude Code puts its identity in ``metadata.user_id`` in one of two forms (seen in gateways that
rewrite it for Claude Code, e.g. the ``ParseMetadataUserID`` parsers that accept both; the JSON
form is sent from Claude Code 2.1.78 on):

* JSON text: ``{"device_id": "<64 hex>", "account_uuid": "<uuid or empty>", "session_id": "<id>"}``;
* legacy: ``user_<64 hex>_account_<uuid or empty>_session_<uuid>``.

``account_uuid`` is the logged-in Claude account (empty for API-key users); ``device_id`` (the
legacy ``user_`` hash) identifies the installation; ``session_id`` changes with every Claude Code
session. Stored verbatim, every session would look like a new end user, so tokenward splits it:
the end user is the account (or, without one, the device) and the session is the session.
Anything else in ``metadata.user_id`` is an ordinary end-user id and is kept as sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = ["ClaudeCodeIdentity", "parse_user_id"]

_LEGACY = re.compile(r"^user_([0-9a-fA-F]{64})_account_([0-9a-fA-F-]*)_session_([0-9a-fA-F-]{36})$")
_MAX_LENGTH = 1024  # a Claude Code user_id is about 150 characters; longer text is not one


@dataclass(frozen=True, slots=True)
class ClaudeCodeIdentity:
    """The parts of a Claude Code ``metadata.user_id``: the end user (account, else device) and the session."""

    end_user: str
    session_id: str | None


def parse_user_id(value: Any) -> ClaudeCodeIdentity | None:
    """Read ``metadata.user_id``; ``None`` when it is not a string.

    Returns:
        The end user and session of a Claude Code ``user_id`` (either form above), or the string
        itself as the end user (no session) for any other client.
    """
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text.startswith("{") and len(text) <= _MAX_LENGTH:
        try:
            parsed = msgspec.json.decode(text)
        except msgspec.DecodeError:
            parsed = None
        if isinstance(parsed, dict):
            device, account, session = (parsed.get(k) for k in ("device_id", "account_uuid", "session_id"))
            user = account if isinstance(account, str) and account else device
            if isinstance(user, str) and user:
                return ClaudeCodeIdentity(user, session if isinstance(session, str) and session else None)
    match = _LEGACY.match(text)
    if match is not None:
        device, account, session = match.groups()
        return ClaudeCodeIdentity(account or device, session)
    return ClaudeCodeIdentity(value, None)
