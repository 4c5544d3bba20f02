"""What the one-time move of an earlier version's state copied (:class:`Imported`).

Its own module, without DuckDB: the mover child sends an :class:`Imported` back to the serving
process, which unpickles it, and a serving proxy never maps DuckDB (tests/test_crash_mover.py).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Imported"]


class Imported(NamedTuple):
    """What :func:`~tokenward.reports.ledger.legacy.import_legacy_state` copied, by kind (rows in the state store)."""

    keys: int = 0
    alert_claims: int = 0
    deliveries: int = 0

    @property
    def total(self) -> int:
        """Rows copied, every kind together."""
        return self.keys + self.alert_claims + self.deliveries

    def __str__(self) -> str:
        """``2 stored keys, 1 alert claim and 0 alert deliveries``: each kind with its own count."""
        parts = [
            _count(self.keys, "stored key", "stored keys"),
            _count(self.alert_claims, "alert claim", "alert claims"),
            _count(self.deliveries, "alert delivery", "alert deliveries"),
        ]
        return f"{parts[0]}, {parts[1]} and {parts[2]}"


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"
