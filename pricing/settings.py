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

from tokenward.pricing.budgets import Budget, Period
from tokenward.pricing.catalog import PriceCatalog, load_catalog

__all__ = [
    "BudgetSettings",
    "GuardSettings",
    "PricingSettings",
    "RefreshSettings",
    "UnpricedPolicy",
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


class BudgetSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One ``budgets:`` entry of the configuration (see :class:`tokenward.pricing.budgets.Budget`).

    ``period``: ``day``, ``week``, ``month``, ``total`` or ``rolling`` (with ``rolling_hours``),
    aligned to the calendar in ``timezone``. ``notify``: email addresses and webhook names.
    """

    name: str
    limit_usd: Decimal
    scope: dict[str, str] = {}
    period: Literal["day", "week", "month", "total", "rolling"] = "month"
    timezone: str = "UTC"
    rolling_hours: float | None = None
    thresholds: list[int] = msgspec.field(default_factory=lambda: [50, 80, 100])
    action: Literal["alert", "block"] = "alert"
    notify: list[str] = []

    def to_budget(self) -> Budget:
        """The budget this entry describes.

        Raises:
            ValueError: an invalid limit, scope, zone or threshold (message names the budget).
        """
        try:  # a Decimal from the config file; from Python, also an int or a decimal string
            limit = self.limit_usd if isinstance(self.limit_usd, Decimal) else Decimal(str(self.limit_usd))
        except ArithmeticError:  # decimal.InvalidOperation and friends
            raise ValueError(f"budget {self.name!r}: limit_usd {self.limit_usd!r} is not an amount of USD") from None
        if limit.is_finite() and (limit.adjusted() > 15 or limit.as_tuple().exponent < -12):
            raise ValueError(f"budget {self.name!r}: limit_usd {self.limit_usd!r} is out of range ($1e-12 to $1e15)")
        return Budget(
            name=self.name,
            limit_usd=limit,
            scope=tuple(sorted(self.scope.items())),
            period=Period(self.period, self.timezone, self.rolling_hours),
            thresholds=tuple(sorted(set(self.thresholds))),
            action=self.action,
            notify=tuple(self.notify),
        )


class GuardSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How blocking budgets bound a request's cost before it is sent.

    ``default_max_output_tokens``: the output assumed when a request sets no ``max_tokens``
    (or ``max_completion_tokens`` / ``max_output_tokens``), and the output tokens assumed per
    generated image for image models whose price entry lists no ``image_output_tokens``.

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
    """

    default_max_output_tokens: Annotated[int, msgspec.Meta(gt=0)] = 16384
    input_margin: Annotated[float, msgspec.Meta(ge=1)] = 1.1
    input_margin_tokens: Annotated[int, msgspec.Meta(ge=0)] = 300
    foreign_tokenizer_margin: Annotated[float, msgspec.Meta(ge=1)] = 1.25
    image_tokens: Annotated[int, msgspec.Meta(ge=0)] = 3000
    unpriced_hold_usd: Decimal | None = None

    def __post_init__(self) -> None:
        if self.unpriced_hold_usd is not None and not self.unpriced_hold_usd > 0:
            raise ValueError("unpriced_hold_usd must be more than 0 USD - at `$.guard.unpriced_hold_usd`")
