"""Which ledger a configuration names: a DuckDB file (the default) or a Postgres database.

A Postgres ledger is named by a ``postgresql://`` (or ``postgres://``) URL: ``ledger.url`` in
the config, the :data:`LEDGER_URL_ENV` environment variable (which wins over the config, so the
password can stay out of the file), or ``--db URL`` on the command line (which wins over both).
Otherwise ``ledger.path`` names a DuckDB file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from tokenward.reports.ledger.base import Ledger

__all__ = ["LEDGER_URL_ENV", "is_postgres_url", "open_ledger_for", "pick_url"]

LEDGER_URL_ENV = "TOKENWARD_LEDGER_URL"
"""Environment variable naming a Postgres ledger (overrides ``ledger.url`` and ``ledger.path``)."""


def is_postgres_url(text: str | None) -> bool:
    """Whether ``text`` is a Postgres connection URL."""
    return bool(text) and str(text).startswith(("postgresql://", "postgres://"))


def pick_url(url: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The Postgres URL in force: :data:`LEDGER_URL_ENV` when set, else ``url`` (``ledger.url``)."""
    environ = os.environ if environ is None else environ
    return environ.get(LEDGER_URL_ENV) or url or None


def open_ledger_for(
    path: str | Path | None = None, url: str | None = None, spool_dir: str | Path | None = None
) -> Ledger:
    """The ledger for these settings: Postgres when ``url`` is given, else the DuckDB file ``path``.

    Nothing is opened yet; the first use connects (and raises
    :class:`~tokenward.reports.ledger.LedgerError` if it cannot).

    Args:
        path: the DuckDB file (``ledger.path``).
        url: a ``postgresql://`` URL (``ledger.url`` or :data:`LEDGER_URL_ENV`, see :func:`pick_url`).
        spool_dir: the write-ahead log directory (``ledger.spool_dir``; default beside the file, or
            in the user's cache directory for a Postgres ledger).

    Raises:
        ValueError: ``url`` is not a Postgres URL, or neither is given.
    """
    if url:
        if not is_postgres_url(url):
            raise ValueError(f"ledger.url must be a postgresql:// URL, got {url.split('://')[0]}://...")
        from tokenward.reports.ledger.postgres import PgLedger

        return PgLedger(url, spool_dir)
    if path is None:
        raise ValueError("no ledger: give ledger.path or ledger.url")
    from tokenward.reports.ledger import DuckLedger

    return DuckLedger(path, spool_dir)
