"""Provider dialects: each module maps one wire format's usage payloads onto ``Usage``.

A dialect module provides ``observe_body(data: bytes, seen: Observation) -> None`` (one JSON
reply or one stream event's data), ``to_usage(usage, tool_usage) -> Usage`` and
``provider_cost(usage) -> Decimal | None``. Nothing outside this package reads provider
field names.
"""

from __future__ import annotations

from types import ModuleType

from tokenward.proxy.dialects import openai
from tokenward.proxy.dialects.observation import Observation

__all__ = ["DIALECTS", "Observation"]

DIALECTS: dict[str, ModuleType] = {"openai": openai}
"""Dialect modules by name, as named in an endpoint's definition."""
