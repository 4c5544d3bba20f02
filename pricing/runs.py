"""Run budgets: a cap an agent sets on one run (one task) with a request header, and the rules on it.

An agent sends, on every request of a run::

    X-Tokenward-Run: id=task-42; limit_usd=0.50; ttl=1h

The first request with a new ``id`` creates the run's budget: a blocking budget of
``limit_usd`` over the run's lifetime, in scope of the key's requests that name the run. It is
one more budget among those already in scope (key, team, pool, org...), so it can only narrow
what the request may spend: a run never widens anything. The run ends ``ttl`` after its first
request; a request naming an ended run is refused. A later request may lower the limit, never
raise it. Run ids are per key: another key naming the same id names another run.

What a key may do with runs is its :class:`RunPolicy` (``runs`` in the key's config, or
``auth.runs``): ``allowed`` (the default), ``required`` (every metered request must name a
run) or ``forbidden``, a ceiling on ``limit_usd`` and ``ttl``, and how many runs may be live at
once. Pure: parsing and checks only (the books are ``tokenward.proxy.run_budgets``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Literal

__all__ = ["RunHeader", "RunPolicy", "RunRefused", "parse_duration", "parse_run_header", "run_budget_name"]

_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str | float | int) -> float:
    """Seconds in ``30s``, ``15m``, ``1h``, ``2d``, ``1.5h`` or a plain number of seconds.

    Raises:
        ValueError: not a positive duration.
    """
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        match = _DURATION.fullmatch(str(text).strip().lower())
        if match is None:
            raise ValueError(f"{text!r} is not a duration (use e.g. 90s, 15m, 1h, 2d)")
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not 0 < seconds < 366 * 86400:
        raise ValueError(f"{text!r} is not a duration between 0 and 366 days")
    return seconds


@dataclass(frozen=True, slots=True)
class RunHeader:
    """What one ``X-Tokenward-Run`` header says: the run's id, and its cap and lifetime if given."""

    id: str
    limit_usd: Decimal | None = None
    ttl_s: float | None = None


class RunRefused(Exception):
    """A run header a caller may not send (or a malformed one): HTTP ``status`` and error ``code``."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def parse_run_header(value: str) -> RunHeader:
    """Parse ``id=...; limit_usd=0.50; ttl=1h`` (``;`` or ``,`` between parameters, any order).

    Raises:
        RunRefused: 400 ``invalid_run`` naming what is wrong (no id, an unknown or repeated
            parameter, a limit that is not a positive amount, a bad duration).
    """
    fields: dict[str, str] = {}
    for part in re.split(r"[;,]", value):
        if not part.strip():
            continue
        name, sep, raw = part.partition("=")
        name = name.strip().lower()
        if not sep or name not in ("id", "limit_usd", "ttl"):
            raise RunRefused(400, f"X-Tokenward-Run: {part.strip()!r} is not id=, limit_usd= or ttl=.", "invalid_run")
        if name in fields:
            raise RunRefused(400, f"X-Tokenward-Run gives {name} twice.", "invalid_run")
        fields[name] = raw.strip().strip('"')
    run_id = fields.get("id")
    if not run_id or _ID.fullmatch(run_id) is None:
        raise RunRefused(
            400,
            "X-Tokenward-Run needs id=<run id>: 1 to 128 characters of letters, digits and ._:@/+=-",
            "invalid_run",
        )
    limit = None
    if "limit_usd" in fields:
        try:
            limit = Decimal(fields["limit_usd"])
        except InvalidOperation:
            limit = None
        if limit is None or not limit.is_finite() or limit <= 0 or limit.adjusted() > 15:
            raise RunRefused(
                400, f"X-Tokenward-Run: limit_usd={fields['limit_usd']!r} is not a positive amount.", "invalid_run"
            )
    ttl = None
    if "ttl" in fields:
        try:
            ttl = parse_duration(fields["ttl"])
        except ValueError as exc:
            raise RunRefused(400, f"X-Tokenward-Run: ttl: {exc}.", "invalid_run") from None
    return RunHeader(run_id, limit, ttl)


def run_budget_name(key_id: str | None, run_id: str) -> str:
    """The run's budget name: ``run:<key id>:<run id>`` (key ids hold no ``:``, so names never collide)."""
    return f"run:{key_id or 'anonymous'}:{run_id}"


@dataclass(frozen=True, slots=True)
class RunPolicy:
    """What one caller may do with runs.

    Args:
        mode: ``allowed``, ``required`` (every metered request names a run) or ``forbidden``.
        max_limit_usd: the most one run may ask for (``None``: no ceiling).
        default_limit_usd: the cap of a run whose header gives none (``None``: the header must).
        default_ttl_s: a run's lifetime when its header gives none.
        max_ttl_s: the longest lifetime a header may ask for.
        max_active: runs this caller may have live at once.
        where: the config setting, for messages.
    """

    mode: Literal["allowed", "required", "forbidden"] = "allowed"
    max_limit_usd: Decimal | None = None
    default_limit_usd: Decimal | None = None
    default_ttl_s: float = 3600.0
    max_ttl_s: float = 86400.0
    max_active: int = 1000
    where: str = "auth.runs"

    def settle(self, header: RunHeader | None) -> RunHeader | None:
        """The run a request joins (limit and ttl filled in), or ``None`` for a request in no run.

        Raises:
            RunRefused: 403 ``run_required`` / ``run_not_allowed`` / ``run_limit_too_high`` /
                ``run_ttl_too_long``, 400 ``invalid_run`` for a run without a limit.
        """
        if header is None:
            if self.mode == "required":
                raise RunRefused(
                    403,
                    f"This key must name a run: send X-Tokenward-Run: id=<run id>; limit_usd=<cap> ({self.where}).",
                    "run_required",
                )
            return None
        if self.mode == "forbidden":
            raise RunRefused(
                403, f"This key may not set run budgets: drop X-Tokenward-Run ({self.where}).", "run_not_allowed"
            )
        limit = header.limit_usd if header.limit_usd is not None else self.default_limit_usd
        if limit is None:
            raise RunRefused(400, "X-Tokenward-Run needs limit_usd=<cap in USD>.", "invalid_run")
        if self.max_limit_usd is not None and limit > self.max_limit_usd:
            raise RunRefused(
                403,
                f"A run of this key may ask for at most ${format(self.max_limit_usd.normalize(), 'f')} "
                f"(limit_usd={format(limit.normalize(), 'f')}; {self.where}.max_limit_usd).",
                "run_limit_too_high",
            )
        ttl = header.ttl_s if header.ttl_s is not None else self.default_ttl_s
        if ttl > self.max_ttl_s:
            raise RunRefused(
                403,
                f"A run of this key may last at most {self.max_ttl_s:g} s ({self.where}.max_ttl).",
                "run_ttl_too_long",
            )
        return RunHeader(header.id, limit, ttl)
