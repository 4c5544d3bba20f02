"""The ``pricing`` section of the configuration (shared by the proxy and the CLI).

::

    pricing:
      files: [prices/negotiated.yaml]    # loaded after the built-in catalog; later files win
      aliases: {prod-gpt4o: gpt-4o}      # served names (house aliases) -> catalog models
      price_as: {my-deployment: gpt-4o}  # requested names (Azure deployments) priced as a catalog model
      unpriced: allow                    # allow | block | fallback (an upstream may override it)
      fallback: {input: 5.0, output: 15.0}   # USD per 1M tokens, used by `unpriced: fallback`
      refresh:                           # optional: import price updates on a schedule
        url: https://example.com/model_prices_and_context_window.json
        every_hours: 24
        providers: [openai, anthropic]

``unpriced`` says what happens to a request for a model with no price: ``allow`` forwards it
and records it as unpriced (cost NULL, never $0, reported and alerted); ``block`` refuses it
before it reaches the provider (HTTP 400, ``model_not_priced``); ``fallback`` prices it at the
``fallback`` rates and marks the row so.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from tokenward.pricing.budgets import Budget, Degrade, Period
from tokenward.pricing.catalog import PriceCatalog, load_catalog
from tokenward.pricing.velocity import Velocity

__all__ = [
    "BudgetSettings",
    "DegradeSettings",
    "GuardSettings",
    "PricingSettings",
    "RefreshSettings",
    "UnpricedPolicy",
    "VelocitySettings",
    "WindowSettings",
    "build_catalog",
]

UnpricedPolicy = Literal["allow", "block", "fallback"]


class RefreshSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Scheduled price refresh: a LiteLLM-format price map fetched every ``every_hours`` hours.

    Changed prices become new versions effective from the refresh time, appended to ``file``
    (default: ``<ledger>.prices.yaml``); history is never edited. ``providers`` limits the
    import (tokenward provider names; empty: every provider the file maps).
    """

    url: str
    every_hours: float = 24.0
    providers: list[str] = []
    file: str | None = None


class PricingSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Extra price files, name aliases, price pins, the unpriced-model policy and its fallback rates.

    ``price_as`` pins a requested model name (an Azure deployment) to the catalog model it is
    priced as, even when the reply names another model; an upstream's own ``price_as`` pins every
    request routed there.
    """

    files: list[str] = []
    aliases: dict[str, str] = {}
    price_as: dict[str, str] = {}
    unpriced: UnpricedPolicy = "allow"
    fallback: dict[str, Any] | None = None
    refresh: RefreshSettings | None = None

    def __post_init__(self) -> None:
        if self.unpriced == "fallback" and not self.fallback:
            raise ValueError("unpriced: fallback needs fallback rates - at `$.pricing.fallback`")


def build_catalog(settings: PricingSettings, *, refresh_file: str | None = None) -> PriceCatalog:
    """The catalog a configuration describes: built-in prices, ``files``, then the refresh file.

    Raises:
        CatalogError: a price file or the fallback rates are invalid.
    """
    files = list(settings.files)
    if refresh_file is not None and Path(refresh_file).exists():
        files.append(refresh_file)
    fallback = None
    if settings.fallback:
        fallback = {k: Decimal(repr(v)) if isinstance(v, float) else v for k, v in settings.fallback.items()}
    return load_catalog(files, aliases=settings.aliases, fallback=fallback, price_as=settings.price_as)


class WindowSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One window of a budget with several (``budgets[].windows``): its own period, limit and thresholds.

    ``name`` labels the window (default: the period, or ``<rolling_hours>h``); the window's budget
    is named ``<budget>/<name>``. ``thresholds`` default to the budget's.
    """

    period: Literal["hour", "day", "week", "month", "total", "rolling"]
    limit_usd: Decimal
    rolling_hours: float | None = None
    thresholds: list[int] | None = None
    name: str | None = None


class DegradeSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a blocking budget does instead of refusing a request whose worst case does not fit.

    ``reroute``: requested model -> a cheaper model on the same upstream, tried first (the body's
    ``model`` is rewritten; the budget is checked at the cheaper model's prices). ``clamp_output``:
    lower the request's ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` to the
    most that fits, down to ``min_output_tokens`` (below that the request is refused). Either
    way the reply says so in ``x-tokenward-degraded`` and the row in ``degraded``.
    """

    reroute: dict[str, str] = {}
    clamp_output: bool = False
    min_output_tokens: Annotated[int, msgspec.Meta(ge=1)] = 1


class VelocitySettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Spend-rate alerts on a budget's scope (see :class:`tokenward.pricing.velocity.Velocity`).

    The spend of the last ``window_minutes`` as a rate (USD/hour) alerts once per episode when it
    is above ``max_usd_per_hour``, or above ``baseline_factor`` times the rate of the
    ``baseline_hours`` before (from ``min_usd_per_hour`` up); the alert re-arms once the rate is
    back under both.
    """

    window_minutes: Annotated[int, msgspec.Meta(ge=1, le=1440)] = 15
    max_usd_per_hour: Decimal | None = None
    baseline_factor: Decimal | None = None
    baseline_hours: Decimal = Decimal(24)
    min_usd_per_hour: Decimal = Decimal(0)

    def to_velocity(self) -> Velocity:
        """The rule. Raises ``ValueError`` for an invalid one."""
        return Velocity(
            window_minutes=self.window_minutes,
            max_usd_per_hour=_amount(self.max_usd_per_hour, "velocity.max_usd_per_hour"),
            baseline_factor=_amount(self.baseline_factor, "velocity.baseline_factor"),
            baseline_hours=_amount(self.baseline_hours, "velocity.baseline_hours") or Decimal(0),
            min_usd_per_hour=_amount(self.min_usd_per_hour, "velocity.min_usd_per_hour") or Decimal(0),
        )


def _amount(value: Any, what: str) -> Decimal | None:
    if value is None:
        return None
    try:  # a Decimal from the config file; from Python, also an int or a decimal string
        amount = value if isinstance(value, Decimal) else Decimal(str(value))
    except ArithmeticError:  # decimal.InvalidOperation and friends
        raise ValueError(f"{what} {value!r} is not a number") from None
    if not amount.is_finite():
        raise ValueError(f"{what} {value!r} is not a number")
    return amount


_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


class BudgetSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One ``budgets:`` entry of the configuration (see :class:`tokenward.pricing.budgets.Budget`).

    ``period``: ``hour``, ``day``, ``week``, ``month`` (the default), ``total`` or ``rolling``
    (with ``rolling_hours``), aligned to the calendar in ``timezone``; a week starts at local
    midnight of ``week_start`` (``monday``, as ISO 8601; ``sunday`` as in the US). ``notify``: email
    addresses and webhook names. Instead of ``limit_usd`` and ``period``, ``windows`` gives
    several at once (``$5/hour and $50/day``), each a budget of its own named ``<name>/<window>``.
    ``per``: one budget per value of that dimension (``end_user``: each user gets ``limit_usd``),
    made on first sight. ``degrade``: reroute or clamp instead of refusing (blocking budgets).
    ``velocity``: spend-rate alerts.
    """

    name: str
    limit_usd: Decimal | None = None
    scope: dict[str, str] = {}
    period: Literal["hour", "day", "week", "month", "total", "rolling"] | None = None
    timezone: str = "UTC"
    week_start: Literal["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"] = "monday"
    rolling_hours: float | None = None
    thresholds: list[int] = msgspec.field(default_factory=lambda: [50, 80, 100])
    action: Literal["alert", "block"] = "alert"
    notify: list[str] = []
    windows: list[WindowSettings] = []
    per: Literal["key", "team", "project", "end_user", "org", "pool"] | None = None
    degrade: DegradeSettings | None = None
    velocity: VelocitySettings | None = None

    def _limit(self, value: Any, where: str) -> Decimal:
        try:  # a Decimal from the config file; from Python, also an int or a decimal string
            limit = value if isinstance(value, Decimal) else Decimal(str(value))
        except ArithmeticError:  # decimal.InvalidOperation and friends
            raise ValueError(f"budget {self.name!r}: {where} {value!r} is not an amount of USD") from None
        if limit.is_finite() and (limit.adjusted() > 15 or limit.as_tuple().exponent < -12):
            raise ValueError(f"budget {self.name!r}: {where} {value!r} is out of range ($1e-12 to $1e15)")
        return limit

    def _week_start(self) -> int:
        return _WEEKDAYS.index(self.week_start)

    def to_budgets(self) -> list[Budget]:
        """The budgets this entry describes: one, or one per window (velocity rides on the first).

        Raises:
            ValueError: an invalid limit, scope, zone, threshold, window or rule (message names the budget).
        """
        if self.name.startswith("run:") or "[" in self.name or "]" in self.name:
            raise ValueError(f"budget {self.name!r}: names starting run: or holding [ ] are tokenward's own")
        degrade = None
        if self.degrade is not None:
            if self.action != "block":
                raise ValueError(f"budget {self.name!r}: degrade needs action: block")
            d = self.degrade
            if not d.reroute and not d.clamp_output:
                raise ValueError(f"budget {self.name!r}: degrade needs reroute or clamp_output")
            degrade = Degrade(tuple(sorted(d.reroute.items())), d.clamp_output, d.min_output_tokens)
        try:
            velocity = self.velocity.to_velocity() if self.velocity is not None else None
        except ValueError as exc:
            raise ValueError(f"budget {self.name!r}: {exc}") from None
        common: dict[str, Any] = {
            "scope": tuple(sorted(self.scope.items())),
            "action": self.action,
            "notify": tuple(self.notify),
            "per": self.per,
            "degrade": degrade,
        }
        if not self.windows:
            if self.limit_usd is None:
                raise ValueError(f"budget {self.name!r}: give limit_usd (or windows)")
            period = Period(self.period or "month", self.timezone, self.rolling_hours, self._week_start())
            limit = self._limit(self.limit_usd, "limit_usd")
            thresholds = tuple(sorted(set(self.thresholds)))
            return [Budget(self.name, limit, period=period, thresholds=thresholds, velocity=velocity, **common)]
        if self.limit_usd is not None or self.period is not None or self.rolling_hours is not None:
            raise ValueError(f"budget {self.name!r}: give windows or limit_usd and period, not both")
        budgets = []
        for i, window in enumerate(self.windows):
            label = window.name or (
                f"{window.rolling_hours:g}h" if window.period == "rolling" and window.rolling_hours else window.period
            )
            limit = self._limit(window.limit_usd, f"windows[{i}].limit_usd")
            period = Period(window.period, self.timezone, window.rolling_hours, self._week_start())
            thresholds = tuple(sorted(set(window.thresholds if window.thresholds is not None else self.thresholds)))
            budgets.append(
                Budget(
                    f"{self.name}/{label}",
                    limit,
                    period=period,
                    thresholds=thresholds,
                    group=self.name,
                    velocity=velocity if i == 0 else None,
                    **common,
                )
            )
        names = [b.name for b in budgets]
        if len(set(names)) < len(names):
            raise ValueError(f"budget {self.name!r}: two windows share a name (give each a name)")
        return budgets

    def to_budget(self) -> Budget:
        """The budget of an entry without windows (see :meth:`to_budgets`).

        Raises:
            ValueError: as :meth:`to_budgets`, or the entry has several windows.
        """
        budgets = self.to_budgets()
        if len(budgets) != 1:
            raise ValueError(f"budget {self.name!r} has {len(budgets)} windows: use to_budgets()")
        return budgets[0]


class GuardSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How blocking budgets bound a request's cost before it is sent.

    ``default_max_output_tokens``: the output assumed when a request sets no ``max_tokens``
    (or ``max_completion_tokens`` / ``max_output_tokens``), and the output tokens assumed per
    generated image for image models whose price entry lists no ``image_output_tokens``.
    ``set_output_limit``: so that this assumption is a bound, a chat, completions or Responses
    request under a blocking budget that sets no output limit is sent with one
    (``max_completion_tokens`` at OpenAI and Azure chat, ``max_output_tokens`` for Responses,
    else ``max_tokens``) equal to ``default_max_output_tokens``, and its reply says so in
    ``x-tokenward-output-limit``; ``false`` sends it unchanged, and a reply longer than the
    assumption is then spent past the limit.

    ``input_margin`` and ``input_margin_tokens``: input the provider bills that the request's
    text does not show (tool schemas as the provider renders them, response-format schemas,
    system prefixes): every model's counted input is multiplied by ``input_margin``, rounded up,
    and ``input_margin_tokens`` are added per request. Defaults from measurement: on the 192
    recorded OpenAI chat and Responses requests with function tools or none (no stored state, no
    media), OpenAI billed at most 279 tokens more than tiktoken counts (a Responses request with
    one tool: 56 counted, 335 billed), and never more than the count on requests of 500 tokens
    or more; 1.1 and 300 cover every one. ``foreign_tokenizer_margin``: models whose tokenizer is
    not OpenAI's are counted with o200k_base, and that count is multiplied by this as well.

    ``image_tokens``: input tokens assumed per image for models whose price entry gives no
    ``image_tokens_max`` (the built-in entries give it where the provider documents its image
    token formula: gpt-4o-mini bills up to 48,169 for one high-detail image).

    ``unpriced_hold_usd``: a request for a model with no price under a blocking budget cannot be
    bounded: it is refused (HTTP 400 ``model_not_priced``, naming the budget) unless this is set,
    in which case this amount (USD) is held for it and counted as its spend.

    ``bytes_bound_share``: a request is first bounded with its input taken as the UTF-8 size in
    bytes of the texts the tokenizer would count, without the tokenizer (every token is at least one
    byte of text; not the body's size, since tools are counted as their JSON re-encoded, which can be
    longer: ``1e15`` is ``1000000000000000.0``), and that bound is reserved when it is at most this share
    of what the tightest budget in scope has left; otherwise, and when that reservation is
    refused, the text is counted (30 to 47 us of CPU per KB, and the tokenizer's ~70 MB).
    ``0`` counts every request.

    ``max_tool_calls``: a Responses request under a blocking budget that offers provider-run tools
    billed per call (web search, file search, image generation, code interpreter) and sets no
    ``max_tool_calls`` is sent with this one, and an Anthropic server tool billed per use without
    ``max_uses`` with ``max_uses`` of this, so that its worst case (each kind of tool offered
    making that many calls, each at the price entry's fee) is a bound; ``0`` sends none and such a
    request is refused (400 ``tool_calls_unbounded``).
    """

    default_max_output_tokens: Annotated[int, msgspec.Meta(gt=0)] = 16384
    set_output_limit: bool = True
    input_margin: Annotated[float, msgspec.Meta(ge=1)] = 1.1
    input_margin_tokens: Annotated[int, msgspec.Meta(ge=0)] = 300
    foreign_tokenizer_margin: Annotated[float, msgspec.Meta(ge=1)] = 1.25
    image_tokens: Annotated[int, msgspec.Meta(ge=0)] = 3000
    unpriced_hold_usd: Decimal | None = None
    bytes_bound_share: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.01
    max_tool_calls: Annotated[int, msgspec.Meta(ge=0)] = 8

    def __post_init__(self) -> None:
        if self.unpriced_hold_usd is not None and not self.unpriced_hold_usd > 0:
            raise ValueError("unpriced_hold_usd must be more than 0 USD - at `$.guard.unpriced_hold_usd`")
