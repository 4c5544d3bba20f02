"""Versioned schema migrations for the DuckDB ledger (the ``requests`` table and its history).

Each migration is a function ``mNNN_what(conn)`` registered with :func:`migration`, applied
once in registration order; applied names are kept in ``_migrations``. Never edit a migration
that has shipped: add a new one.
"""

from __future__ import annotations

from collections.abc import Callable

import duckdb

__all__ = ["MIGRATIONS", "migrate", "migration", "pending"]

Migration = Callable[[duckdb.DuckDBPyConnection], None]
MIGRATIONS: list[Migration] = []
"""Registered migrations, in the order they are applied."""


def migration(fn: Migration) -> Migration:
    """Register ``fn`` as the next migration."""
    MIGRATIONS.append(fn)
    return fn


def _applied(conn: duckdb.DuckDBPyConnection) -> set[str]:
    exists = conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = '_migrations'").fetchone()
    if not exists or not exists[0]:
        return set()
    return {row[0] for row in conn.execute("SELECT name FROM _migrations").fetchall()}


def pending(conn: duckdb.DuckDBPyConnection) -> list[str]:
    """Names of the migrations not yet applied to the database behind ``conn``."""
    done = _applied(conn)
    return [fn.__name__ for fn in MIGRATIONS if fn.__name__ not in done]


def migrate(conn: duckdb.DuckDBPyConnection) -> list[str]:
    """Apply every pending migration, each in its own transaction; returns the names applied."""
    conn.execute("CREATE TABLE IF NOT EXISTS _migrations (name VARCHAR PRIMARY KEY, applied_at TIMESTAMPTZ)")
    done = _applied(conn)
    applied = []
    for fn in MIGRATIONS:
        if fn.__name__ in done:
            continue
        conn.execute("BEGIN TRANSACTION")
        try:
            fn(conn)
            conn.execute("INSERT INTO _migrations VALUES (?, now())", [fn.__name__])
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        applied.append(fn.__name__)
    return applied


@migration
def m001_requests(conn: duckdb.DuckDBPyConnection) -> None:
    """The per-request ledger: one row per request that reached tokenward."""
    conn.execute(
        """
        CREATE TABLE requests (
            request_id            VARCHAR NOT NULL,
            client_request_id     VARCHAR,
            started_at            TIMESTAMPTZ NOT NULL,
            ended_at              TIMESTAMPTZ NOT NULL,
            principal             VARCHAR NOT NULL,
            method                VARCHAR NOT NULL,
            path                  VARCHAR NOT NULL,
            endpoint              VARCHAR NOT NULL,
            upstream              VARCHAR,
            provider              VARCHAR,
            requested_model       VARCHAR,
            served_model          VARCHAR,
            http_status           INTEGER,
            outcome               VARCHAR NOT NULL,
            stream                BOOLEAN NOT NULL,
            input_tokens          BIGINT NOT NULL,
            cached_input_tokens   BIGINT NOT NULL,
            cache_write_tokens    BIGINT NOT NULL,
            cache_write_1h_tokens BIGINT NOT NULL,
            output_tokens         BIGINT NOT NULL,
            reasoning_tokens      BIGINT NOT NULL,
            audio_input_tokens    BIGINT NOT NULL,
            audio_output_tokens   BIGINT NOT NULL,
            image_input_tokens    BIGINT NOT NULL,
            web_search_requests   BIGINT NOT NULL,
            usage_source          VARCHAR NOT NULL,
            cost_usd              DECIMAL(38, 12),
            price_status          VARCHAR NOT NULL,
            price_entry_id        VARCHAR,
            price_resolved_by     VARCHAR,
            cost_lines            JSON,
            provider_cost_usd     DECIMAL(38, 12),
            service_tier          VARCHAR,
            latency_ms            DOUBLE,
            ttfb_ms               DOUBLE,
            error                 VARCHAR,
            violations            VARCHAR,
            raw_usage             JSON
        )
        """
    )


@migration
def m002_row_kinds(conn: duckdb.DuckDBPyConnection) -> None:
    """Rows that belong to a request without being it: retried upstream attempts, other-model parts.

    ``row_kind`` is ``request`` (exactly one per request that reached tokenward), ``attempt``
    (an earlier upstream attempt of a retried request that the provider may have billed) or
    ``part`` (usage spent on another model inside the request, such as an Anthropic advisor);
    ``parent_request_id`` links attempts and parts to their request.
    """
    conn.execute("ALTER TABLE requests ADD COLUMN row_kind VARCHAR DEFAULT 'request'")
    conn.execute("ALTER TABLE requests ADD COLUMN parent_request_id VARCHAR")


@migration
def m003_attribution_budgets_alerts(conn: duckdb.DuckDBPyConnection) -> None:
    """Who spent it (key id, team, project, end user, tags, session), stored keys, and sent alerts.

    ``key_id`` is stable while a key's name may change: ``vk-`` (a virtual key) or ``fp-`` (a
    provider key in passthrough mode) plus 12 hex digits of the key's sha256.

    ``virtual_keys`` holds keys created with ``tokenward keys create`` (sha256 only, never the
    key). ``budget_alerts`` holds one claim per (budget, period start, kind, threshold): the row
    that wins the insert is the only one ever sent, so restarts and replicas do not resend
    (field case B37). ``alert_deliveries`` logs every delivery attempt per channel.
    """
    for column, kind in (
        ("key_id", "VARCHAR"),
        ("team", "VARCHAR"),
        ("project", "VARCHAR"),
        ("end_user", "VARCHAR"),
        ("tags", "VARCHAR[]"),
        ("session_id", "VARCHAR"),
    ):
        conn.execute(f"ALTER TABLE requests ADD COLUMN {column} {kind}")
    conn.execute(
        """
        CREATE TABLE virtual_keys (
            name        VARCHAR PRIMARY KEY,
            key_sha256  VARCHAR NOT NULL UNIQUE,
            team        VARCHAR,
            project     VARCHAR,
            created_at  TIMESTAMPTZ NOT NULL,
            revoked_at  TIMESTAMPTZ
        )
        """
    )
    conn.execute(
        """
        CREATE TABLE budget_alerts (
            budget        VARCHAR NOT NULL,
            period_start  TIMESTAMPTZ NOT NULL,
            kind          VARCHAR NOT NULL,
            threshold     INTEGER NOT NULL,
            created_at    TIMESTAMPTZ NOT NULL,
            status        VARCHAR NOT NULL,
            attempts      INTEGER NOT NULL DEFAULT 0,
            last_error    VARCHAR,
            detail        JSON,
            PRIMARY KEY (budget, period_start, kind, threshold)
        )
        """
    )
    conn.execute(
        """
        CREATE TABLE alert_deliveries (
            budget        VARCHAR NOT NULL,
            period_start  TIMESTAMPTZ NOT NULL,
            kind          VARCHAR NOT NULL,
            threshold     INTEGER NOT NULL,
            channel       VARCHAR NOT NULL,
            target        VARCHAR NOT NULL,
            attempted_at  TIMESTAMPTZ NOT NULL,
            ok            BOOLEAN NOT NULL,
            attempts      INTEGER NOT NULL,
            error         VARCHAR
        )
        """
    )


@migration
def m004_cost_breakdown(conn: duckdb.DuckDBPyConnection) -> None:
    """Per-row output cost and cache savings (USD), for reports' output share and cache savings.

    ``output_cost_usd``: the output line items (text, reasoning, audio output);
    ``cache_savings_usd``: cached input tokens x (input rate - cached input rate) / 1M, at the
    rates that applied to the row. Both are NULL where the cost is. Rows written before this
    migration get ``output_cost_usd`` from their stored ``cost_lines``; ``tokenward pricing
    reprice`` fills in their ``cache_savings_usd``.
    """
    conn.execute("ALTER TABLE requests ADD COLUMN output_cost_usd DECIMAL(38, 12)")
    conn.execute("ALTER TABLE requests ADD COLUMN cache_savings_usd DECIMAL(38, 12)")
    conn.execute(
        """
        UPDATE requests SET output_cost_usd = (
            SELECT coalesce(sum(CAST(line ->> 'amount' AS DECIMAL(38, 12))), 0)
            FROM (SELECT unnest(CAST(cost_lines AS JSON[])) AS line)
            WHERE line ->> 'component' IN ('output', 'reasoning', 'audio_output')
        )
        WHERE cost_usd IS NOT NULL AND cost_lines IS NOT NULL
        """
    )


@migration
def m005_reserved(conn: duckdb.DuckDBPyConnection) -> None:
    """What a blocking budget held for each request (USD), so that spend survives a crash.

    ``reserved_usd`` is the worst case reserved before forwarding; NULL when no blocking budget
    was in scope. A ``usage_unknown`` row (the request may have been billed, no reply or usage
    came back: a crash, a client gone before the reply) counts it against its budgets until it
    is reconciled.
    """
    conn.execute("ALTER TABLE requests ADD COLUMN reserved_usd DECIMAL(38, 12)")


@migration
def m006_costs_in_64_bits(conn: duckdb.DuckDBPyConnection) -> None:
    """Per-row costs as ``DECIMAL(18, 12)``: the same 12 places, stored as 64-bit integers.

    ``DECIMAL(38, 12)`` is a 128-bit integer inside; reports sum and rank ``cost_usd``,
    ``output_cost_usd`` and ``cache_savings_usd`` of every row, and at 64 bits those scans read
    half the bytes and add and sort about twice as fast. Sums are still ``DECIMAL(38, 12)``.
    A row's cost fits below $1,000,000 (six integer digits), far above any real request; a
    column that already holds a value that does not fit keeps its type (reports read both).
    ``provider_cost_usd`` (whatever the provider reports) stays ``DECIMAL(38, 12)``.
    """
    for column in ("cost_usd", "output_cost_usd", "cache_savings_usd", "reserved_usd"):
        found = conn.execute(f"SELECT count(*) FROM requests WHERE abs({column}) >= 1000000").fetchone()
        if found and found[0]:
            continue
        conn.execute(f"ALTER TABLE requests ALTER COLUMN {column} TYPE DECIMAL(18, 12)")


_STATUS_VALUES = {
    "row_kind": ("request", "attempt", "part"),
    "price_status": (
        "priced",
        "partially_priced",
        "repaired",
        "fallback",
        "usage_invalid",
        "unpriced",
        "not_billed",
        "not_metered",
        "usage_unknown",
        "deferred",
    ),
    "usage_source": ("reported", "estimated", "partial", "none"),
}
"""Every value the proxy writes to each status column (``tests/test_report_queries.py`` checks the
code's constants against it): a value not listed cannot be inserted, so a new one needs a migration."""


@migration
def m007_status_enums(conn: duckdb.DuckDBPyConnection) -> None:
    """``row_kind``, ``price_status`` and ``usage_source`` as ENUM types: one byte a row instead of text.

    Every report tests these columns on each row (is it a request, is it priced, was its usage
    estimated); on an ENUM that is a small-integer comparison instead of a string one, about a
    quarter of a report's time over 10 million rows. Values already stored that the proxy no
    longer writes are kept in the type. Writing a value outside the type fails the insert, so
    adding a status means adding it here, in a new migration.
    """
    for column, values in _STATUS_VALUES.items():
        found = conn.execute(f"SELECT DISTINCT {column} FROM requests WHERE {column} IS NOT NULL").fetchall()
        stored = [r[0] for r in found]
        members = ", ".join("'" + v.replace("'", "''") + "'" for v in dict.fromkeys([*values, *sorted(stored)]))
        conn.execute(f"CREATE TYPE {column}_value AS ENUM ({members})")
        conn.execute(f"ALTER TABLE requests ALTER COLUMN {column} TYPE {column}_value")


@migration
def m008_media_units(conn: duckdb.DuckDBPyConnection) -> None:
    """The units the images and audio endpoints bill by besides tokens.

    ``output_images``: images generated; ``image_variant``: the ``<size>/<quality>`` they were made
    at (per-image prices differ by it); ``input_audio_seconds``: seconds of audio transcribed or
    translated (priced per minute); ``input_characters``: characters of text spoken (priced per 1M).
    Earlier rows get 0 (and ``''``): they had none.
    """
    for column in ("output_images", "input_audio_seconds", "input_characters"):
        conn.execute(f"ALTER TABLE requests ADD COLUMN {column} BIGINT DEFAULT 0")
    conn.execute("ALTER TABLE requests ADD COLUMN image_variant VARCHAR DEFAULT ''")


@migration
def m009_agent_budgets(conn: duckdb.DuckDBPyConnection) -> None:
    """Attribution and budget facts for agents: org, pool, run, and what degrading changed.

    ``org`` and ``pool`` come from the key's definition (budgets can be scoped to them);
    ``run_id`` is the run the request named (``X-Tokenward-Run``), so a run's spend survives a
    restart; ``sent_model`` is the model tokenward sent upstream when a budget rerouted the
    request (``requested_model`` stays what the client asked for); ``degraded`` says what a
    budget changed instead of refusing (``model gpt-4o -> gpt-4o-mini``, ``max_tokens 2000 -> 812``).
    """
    for column in ("org", "pool", "run_id", "sent_model", "degraded"):
        conn.execute(f"ALTER TABLE requests ADD COLUMN {column} VARCHAR")


@migration
def m010_tool_calls(conn: duckdb.DuckDBPyConnection) -> None:
    """Provider-run tool calls billed outside the tokens, beside ``web_search_requests``.

    ``web_fetch_requests`` (Anthropic web fetch), ``file_search_calls`` (OpenAI file search) and
    ``code_containers`` (code execution containers a reply used). Earlier rows get 0: they were
    not counted then.
    """
    for column in ("web_fetch_requests", "file_search_calls", "code_containers"):
        conn.execute(f"ALTER TABLE requests ADD COLUMN {column} BIGINT DEFAULT 0")


@migration
def m011_image_generation_calls(conn: duckdb.DuckDBPyConnection) -> None:
    """``image_generation_calls``: images the OpenAI Responses image generation tool made (billed outside the tokens).

    Earlier rows get 0: they were not counted then.
    """
    conn.execute("ALTER TABLE requests ADD COLUMN image_generation_calls BIGINT DEFAULT 0")
