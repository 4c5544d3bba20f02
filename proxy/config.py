"""tokenward's configuration: one YAML file read once at start, validated into typed sections.

See ``config.example.yaml`` for every option with its default. Relative paths in the file
(the ledger, extra price files) are resolved against the file's own directory.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import hashlib
import os
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import msgspec
import yaml

from tokenward.pricing.budgets import Budget
from tokenward.pricing.catalog import load_exact_yaml, yaml_problem
from tokenward.pricing.runs import RunPolicy, parse_duration
from tokenward.pricing.settings import BudgetSettings, GuardSettings, PricingSettings, UnpricedPolicy
from tokenward.proxy.config_errors import explain, line_of
from tokenward.proxy.edge import FREE_ENDPOINTS, UnmeteredPolicy, parse_base
from tokenward.reports.alerts import AlertSettings
from tokenward.reports.ledger import Ledger
from tokenward.reports.ledger.factory import open_ledger_for, pick_url

__all__ = [
    "AttributionRule",
    "AttributionSettings",
    "AuthConfig",
    "Config",
    "ConfigError",
    "LedgerConfig",
    "RunSettings",
    "ServerConfig",
    "UpstreamConfig",
    "VirtualKeyConfig",
    "config_from_args",
    "load_config",
]


class ConfigError(ValueError):
    """The configuration is invalid; the message names the file and the offending field."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ServerConfig(_Section):
    """Where the proxy listens, and how long it reads on after a client leaves mid-stream.

    ``drain_after_disconnect_s``: when a client hangs up during a streamed reply, the provider
    still bills what it generates; tokenward keeps reading the upstream (without sending) for up
    to this many seconds so the usage report is recorded. 0 closes the upstream at once.
    ``shutdown_grace_s``: how long a stop (SIGTERM, Ctrl-C) waits for requests in flight; then
    streams are cut and requests still waiting for the upstream get 503 ``shutting_down``, their
    rows ``interrupted`` (0 to 3600 s; keep it below the service manager's own stop timeout,
    systemd's ``TimeoutStopSec`` 90 s by default, which kills the process before the ledger is flushed).
    ``access_log``: one log line per request (``tokenward serve --no-access-log`` turns it off).

    Limits: ``max_body_mib`` for the metered endpoints' bodies (held in memory; 413 beyond),
    ``max_upload_mib`` for other bodies (streamed to the upstream); a body gets
    ``body_timeout_s`` plus one second per ``body_min_kib_s`` KiB received (408 beyond); a request
    head must arrive within ``header_timeout_s`` (408) and fit in ``max_header_kib`` (431); idle
    connections close after ``keep_alive_s``; beyond ``max_connections`` open connections
    requests get 503. ``metrics_token_env`` names the environment variable holding the bearer
    token ``/metrics`` requires. ``admin_token_env``: the environment variable holding the admin
    token that opens the dashboard (``proxy/admin_auth.py``).
    """

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 4000
    drain_after_disconnect_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    shutdown_grace_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 30.0
    access_log: bool = True
    # Limits (see proxy/limits.py and the README's "Limits" section); sizes in MiB/KiB, times in seconds.
    max_body_mib: Annotated[float, msgspec.Meta(gt=0)] = 32.0
    max_upload_mib: Annotated[float, msgspec.Meta(gt=0)] = 512.0
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    body_min_kib_s: Annotated[float, msgspec.Meta(ge=0)] = 64.0
    header_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    max_header_kib: Annotated[float, msgspec.Meta(gt=0)] = 64.0
    keep_alive_s: Annotated[float, msgspec.Meta(gt=0)] = 20.0
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 1000
    metrics_token_env: str | None = None
    admin_token_env: str | None = None


class LedgerConfig(_Section):
    """The ledger (a DuckDB file, or a Postgres database for several replicas), and how its rows get there.

    Every row is first made durable in the write-ahead log (``spool_dir``: ``<path>.spool/``
    beside a DuckDB file; ``tokenward.spool/`` beside the config for Postgres), before the client
    sees its reply end; every ``flush_interval_s`` seconds (> 0) the log is moved into the ledger
    (up to 5 s apart under load, when each move is costly). ``fsync``: also ``fsync`` the log at
    each write (survives power loss, not only a crash of the process; costs latency on every
    request). ``url``: a ``postgresql://`` URL puts the ledger, the state store and the budget
    books in Postgres, shared by every replica (the ``TOKENWARD_LEDGER_URL`` environment variable
    overrides it); ``path`` is then unused. ``lease_s``: Postgres only: a replica that stops
    renewing its lease for this long (killed, cut off) has its budget reservations counted as spend.
    """

    path: str = "tokenward.duckdb"
    url: str | None = None
    spool_dir: str | None = None
    flush_interval_s: float = 1.0
    fsync: bool = False
    lease_s: float = 15.0

    def __post_init__(self) -> None:
        if not self.flush_interval_s > 0:
            raise ValueError("flush_interval_s must be > 0 - at `$.ledger.flush_interval_s`")
        if self.url is not None and not self.url.startswith(("postgresql://", "postgres://")):
            raise ValueError("url must be a postgresql:// URL - at `$.ledger.url`")
        if not self.lease_s >= 3:
            raise ValueError("lease_s must be >= 3 - at `$.ledger.lease_s`")


class AttributionRule(_Section):
    """How one attribution field (``end_user``, ``tags`` or ``session``) is taken from a request.

    None of ``pinned``, ``allow``, ``prefix``: the client's value, as sent. ``pinned``: this value
    whatever the client sends (for ``tags``, a list). ``allow``: the client's value must be one of
    these (for ``tags``: every tag). ``prefix``: the client's value (every tag) must start with
    it. A value that breaks ``allow`` or ``prefix`` is refused with 403 ``attribution_refused``;
    ``required``: a request without a value is refused too. ``header``: take the value from this
    request header only (a chat frontend's ``X-OpenWebUI-User-Email``), not from the request's
    other sources; the header is not sent upstream. ``allow``/``prefix``/``required`` apply to it.
    """

    pinned: str | list[str] | None = None
    allow: list[str] | None = None
    prefix: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    required: bool = False
    header: Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")] | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.pinned, self.allow, self.prefix)) > 1:
            raise ValueError("give at most one of pinned, allow and prefix")
        if self.required and self.pinned is not None:
            raise ValueError("required means nothing with pinned (the pinned value is always there)")
        if self.header is not None and self.pinned is not None:
            raise ValueError("header means nothing with pinned (the pinned value is always used)")
        if self.header is not None and self.header.lower() in _RESERVED_HEADERS:
            raise ValueError(f"header {self.header!r} cannot carry attribution (tokenward or HTTP uses it)")


class AttributionSettings(_Section):
    """Attribution rules per field (``None``: take the client's value; per key: the global rule)."""

    end_user: AttributionRule | None = None
    tags: AttributionRule | None = None
    session: AttributionRule | None = None

    def __post_init__(self) -> None:
        for name in ("end_user", "session"):
            rule = getattr(self, name)
            if rule is not None and isinstance(rule.pinned, list):
                raise ValueError(f"{name}.pinned is one value, not a list")


_RESERVED_HEADERS = frozenset(
    {"authorization", "x-api-key", "api-key", "host", "content-length", "content-type", "transfer-encoding",
     "connection", "accept-encoding", "x-tokenward-upstream", "x-tokenward-run", "x-request-id"}
)  # fmt: skip


class RunSettings(_Section):
    """Run budgets (header ``X-Tokenward-Run: id=...; limit_usd=...; ttl=...``) a caller may set.

    ``mode``: ``allowed`` (a request may name a run), ``required`` (every metered request must:
    403 ``run_required`` otherwise) or ``forbidden`` (403 ``run_not_allowed``). A run's
    ``limit_usd`` may be at most ``max_limit_usd`` (403 ``run_limit_too_high``); without one in the
    header, ``default_limit_usd`` applies (none: 400). ``ttl``: ``default_ttl`` unless the header
    says, at most ``max_ttl`` (durations: ``90s``, ``15m``, ``1h``, ``2d``). At most
    ``max_active`` runs live at once per key (429 ``too_many_runs``).
    """

    mode: Literal["allowed", "required", "forbidden"] = "allowed"
    max_limit_usd: Decimal | None = None
    default_limit_usd: Decimal | None = None
    default_ttl: str | float = "1h"
    max_ttl: str | float = "24h"
    max_active: Annotated[int, msgspec.Meta(ge=1)] = 1000

    def __post_init__(self) -> None:
        for name in ("default_ttl", "max_ttl"):
            try:
                parse_duration(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        for name in ("max_limit_usd", "default_limit_usd"):
            amount = getattr(self, name)
            if amount is None:
                continue
            try:  # a Decimal from the config file; from Python, also an int or a decimal string
                amount = amount if isinstance(amount, Decimal) else Decimal(str(amount))
            except ArithmeticError:
                amount = Decimal("NaN")
            if not (amount.is_finite() and amount > 0):
                raise ValueError(f"{name} must be a positive amount of USD")
            setattr(self, name, amount)
        if parse_duration(self.default_ttl) > parse_duration(self.max_ttl):
            raise ValueError("default_ttl is longer than max_ttl")
        if self.max_limit_usd is not None and self.default_limit_usd is not None:
            if self.default_limit_usd > self.max_limit_usd:
                raise ValueError("default_limit_usd is above max_limit_usd")

    def policy(self, where: str) -> RunPolicy:
        """The :class:`~tokenward.pricing.runs.RunPolicy` these settings describe."""
        return RunPolicy(
            self.mode,
            self.max_limit_usd,
            self.default_limit_usd,
            parse_duration(self.default_ttl),
            parse_duration(self.max_ttl),
            self.max_active,
            where,
        )


def _check_unmetered(entries: list[str] | None) -> None:
    if entries is not None:
        UnmeteredPolicy(entries)  # raises ValueError naming the bad entry


class AuthConfig(_Section):
    """How clients authenticate, which unmetered endpoints they may use, and what they may claim.

    ``virtual_keys``: clients present a tokenward key from ``virtual_keys``; ``passthrough``: the
    client's own provider key goes upstream and usage is attributed to its fingerprint.
    ``allow_unmetered`` (``virtual_keys`` mode only): endpoints tokenward does not meter that may
    still pass, as ``[METHOD ]pattern`` globs over the path below ``/v1`` (see
    :class:`~tokenward.proxy.edge.UnmeteredPolicy`); everything else unmetered is refused with 403.
    Default: the free endpoints, :data:`~tokenward.proxy.edge.FREE_ENDPOINTS`. ``attribution``:
    the default rules for ``end_user``, ``tags`` and ``session`` (:class:`AttributionRule`).
    ``runs``: what callers may do with run budgets (:class:`RunSettings`; per key: ``runs``).
    ``shared_models`` (``virtual_keys`` mode): fine-tuned models (exact ``ft:...`` names) every key
    may run and see in ``GET models``, whichever key's job made them (one the operator trained
    for everyone); any other fine-tuned model is its job's key's.
    """

    mode: Literal["passthrough", "virtual_keys"] = "passthrough"
    allow_unmetered: list[str] = msgspec.field(default_factory=lambda: list(FREE_ENDPOINTS))
    attribution: AttributionSettings = msgspec.field(default_factory=AttributionSettings)
    runs: RunSettings = msgspec.field(default_factory=RunSettings)
    shared_models: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        _check_unmetered(self.allow_unmetered)


class VirtualKeyConfig(_Section):
    """A tokenward key: give ``key`` (the secret itself) or, better, ``key_sha256`` (its hex sha256).

    ``team`` and ``project`` attribute its usage (budgets and reports group by them). Keys can
    also be created with ``tokenward keys create`` (stored hashed in the ledger; they follow the
    global ``auth`` settings). ``allow_unmetered`` replaces ``auth.allow_unmetered`` for this key;
    each field of ``attribution`` set here replaces the global rule for that field.
    ``role: admin`` also opens the dashboard and ``/metrics``, and reaches every key's provider
    objects (files, batches, stored completions, ...); other keys reach only their own. ``org``
    and ``pool`` attribute it further (budgets scoped to ``org``, or to a ``pool`` several keys
    draw from); ``runs`` replaces ``auth.runs`` for this key. ``expires``: when the key stops
    working, a date (``2027-01-31``: midnight UTC) or an ISO date-time, UTC unless it has an
    offset (``2027-01-31T18:00:00+01:00``, ``...Z``); from then on it gets 401 ``key_expired``
    (as a virtual key and as an admin credential), like ``tokenward keys create --expires``.
    """

    name: Annotated[str, msgspec.Meta(min_length=1)]
    key: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    key_sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-fA-F]{64}$")] | None = None
    team: str | None = None
    project: str | None = None
    org: str | None = None
    pool: str | None = None
    allow_unmetered: list[str] | None = None
    attribution: AttributionSettings | None = None
    runs: RunSettings | None = None
    role: Literal["user", "admin"] = "user"
    expires: str | None = None

    def __post_init__(self) -> None:
        _check_unmetered(self.allow_unmetered)
        self.expires_at  # noqa: B018 - an expiry that is no date fails here, at load

    @property
    def expires_at(self) -> dt.datetime | None:
        """``expires`` as an aware datetime (a date: its midnight UTC; no offset: UTC); ``None``: never.

        Raises:
            ValueError: ``expires`` is not an ISO date or date-time.
        """
        if self.expires is None:
            return None
        try:
            when = dt.datetime.fromisoformat(self.expires.strip())
        except ValueError:
            raise ValueError(
                f"virtual key {self.name!r}: expires must be a date (2027-01-31) or an ISO date-time "
                f"(2027-01-31T18:00:00Z, or with an offset), got {self.expires!r}"
            ) from None
        return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


_USAGE_UNASKED = frozenset({"groq", "mistral"})


class UpstreamConfig(_Section):
    """One provider endpoint.

    ``base_url`` is the provider's OpenAI-style base (``https://api.openai.com/v1``), parsed once
    into scheme, host, port and path (no user, query or fragment); a client request to
    ``/v1/<path>`` goes to ``<base_url>/<path>``, built from those parts. ``models`` are glob
    patterns of the model names routed here; the ``default`` upstream (one per dialect) takes
    everything else. The API key is read
    from the environment variable ``api_key_env`` and sent as ``<api_key_header>:
    <api_key_prefix><key>``. ``provider`` names the price catalog's provider (default: ``name``).
    Timeouts are in seconds; ``read_timeout_s`` bounds each wait for reply bytes.
    ``stream_usage``: ``ask`` (OpenAI's behaviour: streams carry usage only when
    ``stream_options.include_usage`` is set, so tokenward sets it and hides what it added from
    clients that had not asked) or ``always`` (the upstream reports stream usage unasked:
    tokenward changes neither the request nor the stream). Default: ``always`` for providers seen to
    report usage unasked on the finishing chunk (``groq``, ``mistral``: recorded streams in
    ``shared/fixtures/recorded``), ``ask`` otherwise; under ``ask`` tokenward removes every usage
    member it made the upstream add, also from a chunk that carries choices.
    ``retries``: how many times tokenward itself retries a request whose body it holds, before any
    reply byte reached the client, when the connection fails or the upstream answers one of
    ``retry_statuses`` (backoff ``retry_backoff_s`` doubling, or the reply's ``Retry-After`` in seconds up to
    30 s). Off by default: client SDKs retry on their own. ``unpriced`` overrides the pricing
    section's policy for requests to a model with no price. ``dialect``: the API the upstream
    speaks, ``openai`` or ``anthropic`` (default: ``anthropic`` when the name, the provider or the
    base URL's host says so, else ``openai``); Anthropic requests (``/v1/messages...``, or any
    request with ``anthropic-version``) go to an Anthropic upstream when one is configured.
    ``price_as`` prices every request
    routed here as that catalog model, whatever model the reply names (an Azure deployment of a
    known base model); rows say ``price_resolved_by: price_as_upstream``.
    """

    name: str
    base_url: str
    api_key_env: str | None = None
    api_key_header: str = "authorization"
    api_key_prefix: str = "Bearer "
    provider: str | None = None
    models: list[str] = []
    default: bool = False
    connect_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    read_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    stream_usage: Literal["ask", "always"] | None = None
    unpriced: UnpricedPolicy | None = None
    price_as: str | None = None
    retries: Annotated[int, msgspec.Meta(ge=0, le=10)] = 0
    retry_statuses: list[Annotated[int, msgspec.Meta(ge=400, le=599)]] = msgspec.field(
        default_factory=lambda: [429, 500, 502, 503, 504]
    )
    retry_backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    dialect: Literal["openai", "anthropic"] | None = None

    @property
    def api_dialect(self) -> str:
        """The API dialect this upstream speaks (``dialect``, else inferred from name, provider, host)."""
        if self.dialect is not None:
            return self.dialect
        host = (urlsplit(self.base_url).hostname or "").lower()
        named = f"{self.name} {self.provider or ''}".lower()
        return "anthropic" if "anthropic" in named or host.endswith("anthropic.com") else "openai"

    @property
    def stream_usage_mode(self) -> str:
        """``stream_usage``, or its default for this upstream's provider (``always`` for groq, mistral)."""
        if self.stream_usage is not None:
            return self.stream_usage
        return "always" if self.catalog_provider in _USAGE_UNASKED else "ask"

    @property
    def catalog_provider(self) -> str:
        """Provider name used for price lookups."""
        return (self.provider or self.name).lower()

    def api_key(self) -> str | None:
        """The upstream API key from the environment, or ``None`` when unset."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def serves(self, model: str) -> bool:
        """Whether ``model`` matches one of this upstream's ``models`` patterns."""
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


class Config(_Section):
    """The whole configuration, one section per concern."""

    upstreams: list[UpstreamConfig]
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    ledger: LedgerConfig = msgspec.field(default_factory=LedgerConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    virtual_keys: list[VirtualKeyConfig] = []
    pricing: PricingSettings = msgspec.field(default_factory=PricingSettings)
    budgets: list[BudgetSettings] = []
    guard: GuardSettings = msgspec.field(default_factory=GuardSettings)
    alerts: AlertSettings = msgspec.field(default_factory=AlertSettings)

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ValueError("at least one upstream is required - at `$.upstreams`")
        names = [u.name for u in self.upstreams]
        for i, upstream in enumerate(self.upstreams):
            if names.count(upstream.name) > 1:
                raise ValueError(f"duplicate upstream name {upstream.name!r} - at `$.upstreams[{i}].name`")
            parts = urlsplit(upstream.base_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"base_url must be an http(s) URL - at `$.upstreams[{i}].base_url`")
            try:
                parse_base(upstream.base_url)
            except ValueError as exc:
                raise ValueError(f"{exc} - at `$.upstreams[{i}].base_url`") from exc
        for dialect in {u.api_dialect for u in self.upstreams}:
            if sum(u.default for u in self.upstreams if u.api_dialect == dialect) > 1:
                raise ValueError(f"at most one {dialect} upstream can be the default - at `$.upstreams`")
        key_names = [k.name for k in self.virtual_keys]
        key_digests: dict[str, str] = {}
        for i, key in enumerate(self.virtual_keys):
            if (key.key is None) == (key.key_sha256 is None):
                raise ValueError(f"give exactly one of key or key_sha256 - at `$.virtual_keys[{i}]`")
            if key_names.count(key.name) > 1:
                raise ValueError(f"duplicate key name {key.name!r} - at `$.virtual_keys[{i}].name`")
            digest = key.key_sha256.lower() if key.key_sha256 else hashlib.sha256(str(key.key).encode()).hexdigest()
            if digest in key_digests:  # one secret, two names: which one would the usage belong to?
                names = f"{key_digests[digest]!r} and {key.name!r}"
                raise ValueError(f"virtual keys {names} have the same key - at `$.virtual_keys[{i}]`")
            key_digests[digest] = key.name
        names = [b.name for b in self.budgets]
        seen: set[str] = set()
        for i, settings in enumerate(self.budgets):
            if names.count(settings.name) > 1:
                raise ValueError(f"duplicate budget name {settings.name!r} - at `$.budgets[{i}].name`")
            scoped = settings.scope.get("upstream")
            if scoped is not None and scoped not in {u.name for u in self.upstreams}:  # would match nothing
                configured = ", ".join(u.name for u in self.upstreams)
                raise ValueError(
                    f"budget {settings.name!r}: scope upstream {scoped!r} is not a configured upstream "
                    f"(configured: {configured}) - at `$.budgets[{i}].scope`"
                )
            try:
                expanded = settings.to_budgets()
            except ValueError as exc:
                raise ValueError(f"{exc} - at `$.budgets[{i}]`") from exc
            for budget in expanded:
                if budget.name in seen:
                    raise ValueError(f"duplicate budget name {budget.name!r} - at `$.budgets[{i}]`")
                seen.add(budget.name)
            self._check_targets(settings.notify, f"$.budgets[{i}].notify")
        self._check_targets(self.alerts.admins, "$.alerts.admins")
        if self.alerts.digest is not None:
            self._check_targets(self.alerts.digest.to, "$.alerts.digest.to")
        for i, upstream in enumerate(self.upstreams):
            if upstream.unpriced == "fallback" and not self.pricing.fallback:
                raise ValueError(f"unpriced: fallback needs pricing.fallback rates - at `$.upstreams[{i}].unpriced`")

    def _check_targets(self, targets: list[str], where: str) -> None:
        webhooks = {w.name for w in self.alerts.webhooks}
        for target in targets:
            if "@" in target:
                if self.alerts.smtp is None:
                    raise ValueError(f"mail to {target!r} needs an SMTP server (alerts.smtp) - at `{where}`")
            elif target not in webhooks:
                raise ValueError(
                    f"notify target {target!r} is neither an email address nor a webhook name - at `{where}`"
                )

    def budget_list(self) -> list[Budget]:
        """The configured budgets, one per window; templates (``per``) are :meth:`budget_templates`."""
        return [b for settings in self.budgets for b in settings.to_budgets() if b.per is None]

    def budget_templates(self) -> list[Budget]:
        """The configured templates: budgets made per value of a dimension (``per: end_user``)."""
        return [b for settings in self.budgets for b in settings.to_budgets() if b.per is not None]

    def unpriced_policy(self, upstream: UpstreamConfig) -> UnpricedPolicy:
        """The unpriced-model policy that applies to requests routed to ``upstream``."""
        return upstream.unpriced or self.pricing.unpriced

    def open_ledger(self) -> Ledger:
        """The ledger this configuration names (nothing is opened yet): Postgres with ``ledger.url``, else DuckDB."""
        return open_ledger_for(self.ledger.path, self.ledger.url, self.ledger.spool_dir)

    def refresh_file(self) -> str:
        """Where scheduled price refreshes append new versions (next to the ledger by default)."""
        refresh = self.pricing.refresh
        return refresh.file if refresh is not None and refresh.file else self.ledger.path + ".prices.yaml"


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file, resolving relative paths against its directory.

    Raises:
        ConfigError: the file is missing, not YAML, or fails validation (message names the field).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        document = load_exact_yaml(text, timestamps=False)  # money stays exact: no floats; times as written
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {yaml_problem(exc)}") from exc
    try:
        config = msgspec.convert(document or {}, Config)
    except (msgspec.ValidationError, ValueError) as exc:
        line = line_of(text, str(exc))  # `file:line:`, as compilers say it, so an editor can jump there
        raise ConfigError(f"{path}{f':{line}' if line else ''}: {explain(str(exc), Config)}") from exc
    base = path.resolve().parent
    config.ledger.path = str(base / config.ledger.path)
    config.ledger.url = pick_url(config.ledger.url)
    if config.ledger.spool_dir is not None:
        config.ledger.spool_dir = str(base / config.ledger.spool_dir)
    elif config.ledger.url is not None:
        config.ledger.spool_dir = str(base / "tokenward.spool")
    config.pricing.files = [str(base / f) for f in config.pricing.files]
    if config.pricing.refresh is not None and config.pricing.refresh.file is not None:
        config.pricing.refresh.file = str(base / config.pricing.refresh.file)
    return config


def config_from_args(
    upstream: str,
    *,
    auth: Literal["passthrough", "virtual_keys"] = "passthrough",
    db: str = "tokenward.duckdb",
    host: str = "127.0.0.1",
    port: int = 4000,
    provider: str | None = None,
) -> Config:
    """Build a one-upstream configuration for ``tokenward serve --upstream URL``.

    The upstream is named after ``provider`` (the price catalog provider) when given, else ``default``.

    Raises:
        ConfigError: the URL is not http(s), or ``virtual_keys`` was asked for (it needs keys
            from a config file).
    """
    if auth == "virtual_keys":
        raise ConfigError("--auth virtual_keys needs keys from a config file: use --config FILE")
    parts = urlsplit(upstream)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--upstream must be an http(s) URL such as https://api.openai.com/v1, got {upstream!r}")
    try:
        return Config(
            upstreams=[UpstreamConfig(name=provider or "default", base_url=upstream, default=True, provider=provider)],
            server=ServerConfig(host=host, port=port),
            ledger=LedgerConfig(path=db, url=pick_url(None)),
            auth=AuthConfig(mode=auth),
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
