"""Provider dialects: each module maps one wire format's usage payloads onto ``Usage``.

A dialect module provides ``observe_body(data: bytes, seen: Observation) -> None`` (one JSON
reply or one stream event's data), ``finish(seen) -> Reading`` (canonical usage, usage spent on
other models, the provider's own cost), and ``request_texts`` / ``reply_texts`` for the token
estimator (``reply_texts`` gives ``(key, text, whole)`` triples: texts of one key are joined
across a stream before they are counted). Counts are read with
:func:`tokenward.pricing.usage.read_count`, so a value that is not a count is flagged, never
stored or raised. ``claude_code`` reads who is calling from Claude Code's ``metadata.user_id``.
Nothing outside this package reads provider field names.
"""

from __future__ import annotations

from types import ModuleType

from tokenward.proxy.dialects import anthropic, media, openai
from tokenward.proxy.dialects.observation import Observation, Reading

__all__ = ["DIALECTS", "Observation", "Reading"]

DIALECTS: dict[str, ModuleType] = {"openai": openai, "anthropic": anthropic, "media": media}
"""Dialect modules by name, as named in an endpoint's definition."""
