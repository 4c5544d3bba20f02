"""Who is calling, what they may reach unmetered, and what they may claim about who spent it.

Clients present a key the way their SDK does: ``Authorization: Bearer <key>`` (OpenAI SDKs),
``x-api-key`` (Anthropic SDKs) or ``api-key`` (Azure), and exactly one of them (a request with
two is refused: the upstream would pick one and tokenward could attribute the other; in
passthrough mode Google's ``x-goog-api-key`` and ``?key=`` count too, and one key given in
several of these forms is one credential). In
``virtual_keys`` mode the key must be one of the configured tokenward keys, compared by sha256 so
that config files may hold only hashes. In ``passthrough`` mode the key goes upstream untouched
and usage is attributed to ``fp-`` plus the first 12 hex digits of the sha256 of the credential
the upstream checks (:func:`upstream_credential`); the key itself is never stored.

Each :class:`Identity` carries its key's :class:`~tokenward.proxy.edge.UnmeteredPolicy` and
:class:`Attribution` (``end_user``, ``tags``, ``session``: the client's word, pinned by the key,
or held to an allowlist or a prefix).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from tokenward.pricing.runs import RunPolicy
from tokenward.proxy.config import AttributionRule, AttributionSettings, AuthConfig, VirtualKeyConfig
from tokenward.proxy.edge import FREE_ENDPOINTS, UnmeteredPolicy
from tokenward.proxy.errors import ProxyError

__all__ = [
    "AUTH_HEADERS",
    "Attribution",
    "Authenticator",
    "Identity",
    "GOOGLE_KEY_HEADER",
    "KeyExpired",
    "Rule",
    "fingerprint",
    "key_id",
    "presented_key",
    "query_credentials",
    "upstream_credential",
]

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


def upstream_credential(name: bytes, value: bytes) -> str | None:
    """The secret an upstream checks in one credential header (passthrough mode's fingerprint input).

    A bearer token for ``Authorization: Bearer``, the whole value for any other scheme (the
    upstream sees it all), the value of ``x-api-key``/``api-key``; ``None`` for an empty header.
    """
    text = value.decode("latin-1").strip()
    if name == b"authorization":
        scheme, _, token = text.partition(" ")
        if scheme.lower() == "bearer":
            return token.strip() or None
    return text or None


GOOGLE_KEY_HEADER = b"x-goog-api-key"
"""Google's API key header (Gemini's SDKs), a credential beside :data:`AUTH_HEADERS` in passthrough mode."""
_QUERY_CREDENTIALS = frozenset({b"key", b"$key", b"access_token", b"oauth_token"})
"""Query parameters Google's front ends read a credential from (cloud.google.com/apis/docs/system-parameters)."""


def query_credentials(query: bytes) -> list[str]:
    """The credentials a raw query string carries (``key=``, ``access_token=``, ...), percent-decoded.

    Names are matched percent-decoded and in any case, split at ``&`` or ``;``, as
    :func:`~tokenward.proxy.edge.parameter_names` reads them; empty values are left out.
    """
    found: list[str] = []
    for part in re.split(rb"[&;]", query):
        name, _, value = part.partition(b"=")
        if unquote_to_bytes(name.replace(b"+", b" ")).lower() in _QUERY_CREDENTIALS:
            text = unquote_to_bytes(value.replace(b"+", b" ")).decode("latin-1").strip()
            if text:
                found.append(text)
    return found


def key_id(digest: str) -> str:
    """Stable id of a virtual key from its sha256 hex digest: ``vk-`` + 12 hex digits."""
    return "vk-" + digest[:12]


@dataclass(frozen=True, slots=True)
class Rule:
    """One field's attribution rule (see :class:`~tokenward.proxy.config.AttributionRule`).

    ``pinned`` replaces the client's value; ``allow``/``prefix`` bound it; ``required`` refuses a
    request without one; ``header`` (lower-case) is the only request header the value is read
    from. ``where`` names the config setting, for refusal messages.
    """

    field: str
    where: str
    pinned: tuple[str, ...] | None = None
    allow: frozenset[str] | None = None
    prefix: str | None = None
    required: bool = False
    header: bytes | None = None

    @classmethod
    def from_config(cls, field: str, where: str, rule: AttributionRule) -> Rule:
        """Build from a config rule; ``pinned`` becomes a tuple (one value, or the pinned tags)."""
        pinned = rule.pinned
        return cls(
            field,
            where,
            pinned=None if pinned is None else tuple([pinned] if isinstance(pinned, str) else pinned),
            allow=None if rule.allow is None else frozenset(rule.allow),
            prefix=rule.prefix,
            required=rule.required,
            header=rule.header.lower().encode("latin-1") if rule.header else None,
        )

    def check(self, values: tuple[str, ...]) -> tuple[str, ...]:
        """The values to record for the client's ``values``.

        Raises:
            ProxyError: 403 ``attribution_refused`` for a value outside ``allow``/``prefix``, or
                none under ``required``.
        """
        if self.pinned is not None:
            return self.pinned
        if not values:
            if self.required:
                raise ProxyError(
                    403,
                    f"This key must name its {self.field} ({_HOW[self.field]}): {self.where}.required is set.",
                    "attribution_refused",
                    "permission_error",
                )
            return values
        for value in values:
            if (self.allow is not None and value not in self.allow) or (
                self.prefix is not None and not value.startswith(self.prefix)
            ):
                rule = f"be one of {sorted(self.allow)}" if self.allow is not None else f"start with {self.prefix!r}"
                label = "tag" if self.field == "tags" else self.field
                raise ProxyError(
                    403,
                    f"{label} {value!r} is not allowed for this key: it must {rule} ({self.where}).",
                    "attribution_refused",
                    "permission_error",
                )
        return values


_HOW = {
    "end_user": "the request's user field, metadata.user_id or X-Tokenward-User",
    "tags": "X-Tokenward-Tags",
    "session": "X-Tokenward-Session",
}


@dataclass(frozen=True, slots=True)
class Attribution:
    """The attribution rules one caller is held to (``None``: the client's value as sent)."""

    end_user: Rule | None = None
    tags: Rule | None = None
    session: Rule | None = None

    @classmethod
    def from_settings(cls, *layers: tuple[str, AttributionSettings | None]) -> Attribution:
        """Merge settings, later layers winning per field; each layer is ``(config path, settings)``."""
        rules: dict[str, Rule | None] = {"end_user": None, "tags": None, "session": None}
        for where, settings in layers:
            if settings is None:
                continue
            for field in rules:
                rule = getattr(settings, field)
                if rule is not None:
                    rules[field] = Rule.from_config(field, f"{where}.{field}", rule)
        return cls(**rules)

    @property
    def open(self) -> bool:
        """Whether every field is the client's word (nothing to check)."""
        return self.end_user is None and self.tags is None and self.session is None

    @property
    def headers(self) -> frozenset[bytes]:
        """The request headers (lower-case) these rules read values from."""
        return frozenset(r.header for r in (self.end_user, self.tags, self.session) if r is not None and r.header)

    def settle(
        self,
        end_user: str | None,
        tags: tuple[str, ...],
        session: str | None,
        headers: Mapping[bytes, str] | None = None,
    ) -> tuple[str | None, tuple[str, ...], str | None]:
        """The ``(end_user, tags, session)`` to record for what the client claimed.

        ``headers``: the values of the request headers named by rules' ``header`` (lower-case
        names); a rule with a ``header`` takes its value from there only (tags: comma-separated).

        Raises:
            ProxyError: 403 ``attribution_refused`` (see :meth:`Rule.check`).
        """
        if headers is not None or any(r is not None and r.header for r in (self.end_user, self.tags, self.session)):
            given = headers or {}
            if self.end_user is not None and self.end_user.header is not None:
                end_user = given.get(self.end_user.header) or None
            if self.session is not None and self.session.header is not None:
                session = given.get(self.session.header) or None
            if self.tags is not None and self.tags.header is not None:
                text = given.get(self.tags.header) or ""
                tags = tuple(sorted({t.strip() for t in text.split(",") if t.strip()}))
        if self.end_user is not None:
            end_user = next(iter(self.end_user.check((end_user,) if end_user else ())), None)
        if self.tags is not None:
            tags = tuple(sorted(set(self.tags.check(tags))))
        if self.session is not None:
            session = next(iter(self.session.check((session,) if session else ())), None)
        return end_user, tags, session


_OPEN = Attribution()
_FREE = UnmeteredPolicy(FREE_ENDPOINTS)
_RUNS = RunPolicy()


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is calling: principal, key id, team and project, and the rules the caller is held to.

    ``principal`` is a virtual key's name or ``fp-...``; ``key_id`` the key's stable id
    (``vk-...`` or ``fp-...``; ``None`` without a key). ``unmetered`` says which unmetered
    endpoints the caller may use (``virtual_keys`` mode), ``unmetered_setting`` where that list is
    configured; ``attribution`` what the caller may claim; ``admin`` whether the key has
    ``role: admin`` (it reaches every key's provider objects); ``org`` and ``pool`` further
    attribution from the key; ``runs`` what it may do with run budgets.
    """

    principal: str
    key_id: str | None = None
    team: str | None = None
    project: str | None = None
    unmetered: UnmeteredPolicy = _FREE
    unmetered_setting: str = "auth.allow_unmetered"
    attribution: Attribution = _OPEN
    admin: bool = False
    org: str | None = None
    pool: str | None = None
    runs: RunPolicy = _RUNS
    expires_at: dt.datetime | None = None
    """When the key stops working (``keys create --expires`` or the config's ``expires``); ``None``: never."""


_ANONYMOUS = Identity("anonymous")


def _live(identity: Identity | None) -> Identity | None:
    """``identity`` unless its key has expired (an admin credential stops with it: dashboard, ``/metrics``)."""
    if identity is None or identity.expires_at is None or dt.datetime.now(dt.UTC) < identity.expires_at:
        return identity
    return None


class KeyExpired(ProxyError):
    """401 ``key_expired``; ``identity`` is the expired key's, so its refusal's row and log line name it."""

    def __init__(self, identity: Identity, status: int, message: str, code: str) -> None:
        super().__init__(status, message, code)
        self.identity = identity


class Authenticator:
    """Turns a presented key into an :class:`Identity`.

    Args:
        mode: ``virtual_keys`` or ``passthrough`` (or the whole ``auth`` section, whose
            ``allow_unmetered`` and ``attribution`` then apply to every caller without rules of
            its own).
        keys: the configured virtual keys (used in ``virtual_keys`` mode).
    """

    def __init__(self, mode: str | AuthConfig, keys: list[VirtualKeyConfig]) -> None:
        settings = mode if isinstance(mode, AuthConfig) else AuthConfig(mode=mode)  # type: ignore[arg-type]
        self.mode = settings.mode
        self.clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)
        """Now, for key expiry (on a Postgres ledger the app sets the database server's clock)."""
        unmetered = UnmeteredPolicy(settings.allow_unmetered)
        attribution = Attribution.from_settings(("auth.attribution", settings.attribution))
        runs = settings.runs.policy("auth.runs")
        self._default = Identity("anonymous", unmetered=unmetered, attribution=attribution, runs=runs)
        self._anonymous = self._default if self.mode == "passthrough" else _ANONYMOUS
        configured: dict[str, Identity] = {}
        for i, k in enumerate(keys):
            digest = hashlib.sha256(k.key.encode()).hexdigest() if k.key is not None else (k.key_sha256 or "").lower()
            setting = f"virtual_keys[{i}].allow_unmetered (key {k.name!r})"
            configured[digest] = Identity(
                k.name,
                key_id(digest),
                k.team,
                k.project,
                unmetered=UnmeteredPolicy(k.allow_unmetered) if k.allow_unmetered is not None else unmetered,
                unmetered_setting=setting if k.allow_unmetered is not None else "auth.allow_unmetered",
                attribution=Attribution.from_settings(
                    ("auth.attribution", settings.attribution), (f"virtual_keys[{i}].attribution", k.attribution)
                ),
                admin=k.role == "admin",
                org=k.org,
                pool=k.pool,
                runs=k.runs.policy(f"virtual_keys[{i}].runs") if k.runs is not None else runs,
                expires_at=k.expires_at,
            )
        self._configured = configured
        self._by_hash = dict(self._configured)
        self.admins_stored = False
        """Whether a stored key (``tokenward keys create --role admin``) is a live admin key."""
        self.attribution_headers: frozenset[bytes] = frozenset().union(
            attribution.headers, *(identity.attribution.headers for identity in configured.values())
        )
        """Every request header an attribution rule reads (lower-case); none of them goes upstream."""

    def use_stored(
        self,
        stored: Iterable[tuple[str, str, str | None, str | None] | tuple[str, str, str | None, str | None, str]],
        revoked: Iterable[str] = (),
    ) -> None:
        """Accept the keys created with ``tokenward keys`` too, and refuse revoked ones.

        ``stored`` holds ``(name, key_sha256, team, project[, role[, expires_at]])`` for each key not
        revoked (``role``: ``user``, the default, or ``admin``; ``expires_at``: a UTC datetime after
        which it gets 401 ``key_expired``); it replaces the stored keys known before.
        ``revoked`` holds the sha256 of revoked keys: a configured key among them is refused too
        (``tokenward keys revoke`` works on config keys, no restart), as a virtual key and as an
        admin credential (:meth:`admin_with_digest`).
        """
        default = self._default
        by_hash: dict[str, Identity] = {}
        for name, digest, team, project, *rest in stored:
            role, expires = (list(rest) + ["user", None])[:2]
            by_hash[digest.lower()] = Identity(
                name,
                key_id(digest.lower()),
                team,
                project,
                unmetered=default.unmetered,
                attribution=default.attribution,
                admin=role == "admin",
                runs=default.runs,
                expires_at=expires,
            )
        by_hash.update(self._configured)
        for digest in revoked:
            by_hash.pop(digest.lower(), None)
        self._by_hash = by_hash
        self.admins_stored = any(i.admin for digest, i in by_hash.items() if digest not in self._configured)

    def admin_with_digest(self, key_sha256: str) -> str | None:
        """The name of the live admin key whose sha256 (hex) is ``key_sha256``, else ``None``.

        A live admin key is configured or stored with ``role: admin``, not revoked and not past its
        expiry. Used for the dashboard and ``/metrics`` in either auth mode; never raises.
        """
        identity = _live(self._by_hash.get(key_sha256.lower()))
        return identity.principal if identity is not None and identity.admin else None

    def key_with_digest(self, key_sha256: str) -> str | None:
        """The name of the live virtual key (admin or not) whose sha256 (hex) is ``key_sha256``, else ``None``.

        Configured and stored keys, revoked and expired ones excluded; never raises.
        """
        identity = _live(self._by_hash.get(key_sha256.lower()))
        return identity.principal if identity is not None else None

    @property
    def passthrough(self) -> bool:
        """Whether client keys go upstream unchanged."""
        return self.mode == "passthrough"

    def identify(self, key: str | None) -> Identity:
        """Name the caller presenting ``key``.

        Raises:
            ProxyError: 401 in ``virtual_keys`` mode when the key is missing or unknown, or 401
                ``key_expired`` past the key's ``expires_at`` (stored or configured).
        """
        if self.passthrough:
            if not key:
                return self._anonymous
            fp = fingerprint(key)
            return Identity(fp, fp, attribution=self._default.attribution, runs=self._default.runs)
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
        if identity.expires_at is not None and self.clock() >= identity.expires_at:
            raise KeyExpired(
                identity,
                401,
                f"The tokenward virtual key {identity.principal!r} expired at "
                f"{identity.expires_at.isoformat(timespec='seconds')}: ask your admin for a new one.",
                "key_expired",
            )
        return identity
