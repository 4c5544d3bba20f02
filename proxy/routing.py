"""Which upstream a request goes to.

In order: the upstream named by the ``x-tokenward-upstream`` request header; the first
upstream (in config order) whose ``models`` patterns match the requested model; the default
upstream; the only upstream when there is just one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenward.proxy.config import UpstreamConfig
from tokenward.proxy.errors import ProxyError
from tokenward.proxy.upstream import Timeouts

__all__ = ["Route", "Router"]

log = logging.getLogger("tokenward.proxy")


@dataclass(frozen=True, slots=True)
class Route:
    """An upstream prepared for forwarding: base URL without trailing slash, auth header, timeouts."""

    config: UpstreamConfig
    base_url: str
    auth_header: tuple[bytes, bytes] | None
    timeouts: Timeouts

    @property
    def name(self) -> str:
        """The upstream's configured name."""
        return self.config.name


class Router:
    """Picks the :class:`Route` for each request.

    Args:
        upstreams: the configured upstreams, in priority order.
        sends_own_keys: tokenward sends each upstream's own key (``virtual_keys`` mode); a
            missing key is then worth a warning at start.
    """

    def __init__(self, upstreams: list[UpstreamConfig], *, sends_own_keys: bool = False) -> None:
        self._routes = [_prepare(u, sends_own_keys) for u in upstreams]
        self._by_name = {route.name: route for route in self._routes}
        defaults = [r for r in self._routes if r.config.default]
        self._default = defaults[0] if defaults else (self._routes[0] if len(self._routes) == 1 else None)
        self._by_model: dict[str, Route | None] = {}

    @property
    def routes(self) -> list[Route]:
        """All routes, in config order."""
        return list(self._routes)

    def pick(self, model: str | None, explicit: str | None = None) -> Route:
        """Choose the upstream for a request for ``model``.

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
            if model not in self._by_model:
                match = next((r for r in self._routes if r.config.serves(model)), None)
                if len(self._by_model) < 10_000:
                    self._by_model[model] = match
            found = self._by_model.get(model)
            if found is not None:
                return found
        if self._default is None:
            raise ProxyError(400, f"No upstream is configured for model {model!r}.", "model_not_found")
        return self._default


def _prepare(config: UpstreamConfig, sends_own_keys: bool) -> Route:
    key = config.api_key()
    if sends_own_keys and key is None:
        missing = f"environment variable {config.api_key_env} is not set" if config.api_key_env else "no api_key_env"
        log.warning("upstream %s: %s; its requests will be refused (virtual_keys mode)", config.name, missing)
    header = (config.api_key_header.lower().encode(), (config.api_key_prefix + key).encode()) if key else None
    timeouts = Timeouts(connect=config.connect_timeout_s, read=config.read_timeout_s)
    return Route(config, config.base_url.rstrip("/"), header, timeouts)
