"""Which upstream a request goes to.

In order: the upstream named by the ``x-tokenward-upstream`` request header; the first upstream
(in config order) that speaks the request's dialect and whose ``models`` patterns match the
requested model, then the first of any dialect whose patterns match; the dialect's default (its
upstream marked ``default``, or its only upstream); the default upstream; the only upstream when
there is just one. So in a mixed OpenAI + Anthropic config, ``/v1/messages/count_tokens`` and the
Anthropic SDK's ``/v1/models`` reach the Anthropic upstream although they name no model.

Azure OpenAI's own paths (``/openai/deployments/{name}/...``, ``/openai/responses``,
``/openai/v1/files``) go only to an Azure upstream (:meth:`Router.pick_azure`): there the
deployment, not the body, names what runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenward.proxy.config import UpstreamConfig
from tokenward.proxy.edge import Base, parse_base
from tokenward.proxy.errors import ProxyError
from tokenward.proxy.upstream import Timeouts

__all__ = ["Route", "Router"]

log = logging.getLogger("tokenward.proxy")


@dataclass(frozen=True, slots=True)
class Route:
    """An upstream prepared for forwarding: its parsed base URL, auth header, timeouts and dialect."""

    config: UpstreamConfig
    base: Base
    auth_header: tuple[bytes, bytes] | None
    timeouts: Timeouts
    dialect: str

    @property
    def name(self) -> str:
        """The upstream's configured name."""
        return self.config.name

    @property
    def azure(self) -> bool:
        """Whether this upstream is Azure OpenAI: ``provider: azure`` (or ``azure-openai``), or an Azure host."""
        return self.config.catalog_provider in _AZURE_PROVIDERS or self.base.host.endswith(_AZURE_HOSTS)


_AZURE_PROVIDERS = frozenset({"azure", "azure-openai", "azure_openai"})
_AZURE_HOSTS = (".openai.azure.com", ".cognitiveservices.azure.com", ".services.ai.azure.com")


class Router:
    """Picks the :class:`Route` for each request.

    Args:
        upstreams: the configured upstreams, in priority order (a missing ``api_key_env`` is
            warned about at start by :mod:`tokenward.proxy.preflight`).

    Raises:
        ValueError: an upstream's ``base_url`` cannot be parsed (:func:`~tokenward.proxy.edge.parse_base`).
    """

    def __init__(self, upstreams: list[UpstreamConfig]) -> None:
        self._routes = [_prepare(u) for u in upstreams]
        self._by_name = {route.name: route for route in self._routes}
        defaults = [r for r in self._routes if r.config.default]
        self._default = defaults[0] if defaults else (self._routes[0] if len(self._routes) == 1 else None)
        self._dialect_default: dict[str, Route] = {}
        for dialect in {r.dialect for r in self._routes}:
            speaking = [r for r in self._routes if r.dialect == dialect]
            marked = [r for r in speaking if r.config.default]
            if marked or len(speaking) == 1:
                self._dialect_default[dialect] = (marked or speaking)[0]
        self._by_model: dict[tuple[str, str], Route | None] = {}
        azure = [r for r in self._routes if r.azure]
        self._azure = next((r for r in azure if r.config.default), azure[0] if azure else None)

    @property
    def routes(self) -> list[Route]:
        """All routes, in config order."""
        return list(self._routes)

    def pick(self, model: str | None, explicit: str | None = None, dialect: str = "openai") -> Route:
        """Choose the upstream for a request for ``model`` in ``dialect`` (``openai`` or ``anthropic``).

        Raises:
            ProxyError: 400 when ``explicit`` names no upstream, or when nothing serves ``model``.
        """
        if explicit is not None:
            route = self._by_name.get(explicit)
            if route is None:
                names = ", ".join(sorted(self._by_name))
                raise ProxyError(
                    400,
                    f"Unknown upstream {explicit!r} in x-tokenward-upstream; configured: {names}.",
                    "unknown_upstream",
                )
            return route
        if model:
            key = (dialect, model)
            if key not in self._by_model:
                serving = [r for r in self._routes if r.config.serves(model)]
                match = next((r for r in serving if r.dialect == dialect), serving[0] if serving else None)
                if len(self._by_model) < 10_000:
                    self._by_model[key] = match
            else:
                match = self._by_model[key]
            if match is not None:
                return match
        found = self._dialect_default.get(dialect) or self._default
        if found is None:
            raise ProxyError(400, f"No upstream is configured for model {model!r}.", "model_not_found")
        return found

    def pick_azure(self, explicit: str | None = None, *, deployment: bool = True) -> Route:
        """The Azure upstream for a request on Azure OpenAI's own paths (``/openai/...``).

        ``explicit`` (``x-tokenward-upstream``) must name an Azure upstream; without it, the Azure
        upstream marked ``default``, else the first (config order). ``deployment`` says whether
        the path names a deployment (``/openai/deployments/...``), which only sets the 404's code.

        Raises:
            ProxyError: 400 ``unknown_upstream`` / ``not_an_azure_upstream`` for a bad ``explicit``;
                404 ``deployment_not_found`` (``not_found`` for a path without a deployment) when
                no Azure upstream is configured.
        """
        if explicit is not None:
            route = self.pick(None, explicit)
            if not route.azure:
                raise ProxyError(
                    400,
                    f"Upstream {explicit!r} is not Azure OpenAI (provider: azure): it has no /openai/ URLs.",
                    "not_an_azure_upstream",
                )
            return route
        if self._azure is None:
            raise ProxyError(
                404,
                "No Azure OpenAI upstream is configured (an upstream with provider: azure), so tokenward serves no "
                "/openai/ URLs (Azure's deployment and api-version paths). Use /v1/ with an OpenAI client, or add "
                "the Azure upstream.",
                "deployment_not_found" if deployment else "not_found",
            )
        return self._azure


def _prepare(config: UpstreamConfig) -> Route:
    key = config.api_key()
    header = (config.api_key_header.lower().encode(), (config.api_key_prefix + key).encode()) if key else None
    timeouts = Timeouts(connect=config.connect_timeout_s, read=config.read_timeout_s)
    return Route(config, parse_base(config.base_url), header, timeouts, config.api_dialect)
