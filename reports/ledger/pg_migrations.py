"""Versioned schema migrations for the Postgres ledger: rows, control-plane state and budget books.

The ``requests`` table has the columns of :data:`~tokenward.reports.ledger.schema.ROW_COLUMNS`
(the DuckDB ledger's, in Postgres types), ``request_id`` as its primary key (so every insert
de-duplicates with ``ON CONFLICT DO NOTHING``), and ``seq``: a number from ``requests_seq``
taken under the ingest lock (:data:`INGEST_LOCK`) at insert and again at every update, so that
``seq`` order is commit order and a reader can copy "everything after seq N" without missing a
row (:mod:`~tokenward.reports.ledger.mirror`).

Each migration is a function ``mNNN_what(conn)`` registered with :func:`migration`, applied once
in order under an advisory lock (replicas starting together migrate once); applied names are
kept in ``_migrations``. Never edit a migration that has shipped: add a new one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["INGEST_LOCK", "MIGRATE_LOCK", "MIGRATIONS", "PG_TYPES", "migrate", "migration", "pending"]

Migration = Callable[[Any], None]
MIGRATIONS: list[Migration] = []
"""Registered migrations, in the order they are applied."""

MIGRATE_LOCK = 0x746F6B656E01
"""Advisory lock key held while migrating."""
INGEST_LOCK = 0x746F6B656E02
"""Advisory (transaction) lock key held by every transaction that inserts or updates ``requests``."""

PG_TYPES = {
    "VARCHAR": "text",
    "DOUBLE": "double precision",
    "INTEGER": "integer",
    "BOOLEAN": "boolean",
    "BIGINT": "bigint",
    "DECIMAL(38,12)": "numeric(38,12)",
    "JSON": "json",
    "VARCHAR[]": "text[]",
}
"""Postgres type of each :data:`ROW_COLUMNS` type (times are ``timestamptz``)."""


_M001_COLUMNS: dict[str, str] = {
    "request_id": "VARCHAR",
    "client_request_id": "VARCHAR",
    "started_at": "DOUBLE",
    "ended_at": "DOUBLE",
    "principal": "VARCHAR",
    "method": "VARCHAR",
    "path": "VARCHAR",
    "endpoint": "VARCHAR",
    "upstream": "VARCHAR",
    "provider": "VARCHAR",
    "requested_model": "VARCHAR",
    "served_model": "VARCHAR",
    "http_status": "INTEGER",
    "outcome": "VARCHAR",
    "stream": "BOOLEAN",
    "input_tokens": "BIGINT",
    "cached_input_tokens": "BIGINT",
    "cache_write_tokens": "BIGINT",
    "cache_write_1h_tokens": "BIGINT",
    "output_tokens": "BIGINT",
    "reasoning_tokens": "BIGINT",
    "audio_input_tokens": "BIGINT",
    "audio_output_tokens": "BIGINT",
    "image_input_tokens": "BIGINT",
    "web_search_requests": "BIGINT",
    "usage_source": "VARCHAR",
    "cost_usd": "DECIMAL(38,12)",
    "price_status": "VARCHAR",
    "price_entry_id": "VARCHAR",
    "price_resolved_by": "VARCHAR",
    "cost_lines": "JSON",
    "output_cost_usd": "DECIMAL(38,12)",
    "cache_savings_usd": "DECIMAL(38,12)",
    "provider_cost_usd": "DECIMAL(38,12)",
    "service_tier": "VARCHAR",
    "latency_ms": "DOUBLE",
    "ttfb_ms": "DOUBLE",
    "error": "VARCHAR",
    "violations": "VARCHAR",
    "raw_usage": "JSON",
    "row_kind": "VARCHAR",
    "parent_request_id": "VARCHAR",
    "key_id": "VARCHAR",
    "team": "VARCHAR",
    "project": "VARCHAR",
    "end_user": "VARCHAR",
    "tags": "VARCHAR[]",
    "session_id": "VARCHAR",
    "reserved_usd": "DECIMAL(38,12)",
}
"""The row's columns when the Postgres ledger was first made (later columns come from later migrations)."""

_REQUIRED = {
    "request_id",
    "started_at",
    "ended_at",
    "principal",
    "method",
    "path",
    "endpoint",
    "outcome",
    "stream",
    "usage_source",
    "price_status",
}  # NOT NULL, as in the DuckDB ledger (with every token count)


def migration(fn: Migration) -> Migration:
    """Register ``fn`` as the next migration."""
    MIGRATIONS.append(fn)
    return fn


def _applied(conn: Any) -> set[str]:
    found = conn.execute("SELECT to_regclass('_migrations')").fetchone()
    if not found or found[0] is None:
        return set()
    return {row[0] for row in conn.execute("SELECT name FROM _migrations").fetchall()}


def pending(conn: Any) -> list[str]:
    """Names of the migrations not yet applied to the database behind ``conn`` (a psycopg connection)."""
    done = _applied(conn)
    return [fn.__name__ for fn in MIGRATIONS if fn.__name__ not in done]


def migrate(conn: Any) -> list[str]:
    """Apply every pending migration in one transaction, under :data:`MIGRATE_LOCK`; the names applied.

    ``conn`` is a psycopg connection outside a transaction (autocommit).
    """
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", [MIGRATE_LOCK])
        conn.execute("CREATE TABLE IF NOT EXISTS _migrations (name text PRIMARY KEY, applied_at timestamptz)")
        done = _applied(conn)
        applied = []
        for fn in MIGRATIONS:
            if fn.__name__ in done:
                continue
            fn(conn)
            conn.execute("INSERT INTO _migrations VALUES (%s, now())", [fn.__name__])
            applied.append(fn.__name__)
    return applied


@migration
def m001_requests(conn: Any) -> None:
    """The per-request ledger (the DuckDB ledger's columns), keyed by ``request_id``, with ``seq``.

    ``tw_meta`` holds ``ledger_id``, a random id a local copy uses to notice a new database.
    """
    columns = []
    for name, kind in _M001_COLUMNS.items():
        sql_type = "timestamptz" if name in ("started_at", "ended_at") else PG_TYPES[kind]
        columns.append(f"{name} {sql_type}{' NOT NULL' if name in _REQUIRED or kind == 'BIGINT' else ''}")
    conn.execute("CREATE SEQUENCE requests_seq")
    conn.execute(
        f"CREATE TABLE requests ({', '.join(columns)}, seq bigint NOT NULL DEFAULT nextval('requests_seq'), "
        "PRIMARY KEY (request_id))"
    )
    for column in ("started_at", "seq"):
        conn.execute(f"CREATE INDEX requests_by_{column} ON requests ({column})")
    conn.execute("CREATE TABLE tw_meta (name text PRIMARY KEY, value text NOT NULL)")
    conn.execute("INSERT INTO tw_meta VALUES ('ledger_id', md5(random()::text || clock_timestamp()::text))")


@migration
def m002_state(conn: Any) -> None:
    """Alert claims and deliveries, stored keys and revocations, provider object owners.

    The tables of :class:`~tokenward.reports.ledger.state.SqliteState`; a claim's primary key
    (budget, period start, kind, threshold) makes it unique across every replica.
    """
    conn.execute(
        """
        CREATE TABLE alert_claims (
            budget text NOT NULL, period_start timestamptz NOT NULL, kind text NOT NULL, threshold integer NOT NULL,
            created_at timestamptz NOT NULL, status text NOT NULL, attempts integer NOT NULL DEFAULT 0,
            last_error text, detail jsonb, claim_no bigserial,
            PRIMARY KEY (budget, period_start, kind, threshold)
        );
        CREATE TABLE alert_deliveries (
            budget text NOT NULL, period_start timestamptz NOT NULL, kind text NOT NULL, threshold integer NOT NULL,
            channel text NOT NULL, target text NOT NULL, attempted_at timestamptz NOT NULL, ok boolean NOT NULL,
            attempts integer NOT NULL, error text
        );
        CREATE INDEX alert_deliveries_key ON alert_deliveries (budget, period_start, kind, threshold);
        CREATE TABLE virtual_keys (
            name text PRIMARY KEY, key_sha256 text NOT NULL UNIQUE, team text, project text,
            role text NOT NULL DEFAULT 'user', created_at timestamptz NOT NULL, revoked_at timestamptz
        );
        CREATE TABLE revoked_keys (key_sha256 text PRIMARY KEY, name text, revoked_at timestamptz NOT NULL);
        CREATE TABLE objects (
            object_id text PRIMARY KEY, kind text NOT NULL, key_id text NOT NULL, created_at timestamptz NOT NULL
        );
        CREATE INDEX objects_by_key ON objects (key_id, kind);
        """
    )


@migration
def m003_books(conn: Any) -> None:
    """Budget books shared by every replica: spend and holds per book and period, leases, settlements.

    * ``budget_books``: per book (a budget's name) and period start, ``spent`` and ``held`` (USD);
    * ``budget_replicas``: each live proxy process and the instant its lease ends;
    * ``budget_holds``: open reservations (what each holds in which books), per replica;
    * ``budget_settled``: spend settled for requests whose rows are not in ``requests`` yet, so
      that reconciling ``spent`` from the ledger counts them once.

    ``tw_reserve``, ``tw_settle`` and ``tw_expire`` are the one-round-trip operations of
    :class:`~tokenward.reports.ledger.books.PgBooks`; every function locks book rows in
    (book, period start) order, so two never deadlock.
    """
    conn.execute(
        """
        CREATE TABLE budget_books (
            book text NOT NULL, period_start timestamptz NOT NULL, limit_usd numeric(38,12) NOT NULL,
            spent numeric(38,12) NOT NULL DEFAULT 0, held numeric(38,12) NOT NULL DEFAULT 0,
            reconciled_at timestamptz, PRIMARY KEY (book, period_start)
        );
        CREATE TABLE budget_replicas (replica text PRIMARY KEY, lease_until timestamptz NOT NULL);
        CREATE TABLE budget_holds (
            hold_id bigserial PRIMARY KEY, replica text NOT NULL, books text[] NOT NULL,
            starts timestamptz[] NOT NULL, amounts numeric(38,12)[] NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now()
        );
        CREATE INDEX budget_holds_replica ON budget_holds (replica);
        CREATE TABLE budget_settled (
            request_id text NOT NULL, book text NOT NULL, period_start timestamptz NOT NULL,
            started_at timestamptz NOT NULL, amount numeric(38,12) NOT NULL,
            PRIMARY KEY (request_id, book, period_start)
        );
        CREATE INDEX budget_settled_book ON budget_settled (book, period_start);

        -- Hold p_amounts in each book, all or none: spent + held + amount <= limit in every one
        -- (p_all_left: hold everything left, which must exceed the amount). Returns the hold id, or
        -- the index (1-based) of the first book that refused and what it had left.
        CREATE FUNCTION tw_reserve(
            p_replica text, p_books text[], p_starts timestamptz[], p_limits numeric[], p_amounts numeric[],
            p_all_left boolean, OUT hold_id bigint, OUT refused integer, OUT remaining numeric,
            OUT held numeric[], OUT spent numeric[], OUT holding numeric[]
        ) LANGUAGE plpgsql AS $$
        DECLARE
            r record;
            n integer := coalesce(array_length(p_books, 1), 0);
            taken numeric[] := array_fill(0::numeric, ARRAY[n]);
            spents numeric[] := array_fill(0::numeric, ARRAY[n]);
            helds numeric[] := array_fill(0::numeric, ARRAY[n]);
            found_n integer := 0;
            left_usd numeric;
        BEGIN
            -- a replica whose lease ended must renew it first (its old holds are being released);
            -- FOR SHARE: tw_expire cannot delete the lease until this hold is committed, and then sees it
            PERFORM 1 FROM budget_replicas WHERE replica = p_replica AND lease_until > now() FOR SHARE;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'tokenward replica % has no lease', p_replica USING ERRCODE = 'TW001';
            END IF;
            FOR attempt IN 1..2 LOOP
                found_n := 0;
                FOR r IN
                    SELECT b.book, b.period_start, b.spent, b.held, a.i, a.lim, a.amount
                    FROM unnest(p_books, p_starts, p_limits, p_amounts)
                         WITH ORDINALITY AS a(book, start, lim, amount, i)
                    JOIN budget_books b ON b.book = a.book AND b.period_start = a.start
                    ORDER BY b.book, b.period_start FOR UPDATE OF b
                LOOP
                    found_n := found_n + 1;
                    left_usd := greatest(r.lim - r.spent - r.held, 0);
                    IF r.spent + r.held + r.amount > r.lim OR (p_all_left AND left_usd <= r.amount) THEN
                        IF refused IS NULL OR r.i < refused THEN
                            refused := r.i;
                            remaining := left_usd;
                        END IF;
                    END IF;
                    taken[r.i] := CASE WHEN p_all_left THEN left_usd ELSE r.amount END;
                    spents[r.i] := r.spent;
                    helds[r.i] := r.held;
                END LOOP;
                EXIT WHEN found_n = n;
                INSERT INTO budget_books (book, period_start, limit_usd)
                SELECT a.book, a.start, a.lim FROM unnest(p_books, p_starts, p_limits) AS a(book, start, lim)
                ORDER BY 1, 2 ON CONFLICT DO NOTHING;
                refused := NULL;
            END LOOP;
            IF refused IS NOT NULL THEN
                spent := spents;
                holding := helds;
                RETURN;
            END IF;
            UPDATE budget_books b SET held = b.held + t.amount
            FROM unnest(p_books, p_starts, taken) AS t(book, start, amount)
            WHERE b.book = t.book AND b.period_start = t.start;
            INSERT INTO budget_holds (replica, books, starts, amounts) VALUES (p_replica, p_books, p_starts, taken)
            RETURNING budget_holds.hold_id INTO hold_id;
            held := taken;
            spent := spents;
            FOR i IN 1..n LOOP
                helds[i] := helds[i] + taken[i];
            END LOOP;
            holding := helds;
        END $$;

        -- Give back hold p_hold (if it is still there: an expired lease released it already) and
        -- count p_amounts as spent for request p_request, in one transaction.
        CREATE FUNCTION tw_settle(
            p_hold bigint, p_request text, p_started timestamptz, p_books text[], p_starts timestamptz[],
            p_amounts numeric[]
        ) RETURNS void LANGUAGE plpgsql AS $$
        DECLARE
            h record;
        BEGIN
            DELETE FROM budget_holds WHERE hold_id = p_hold RETURNING books, starts, amounts INTO h;
            INSERT INTO budget_books AS b (book, period_start, limit_usd, spent, held)
            SELECT book, start, 0, sum(spend), sum(hold) FROM (
                SELECT book, start, 0::numeric AS spend, -amount AS hold
                FROM unnest(h.books, h.starts, h.amounts) AS x(book, start, amount)
                UNION ALL
                SELECT book, start, amount, 0 FROM unnest(p_books, p_starts, p_amounts) AS y(book, start, amount)
            ) AS d GROUP BY book, start ORDER BY book, start
            ON CONFLICT (book, period_start) DO UPDATE
            SET spent = b.spent + EXCLUDED.spent, held = greatest(b.held + EXCLUDED.held, 0);
            IF p_request IS NOT NULL AND coalesce(array_length(p_books, 1), 0) > 0
               AND NOT EXISTS (SELECT 1 FROM requests WHERE request_id = p_request) THEN
                INSERT INTO budget_settled (request_id, book, period_start, started_at, amount)
                SELECT p_request, book, start, p_started, amount
                FROM unnest(p_books, p_starts, p_amounts) AS y(book, start, amount)
                ON CONFLICT DO NOTHING;
            END IF;
        END $$;

        -- Release the holds of every replica whose lease has ended; returns how many book amounts it gave back.
        CREATE FUNCTION tw_expire() RETURNS integer LANGUAGE plpgsql AS $$
        DECLARE
            gone text[];
            r record;
            released integer := 0;
        BEGIN
            WITH d AS (DELETE FROM budget_replicas WHERE lease_until < now() RETURNING replica)
            SELECT array_agg(replica) INTO gone FROM d;
            IF gone IS NULL THEN
                RETURN 0;
            END IF;
            -- a new statement, so that holds committed while the lease rows were being deleted are seen;
            -- book rows are updated in (book, period start) order, as everywhere else
            FOR r IN
                WITH holds AS (
                    DELETE FROM budget_holds h WHERE h.replica = ANY (gone) RETURNING h.books, h.starts, h.amounts
                )
                SELECT x.book, x.start, sum(x.amount) AS amount
                FROM holds, unnest(holds.books, holds.starts, holds.amounts) AS x(book, start, amount)
                GROUP BY 1, 2 ORDER BY 1, 2
            LOOP
                UPDATE budget_books SET held = greatest(held - r.amount, 0)
                WHERE book = r.book AND period_start = r.start;
                released := released + 1;
            END LOOP;
            RETURN released;
        END $$;
        """
    )


@migration
def m004_costs_in_64_bits(conn: Any) -> None:
    """Per-row costs as ``numeric(18, 12)``, as the DuckDB ledger's ``m006_costs_in_64_bits``.

    The same meaning in both engines: 12 decimal places, a row's cost below $1,000,000 (a column
    already holding a value that does not fit keeps its type). ``provider_cost_usd`` stays
    ``numeric(38, 12)``.
    """
    for column in ("cost_usd", "output_cost_usd", "cache_savings_usd", "reserved_usd"):
        found = conn.execute(f"SELECT count(*) FROM requests WHERE abs({column}) >= 1000000").fetchone()
        if found and found[0]:
            continue
        conn.execute(f"ALTER TABLE requests ALTER COLUMN {column} TYPE numeric(18, 12)")


_M005_STATUS_VALUES: dict[str, tuple[str, ...]] = {
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
"""The values ``m005_status_values`` allows (the DuckDB ledger's ``m007_status_enums``); a status
added later needs a new migration in both engines (``tests/test_pg_ledger.py`` checks)."""


@migration
def m005_status_values(conn: Any) -> None:
    """``row_kind``, ``price_status`` and ``usage_source`` limited to the values the proxy writes.

    The DuckDB ledger makes them ENUM types (``m007_status_enums``); here a ``CHECK`` constraint
    per column with the same values does the same job (a value outside fails the insert; the
    columns stay ``text``). Values already stored that the proxy no longer writes are kept.
    """
    for column, values in _M005_STATUS_VALUES.items():
        found = conn.execute(f"SELECT DISTINCT {column} FROM requests WHERE {column} IS NOT NULL").fetchall()
        allowed = dict.fromkeys([*values, *sorted(r[0] for r in found)])
        members = ", ".join("'" + v.replace("'", "''") + "'" for v in allowed)
        conn.execute(f"ALTER TABLE requests ADD CONSTRAINT {column}_value CHECK ({column} IN ({members}))")


@migration
def m006_media_units(conn: Any) -> None:
    """The units the images and audio endpoints bill by besides tokens (DuckDB's ``m008_media_units``).

    ``output_images``, ``input_audio_seconds``, ``input_characters`` (earlier rows 0) and
    ``image_variant`` (earlier rows ``''``).
    """
    for column in ("output_images", "input_audio_seconds", "input_characters"):
        conn.execute(f"ALTER TABLE requests ADD COLUMN {column} bigint NOT NULL DEFAULT 0")
    conn.execute("ALTER TABLE requests ADD COLUMN image_variant text DEFAULT ''")


@migration
def m007_agent_budgets(conn: Any) -> None:
    """``org``, ``pool``, ``run_id``, ``sent_model``, ``degraded`` (DuckDB's ``m009_agent_budgets``)."""
    for column in ("org", "pool", "run_id", "sent_model", "degraded"):
        conn.execute(f"ALTER TABLE requests ADD COLUMN {column} text")


@migration
def m008_object_order(conn: Any) -> None:
    """``objects.seq``: the order owners were recorded in (``recent_objects`` breaks ties in ``created_at`` by it)."""
    conn.execute("ALTER TABLE objects ADD COLUMN seq bigserial")


@migration
def m009_run_starts(conn: Any) -> None:
    """``budget_runs``: the first request of each run on any replica, so its ``ttl`` is one clock for all."""
    conn.execute("CREATE TABLE budget_runs (name text PRIMARY KEY, started_at timestamptz NOT NULL)")
    conn.execute("CREATE INDEX budget_runs_by_start ON budget_runs (started_at)")


@migration
def m010_alert_leases(conn: Any) -> None:
    """``alert_claims.lease_holder``/``lease_until`` (epoch s): the one process delivering a pending claim."""
    conn.execute("ALTER TABLE alert_claims ADD COLUMN lease_holder text")
    conn.execute("ALTER TABLE alert_claims ADD COLUMN lease_until double precision")


@migration
def m011_dead_holds_count(conn: Any) -> None:
    """A replica that dies leaves its holds counted as spend, not given back: its requests may be billed.

    ``budget_holds`` gets the ``request_id`` and ``started_at`` of the request each hold is for
    (``tw_reserve_for``: ``tw_reserve``, then the hold named). ``tw_expire`` then moves an ended
    replica's named holds into ``spent`` and into ``budget_settled`` under their request ids, so a
    reconciliation keeps counting them until the request's row arrives (its log recovered), then
    counts the row instead: once. Holds of replicas from before this migration, unnamed, are given
    back as before.
    """
    conn.execute(
        """
        ALTER TABLE budget_holds ADD COLUMN request_id text, ADD COLUMN started_at timestamptz;

        CREATE FUNCTION tw_reserve_for(
            p_request text, p_started timestamptz, p_replica text, p_books text[], p_starts timestamptz[],
            p_limits numeric[], p_amounts numeric[], p_all_left boolean, OUT hold_id bigint, OUT refused integer,
            OUT remaining numeric, OUT held numeric[], OUT spent numeric[], OUT holding numeric[]
        ) LANGUAGE plpgsql AS $$
        BEGIN
            SELECT r.hold_id, r.refused, r.remaining, r.held, r.spent, r.holding
            INTO hold_id, refused, remaining, held, spent, holding
            FROM tw_reserve(p_replica, p_books, p_starts, p_limits, p_amounts, p_all_left) AS r;
            IF hold_id IS NOT NULL THEN
                UPDATE budget_holds AS h SET request_id = p_request, started_at = p_started
                WHERE h.hold_id = tw_reserve_for.hold_id;
            END IF;
        END $$;

        CREATE OR REPLACE FUNCTION tw_expire() RETURNS integer LANGUAGE plpgsql AS $$
        DECLARE
            gone text[];
            r record;
            released integer := 0;
        BEGIN
            WITH d AS (DELETE FROM budget_replicas WHERE lease_until < now() RETURNING replica)
            SELECT array_agg(replica) INTO gone FROM d;
            IF gone IS NULL THEN
                RETURN 0;
            END IF;
            -- a new statement, so that holds committed while the lease rows were being deleted are seen;
            -- book rows are updated in (book, period start) order, as everywhere else
            FOR r IN
                WITH holds AS (
                    DELETE FROM budget_holds h WHERE h.replica = ANY (gone)
                    RETURNING h.request_id, coalesce(h.started_at, h.created_at) AS started, h.books, h.starts,
                              h.amounts
                ), parts AS (
                    SELECT holds.request_id, holds.started, x.book, x.start, x.amount
                    FROM holds, unnest(holds.books, holds.starts, holds.amounts) AS x(book, start, amount)
                ), kept AS (  -- run once whether read or not (a data-modifying WITH)
                    INSERT INTO budget_settled (request_id, book, period_start, started_at, amount)
                    SELECT p.request_id, p.book, p.start, p.started, p.amount FROM parts p
                    WHERE p.request_id IS NOT NULL
                      AND NOT EXISTS (SELECT 1 FROM requests q WHERE q.request_id = p.request_id)
                    ON CONFLICT DO NOTHING
                )
                SELECT p.book, p.start, sum(p.amount) AS amount,
                       coalesce(sum(p.amount) FILTER (WHERE p.request_id IS NOT NULL), 0) AS spend
                FROM parts p GROUP BY 1, 2 ORDER BY 1, 2
            LOOP
                UPDATE budget_books SET held = greatest(held - r.amount, 0), spent = spent + r.spend
                WHERE book = r.book AND period_start = r.start;
                released := released + 1;
            END LOOP;
            RETURN released;
        END $$;
        """
    )


@migration
def m012_settle_once(conn: Any) -> None:
    """``tw_settle`` of a hold that is gone replaces what was counted for its request instead of adding to it.

    A hold is gone when it was settled already (a settlement that committed as the database went
    away is queued and sent again) or when its replica's lease ended (an outage longer than
    ``lease_s``: the first replica back ends the others' leases, and ``tw_expire`` counts each
    named hold as its request's spend at the worst case). Either way the request is counted
    once already, in ``budget_settled`` while its row is not in the ledger (or by its row, at
    reconciliation): the settlement now moves ``spent`` by the difference to that figure.
    Before, it added the whole amount again (a request counted at its worst case plus its real
    cost, or twice its cost) until the next reconciliation. The book rows are locked first, as
    :func:`~tokenward.reports.ledger.pg_books.reconcile` locks them, so a reconciliation never
    interleaves with the read of ``budget_settled``. A settlement without a hold adds, as before.
    """
    conn.execute(
        """
        CREATE OR REPLACE FUNCTION tw_settle(
            p_hold bigint, p_request text, p_started timestamptz, p_books text[], p_starts timestamptz[],
            p_amounts numeric[]
        ) RETURNS void LANGUAGE plpgsql AS $$
        DECLARE
            h record;
            in_ledger boolean;
        BEGIN
            DELETE FROM budget_holds WHERE hold_id = p_hold RETURNING books, starts, amounts INTO h;
            IF p_hold IS NOT NULL AND NOT FOUND THEN
                IF p_request IS NULL OR coalesce(array_length(p_books, 1), 0) = 0 THEN
                    RETURN;
                END IF;
                PERFORM 1 FROM budget_books b
                WHERE (b.book, b.period_start) IN (SELECT * FROM unnest(p_books, p_starts))
                ORDER BY b.book, b.period_start FOR UPDATE OF b;
                in_ledger := EXISTS (SELECT 1 FROM requests WHERE request_id = p_request);
                -- counted already: budget_settled's figure (a row in the ledger with none: counted by it)
                INSERT INTO budget_books AS b (book, period_start, limit_usd, spent, held)
                SELECT y.book, y.start, 0,
                       sum(y.amount - coalesce(s.amount, CASE WHEN in_ledger THEN y.amount ELSE 0 END)), 0
                FROM unnest(p_books, p_starts, p_amounts) AS y(book, start, amount)
                LEFT JOIN budget_settled s
                       ON s.request_id = p_request AND s.book = y.book AND s.period_start = y.start
                GROUP BY y.book, y.start ORDER BY 1, 2
                ON CONFLICT (book, period_start) DO UPDATE SET spent = b.spent + EXCLUDED.spent;
                IF in_ledger THEN
                    UPDATE budget_settled s SET amount = y.amount
                    FROM unnest(p_books, p_starts, p_amounts) AS y(book, start, amount)
                    WHERE s.request_id = p_request AND s.book = y.book AND s.period_start = y.start;
                ELSE
                    INSERT INTO budget_settled (request_id, book, period_start, started_at, amount)
                    SELECT p_request, book, start, p_started, amount
                    FROM unnest(p_books, p_starts, p_amounts) AS y(book, start, amount)
                    ON CONFLICT (request_id, book, period_start) DO UPDATE SET amount = EXCLUDED.amount;
                END IF;
                RETURN;
            END IF;
            INSERT INTO budget_books AS b (book, period_start, limit_usd, spent, held)
            SELECT book, start, 0, sum(spend), sum(hold) FROM (
                SELECT book, start, 0::numeric AS spend, -amount AS hold
                FROM unnest(h.books, h.starts, h.amounts) AS x(book, start, amount)
                UNION ALL
                SELECT book, start, amount, 0 FROM unnest(p_books, p_starts, p_amounts) AS y(book, start, amount)
            ) AS d GROUP BY book, start ORDER BY book, start
            ON CONFLICT (book, period_start) DO UPDATE
            SET spent = b.spent + EXCLUDED.spent, held = greatest(b.held + EXCLUDED.held, 0);
            IF p_request IS NOT NULL AND coalesce(array_length(p_books, 1), 0) > 0
               AND NOT EXISTS (SELECT 1 FROM requests WHERE request_id = p_request) THEN
                INSERT INTO budget_settled (request_id, book, period_start, started_at, amount)
                SELECT p_request, book, start, p_started, amount
                FROM unnest(p_books, p_starts, p_amounts) AS y(book, start, amount)
                ON CONFLICT DO NOTHING;
            END IF;
        END $$;
        """
    )


@migration
def m013_settle_once_without_hold(conn: Any) -> None:
    """A settlement without a hold counts once per request id, however often it is sent.

    A settlement that committed as the database went away is queued and sent again. With a
    hold, the hold being gone already tells (:func:`m012_settle_once`); without one (a blocking
    budget in scope and nothing held for the request) the second call added the request's cost
    again, until the next reconciliation. ``budget_settle_once`` remembers each request id
    settled without a hold: a second settlement of it changes nothing. Its entries are dropped
    two days on (:func:`~tokenward.reports.ledger.pg_books.reconcile`): a queued settlement lives
    only as long as its replica's process. The function of :func:`m012_settle_once` is kept as
    ``tw_settle_counted``; ``tw_settle`` checks first, then calls it.
    """
    conn.execute(
        """
        CREATE TABLE budget_settle_once (request_id text PRIMARY KEY, settled_at timestamptz NOT NULL DEFAULT now());
        ALTER FUNCTION tw_settle(bigint, text, timestamptz, text[], timestamptz[], numeric[])
            RENAME TO tw_settle_counted;
        CREATE FUNCTION tw_settle(
            p_hold bigint, p_request text, p_started timestamptz, p_books text[], p_starts timestamptz[],
            p_amounts numeric[]
        ) RETURNS void LANGUAGE plpgsql AS $$
        BEGIN
            IF p_hold IS NULL AND p_request IS NOT NULL AND coalesce(array_length(p_books, 1), 0) > 0 THEN
                INSERT INTO budget_settle_once (request_id) VALUES (p_request) ON CONFLICT DO NOTHING;
                IF NOT FOUND THEN
                    RETURN;  -- settled already: this is the same settlement sent again
                END IF;
            END IF;
            PERFORM tw_settle_counted(p_hold, p_request, p_started, p_books, p_starts, p_amounts);
        END $$;
        """
    )


@migration
def m014_key_expiry(conn: Any) -> None:
    """``virtual_keys.expires_at``: when a key made by ``tokenward keys create --expires`` stops working."""
    conn.execute("ALTER TABLE virtual_keys ADD COLUMN expires_at timestamptz")


@migration
def m015_tool_calls(conn: Any) -> None:
    """Provider-run tool calls billed outside the tokens (DuckDB's ``m010_tool_calls``; earlier rows 0)."""
    for column in ("web_fetch_requests", "file_search_calls", "code_containers"):
        conn.execute(f"ALTER TABLE requests ADD COLUMN {column} bigint NOT NULL DEFAULT 0")


@migration
def m016_image_generation_calls(conn: Any) -> None:
    """Images the Responses image generation tool made (DuckDB's ``m011_image_generation_calls``; earlier rows 0)."""
    conn.execute("ALTER TABLE requests ADD COLUMN image_generation_calls bigint NOT NULL DEFAULT 0")


@migration
def m017_deferred_responses(conn: Any) -> None:
    """``deferred_responses``: background Responses billed once when seen finished (DuckDB keeps them in SQLite).

    One row per response id: the request it belongs to, what prices it (``detail``), and once a
    replica saw it finished, its ``settlement`` (claimed by the first ``UPDATE``) and whether that
    is in the request's row yet (``applied``).
    """
    conn.execute(
        "CREATE TABLE deferred_responses (response_id text PRIMARY KEY, request_id text NOT NULL, "
        "detail jsonb NOT NULL, settlement jsonb, settled_at timestamptz, applied boolean NOT NULL DEFAULT false)"
    )
