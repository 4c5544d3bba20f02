"""The errors every ledger engine raises, so callers never see a driver's own exceptions."""

from __future__ import annotations

__all__ = ["LedgerBusy", "LedgerError"]


class LedgerError(RuntimeError):
    """The ledger cannot be opened or written (missing file, outdated schema, corrupt data, server down)."""


class LedgerBusy(LedgerError):
    """Another process holds the ledger file for now; try again shortly (DuckDB's one-writer rule)."""
