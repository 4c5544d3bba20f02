"""Report speed over a large ledger: generate N rows (10 million by default), time the main reports.

    python bench/bench_reports.py [--rows 10000000] [--threads 1] [--keep PATH]

The ledger is synthetic but shaped like real traffic: 30 days, 200 keys in 12 teams, 12 models,
5000 end users, tags on 40 % of requests, sessions of 50 requests, cached input on a third of
them, 1 % unpriced and 1 % retried attempts. Each report runs the queries ``tokenward report``
runs (grouped rows and the total), on ``--threads`` DuckDB threads (one core by default), and
prints its wall time: the best of three runs, after one warm-up.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenward.pricing.catalog import load_catalog  # noqa: E402
from tokenward.reports import queries, views, whatif  # noqa: E402
from tokenward.reports.ledger import open_ledger  # noqa: E402

MODELS = [
    ("gpt-4o", "openai", 2.50, 1.25, 10.00),
    ("gpt-4o-mini", "openai", 0.15, 0.075, 0.60),
    ("gpt-4.1", "openai", 2.00, 0.50, 8.00),
    ("gpt-4.1-mini", "openai", 0.40, 0.10, 1.60),
    ("o4-mini", "openai", 1.10, 0.275, 4.40),
    ("gpt-5", "openai", 1.25, 0.125, 10.00),
    ("gpt-5-mini", "openai", 0.25, 0.025, 2.00),
    ("claude-sonnet-4-5", "anthropic", 3.00, 0.30, 15.00),
    ("claude-haiku-4-5", "anthropic", 1.00, 0.10, 5.00),
    ("deepseek-chat", "deepseek", 0.27, 0.07, 1.10),
    ("gemini-2.5-flash", "google", 0.30, 0.075, 2.50),
    ("mistral-large-latest", "mistral", 2.00, 2.00, 6.00),
]


def generate(path: Path, rows: int) -> float:
    """Create the ledger at ``path`` with ``rows`` synthetic rows; returns seconds taken."""
    started = time.perf_counter()
    conn = open_ledger(path)
    models = ", ".join(f"('{m}', '{p}', {i}, {c}, {o})" for m, p, i, c, o in MODELS)
    conn.execute(
        f"CREATE TEMP TABLE models (model VARCHAR, provider VARCHAR, rin DECIMAL(10,4), rcached DECIMAL(10,4), "
        f"rout DECIMAL(10,4)); INSERT INTO models VALUES {models}"
    )
    conn.execute(
        f"""
        INSERT INTO requests BY NAME
        WITH base AS (
            SELECT i,
                   hash(i) AS h,
                   (hash(i) % 12)::INTEGER + 1 AS m,
                   100 + (hash(i * 3) % 20000)::BIGINT AS input_tokens,
                   10 + (hash(i * 5) % 2000)::BIGINT AS output_tokens
            FROM range({rows}) AS t(i)
        ), shaped AS (
            SELECT b.*, md.model, md.provider, md.rin, md.rcached, md.rout,
                   CASE WHEN i % 3 = 0 THEN (b.input_tokens * ((hash(i * 7) % 90)::BIGINT) // 100) ELSE 0 END
                       AS cached_input_tokens,
                   CASE WHEN md.model IN ('o4-mini', 'gpt-5', 'gpt-5-mini') THEN b.output_tokens // 2 ELSE 0 END
                       AS reasoning_tokens
            FROM base AS b JOIN (SELECT row_number() OVER () AS n, * FROM models) AS md ON md.n = b.m
        )
        SELECT 'r' || i AS request_id,
               TIMESTAMPTZ '2026-10-01 00:00:00+00' + to_microseconds(i * (2592000000000 // {rows})) AS started_at,
               TIMESTAMPTZ '2026-10-01 00:00:01+00' + to_microseconds(i * (2592000000000 // {rows})) AS ended_at,
               'key-' || (h % 200) AS principal,
               'POST' AS method, '/v1/chat/completions' AS path,
               CASE WHEN i % 20 = 0 THEN 'responses' ELSE 'chat_completions' END AS endpoint,
               provider AS upstream, provider, model AS requested_model, model AS served_model,
               200 AS http_status, 'ok' AS outcome, i % 2 = 0 AS stream,
               input_tokens, cached_input_tokens, 0 AS cache_write_tokens, 0 AS cache_write_1h_tokens,
               output_tokens, reasoning_tokens, 0 AS audio_input_tokens, 0 AS audio_output_tokens,
               0 AS image_input_tokens, 0 AS web_search_requests,
               CASE WHEN i % 97 = 0 THEN 'estimated' ELSE 'reported' END AS usage_source,
               CASE WHEN i % 100 = 1 THEN NULL ELSE
                   ((input_tokens - cached_input_tokens) * rin + cached_input_tokens * rcached + output_tokens * rout)
                   / 1000000 END AS cost_usd,
               CASE WHEN i % 100 = 1 THEN 'unpriced' ELSE 'priced' END AS price_status,
               CASE WHEN i % 100 = 1 THEN NULL ELSE output_tokens * rout / 1000000 END AS output_cost_usd,
               CASE WHEN i % 100 = 1 THEN NULL ELSE cached_input_tokens * (rin - rcached) / 1000000 END
                   AS cache_savings_usd,
               (h % 4000)::DOUBLE / 10 AS latency_ms,
               CASE WHEN i % 100 = 2 THEN 'attempt' ELSE 'request' END AS row_kind,
               'key-' || (h % 200) AS key_id,
               'team-' || (h % 200 % 12) AS team,
               'project-' || (h % 200 % 40) AS project,
               'user-' || (hash(i * 11) % 5000) AS end_user,
               CASE i % 5 WHEN 0 THEN ['nightly'] WHEN 1 THEN ['eval', 'nightly'] ELSE NULL END AS tags,
               'session-' || (i // 50) AS session_id
        FROM shaped
        """
    )
    conn.execute("CHECKPOINT")
    conn.close()
    return time.perf_counter() - started


def timed(fn, runs: int = 3) -> float:
    fn()  # warm-up (file pages cached)
    return min(_once(fn) for _ in range(runs))


def _once(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="Keep (or reuse) the generated ledger at this path.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = args.keep or Path(scratch) / "bench.duckdb"
        if not path.exists():
            seconds = generate(path, args.rows)
            print(f"generated {args.rows:,} rows in {seconds:.1f} s ({path.stat().st_size / 1e6:,.0f} MB)")
        conn = open_ledger(path, read_only=True)
        conn.execute(f"SET threads = {args.threads}")
        total = conn.execute("SELECT count(*) FROM requests").fetchone()[0]
        print(f"{total:,} rows, DuckDB threads = {args.threads}\n")
        tz = "Europe/Paris"
        month = queries.Selection(None, None, {}, tz)
        now = dt.datetime(2026, 10, 31, 12, tzinfo=dt.UTC)
        calendar = views.calendar_range("this-month", tz, now)
        half = queries.Selection(calendar.since, calendar.until, {}, tz)
        catalog = load_catalog([], builtin=True)

        def grouped(by: list[str], selection: queries.Selection = month, **kw):
            def run():  # what `tokenward report` runs: the groups, then the total
                rows = queries.spend(
                    conn, by, since=selection.since, until=selection.until, tz=tz, filters=selection.filters, **kw
                )
                partition = None if kw.get("top") or "tag" in by else rows
                queries.spend_totals(conn, selection, groups=partition)

            return run

        def compare():
            rows = queries.spend(conn, ["key"], since=half.since, until=half.until, tz=tz)
            queries.spend_totals(conn, half, groups=rows)
            before = views.previous_range(half.since, half.until, calendar, tz)
            views.add_change(rows, queries.spend(conn, ["key"], since=before[0], until=before[1], tz=tz), ["key"])

        reports = [
            ("by model", grouped(["model"])),
            ("by day (Europe/Paris)", grouped(["day"])),
            ("by day, model", grouped(["day", "model"])),
            ("by hour", grouped(["hour"])),
            ("by key, top 10", grouped(["key"], top=10)),
            ("by team, project", grouped(["team", "project"])),
            ("by end user (5000 groups)", grouped(["end_user"])),
            ("by session, top 20", grouped(["session"], top=20)),
            ("by session, all 200K groups", grouped(["session"])),
            ("by tag", grouped(["tag"])),
            ("by model, team=team-3", grouped(["model"], queries.Selection(None, None, {"team": ["team-3"]}, tz))),
            ("this month vs last, by key", compare),
            ("what-if gpt-5-mini, by model", lambda: whatif.what_if(conn, catalog, "gpt-5-mini", ["model"], month)),
        ]
        figures = []
        print(f"{'report':<32} {'seconds':>8}")
        for name, fn in reports:
            seconds = timed(fn)
            figures.append(seconds)
            print(f"{name:<32} {seconds:>8.3f}")
        print(f"\nmedian {statistics.median(figures):.3f} s, slowest {max(figures):.3f} s (target: each under 2 s)")
        conn.close()


if __name__ == "__main__":
    main()
