"""Checks made when ``tokenward serve`` starts, beyond what the config schema can say alone.

The schema (:mod:`tokenward.proxy.config`) checks the file; this module checks the file against
the process's environment, which the report commands do not need (they read the same file
without the proxy's secrets). Each environment variable a config names gets one decision:

* ``alerts.smtp.username_env`` / ``password_env`` unset: **fail**. The operator asked for
  authenticated mail; without the secret every alert mail would be refused (or sent
  unauthenticated), and the first sign of it would be a budget alert that never arrives.
* a webhook's ``url_env`` or ``secret_env`` unset: **fail** when a budget, ``alerts.admins`` or the digest sends
  to that webhook (alerts would be lost the same way); **warn** when nothing sends to it.
* an upstream's ``api_key_env`` unset: **warn** in ``virtual_keys`` mode, where tokenward sends
  that key. Other upstreams keep working and requests to this one are refused with an error
  naming the variable, so a config listing providers not yet in use still starts. In
  ``passthrough`` mode the client's own key goes upstream and the variable is not used: nothing
  to say.
* ``server.admin_token_env`` / ``metrics_token_env`` unset: **warn**: the dashboard (or
  ``/metrics``) then refuses everyone rather than falling back to an open door.

:func:`check_budgets` warns about budgets whose scope can match no request in the configured
auth mode, :func:`provider_notes` names upstreams whose ``provider`` has no prices, and
:func:`price_warnings` names models the config pins or scopes that the catalog cannot price.
Both ``tokenward serve`` and ``tokenward config check`` print these, so what one says the other
says.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Collection, Mapping

from tokenward.pricing.catalog import PriceCatalog
from tokenward.proxy.config import Config, ConfigError

__all__ = ["check_budgets", "check_environment", "price_warnings", "provider_notes"]


def check_environment(config: Config, environ: Mapping[str, str] | None = None) -> list[str]:
    """Check the environment variables ``config`` names (see the module docstring for the rules).

    Args:
        config: a validated configuration.
        environ: the environment (default: ``os.environ``); an empty value counts as unset.

    Returns:
        Warnings to log (the proxy starts anyway).

    Raises:
        ConfigError: a variable whose absence would lose alerts is unset (one line, naming the
            option and the variable).
    """
    env = os.environ if environ is None else environ
    warnings: list[str] = []
    smtp = config.alerts.smtp
    if smtp is not None:
        for option, variable in (("username_env", smtp.username_env), ("password_env", smtp.password_env)):
            if variable and not env.get(variable):
                raise ConfigError(
                    f"alerts.smtp.{option}: environment variable {variable} is not set "
                    "(alert mail could not log in to the SMTP server)"
                )
    used = set(config.alerts.admins)
    for budget in config.budgets:
        used.update(budget.notify)
    if config.alerts.digest is not None:
        used.update(config.alerts.digest.to)
    for index, hook in enumerate(config.alerts.webhooks):
        for option, variable in (("url_env", hook.url_env), ("secret_env", hook.secret_env)):
            if not variable or env.get(variable):
                continue
            where = f"alerts.webhooks[{index}].{option}"
            if hook.name in used:
                raise ConfigError(
                    f"{where}: environment variable {variable} is not set "
                    f"(alerts to webhook {hook.name!r} would be lost)"
                )
            warnings.append(f"{where}: environment variable {variable} is not set (nothing sends to {hook.name!r})")
    if config.auth.mode == "virtual_keys":
        for upstream in config.upstreams:
            variable = upstream.api_key_env
            if not (variable and env.get(variable)):
                missing = f"environment variable {variable} is not set" if variable else "no api_key_env"
                refused = "its requests will be refused (virtual_keys mode)"
                warnings.append(f"upstream {upstream.name}: {missing}; {refused}")
    for option, variable, what in (
        ("admin_token_env", config.server.admin_token_env, "the dashboard refuses everyone"),
        ("metrics_token_env", config.server.metrics_token_env, "/metrics refuses every token"),
    ):
        if variable and not env.get(variable):
            warnings.append(f"server.{option} names {variable}, which is not set: {what}")
    return warnings


_KEY_DIMENSIONS = ("team", "project", "org", "pool")  # facts of a virtual key's definition


def check_budgets(config: Config) -> list[str]:
    """Warnings for budgets that can never apply: a key fact (team, project, org, pool) in passthrough mode.

    In ``passthrough`` mode a request is attributed to a fingerprint of the client's key, which has
    no team, project, org or pool, so a budget scoped (or made ``per``) on one matches nothing and a
    ``block`` there refuses nothing. Not an error: the same file may serve reports on a ledger a
    ``virtual_keys`` proxy wrote.
    """
    if config.auth.mode != "passthrough":
        return []
    warnings = []
    for index, settings in enumerate(config.budgets):
        dimensions = [d for d in _KEY_DIMENSIONS if d in settings.scope or settings.per == d]
        if dimensions:
            warnings.append(
                f"budgets[{index}] {settings.name!r}: {' and '.join(dimensions)} "
                f"{'comes' if len(dimensions) == 1 else 'come'} from virtual keys, and "
                f"auth.mode is passthrough: this budget matches no request (set auth.mode: virtual_keys, "
                f"or scope it on key, end_user, model, upstream or tag)"
            )
    return warnings


def provider_notes(config: Config, providers: Collection[str]) -> list[str]:
    """One note per upstream whose catalog provider has no prices among ``providers`` (a close name suggested)."""
    notes = []
    for upstream in config.upstreams:
        provider = upstream.catalog_provider
        if provider in providers or (upstream.provider is None and upstream.name == "default"):
            continue  # the second: `serve --upstream URL` without --provider, priced by model name as asked
        close = difflib.get_close_matches(provider, sorted(providers), n=1, cutoff=0.75)
        hint = f" (did you mean provider: {close[0]}?)" if close else ""
        notes.append(
            f"upstream {upstream.name}: no prices for provider {provider!r} in the catalog{hint}; its models are "
            "priced by name (vendor/model prefix or the same model at another provider) or stay unpriced"
        )
    return notes


def price_warnings(config: Config, catalog: PriceCatalog) -> list[str]:
    """Models the config names that ``catalog`` cannot price (fallback rates aside).

    An upstream's ``price_as``, ``pricing.price_as`` and ``pricing.aliases`` targets (a pin naming
    an unknown model leaves every row it pins unpriced), and a budget's ``model`` scope (its
    requests carry no cost, so the budget counts nothing for them).
    """
    def unknown(model: str, provider: str | None = None) -> bool:
        return catalog.resolve(model, provider, fallback=False) is None

    names = sorted({entry.model for entry in catalog.entries.values()})

    def no_price(model: str) -> str:
        close = difflib.get_close_matches(model, names, n=1, cutoff=0.8)
        return f"no price for {model!r} in the catalog" + (f" (did you mean {close[0]!r}?)" if close else "")

    warnings = []
    for index, upstream in enumerate(config.upstreams):
        if upstream.price_as and unknown(upstream.price_as, upstream.catalog_provider):
            warnings.append(
                f"upstreams[{index}].price_as: {no_price(upstream.price_as)}; "
                f"every request to {upstream.name} will be unpriced"
            )
    for option, pins in (("pricing.price_as", config.pricing.price_as), ("pricing.aliases", config.pricing.aliases)):
        for name, model in pins.items():
            if unknown(model):
                warnings.append(f"{option}: {name} -> {model!r}: {no_price(model)}")
    for index, settings in enumerate(config.budgets):
        model = settings.scope.get("model")
        if model is not None and unknown(model):
            warnings.append(
                f"budgets[{index}] {settings.name!r}: scope model {model!r}: {no_price(model)}, "
                "so this budget counts no spend for it"
            )
    return warnings
