"""Report speed over large ledgers: generate 1, 10 or 30 million rows, time what ``tokenward report`` runs.

    python bench/bench_reports.py [--rows 10M] [--rows 1M,10M,30M] [--threads N] [--runs 5] [--keep DIR]

The ledger is synthetic but shaped like real traffic: 30 days, 200 keys in 12 teams, 12 models,
5000 end users, tags on 40 % of requests, sessions of 50 requests, cached input on a third of
them, 1 % unpriced and 1 % retried attempts. Each report runs the queries ``tokenward report``
runs (the grouped rows and their total), on ``--threads`` DuckDB threads (default: every core),
and its figures are the median wall time and process CPU time (every DuckDB thread) of ``--runs``
runs after one warm-up. A terminal table shows at most ``report_cli.TABLE_ROWS`` groups (the dearest);
CSV, JSON and Parquet get every group, written by DuckDB (``reports.columnar``), so the 200,000
sessions are timed both ways. Every size is
generated and measured in a fresh process, whose peak RSS is printed. The ledgers go to a
temporary directory under /tmp (about 40 MB per million rows) and are deleted afterwards
unless ``--keep DIR`` names a directory to keep (and reuse) them in.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenward.pricing.catalog import load_catalog  # noqa: E402
from tokenward.reports import columnar, queries, render, views, whatif  # noqa: E402
from tokenward.reports.ledger import open_ledger  # noqa: E402
from tokenward.reports.report_cli import TABLE_ROWS  # noqa: E402

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
MB = 1024 * 1024


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


def reports(conn, tz: str = "Europe/Paris") -> list[tuple[str, object]]:
    """The reports timed, each a function running what ``tokenward report`` runs for it."""
    everything = queries.Selection(None, None, {}, tz)
    now = dt.datetime(2026, 10, 31, 12, tzinfo=dt.UTC)
    catalog = load_catalog([], builtin=True)

    def grouped(by: list[str], selection: queries.Selection = everything, top: int | None = None, shown=None):
        return lambda: queries.spend_report(conn, by, selection, top=top, shown=shown)

    recent = queries.Selection(now - dt.timedelta(days=15), None, {}, tz)

    def compare():  # --since 15d --compare --by key: both halves of the ledger's month hold rows
        rows, _ = queries.spend_report(conn, ["key"], recent)
        before = views.previous_range(recent.since, now, None, tz)
        previous, _ = queries.group_costs(conn, ["key"], queries.Selection(*before, {}, tz))
        views.add_change(rows, previous, ["key"])

    team = queries.Selection(None, None, {"team": ["team-3"]}, tz)
    every = render.columns_for(["session"])  # --format csv|json: every column, written by DuckDB
    return [
        ("by model", grouped(["model"])),
        ("by day (Europe/Paris)", grouped(["day"])),
        ("by day, model", grouped(["day", "model"])),
        ("by hour", grouped(["hour"])),
        ("by key, top 10", grouped(["key"], top=10)),
        ("by team, project", grouped(["team", "project"])),
        ("by end user (5000 groups)", grouped(["end_user"])),
        ("by session, top 20", grouped(["session"], top=20)),
        (f"by session, table ({TABLE_ROWS} shown)", grouped(["session"], shown=TABLE_ROWS)),
        ("by session, all groups (csv)", lambda: columnar.report_text(conn, ["session"], everything, every, "csv")),
        ("by session, all groups (json)", lambda: columnar.report_text(conn, ["session"], everything, every, "json")),
        ("by tag", grouped(["tag"])),
        ("by model, team=team-3", grouped(["model"], team)),
        ("last 15 days vs the 15 before, by key", compare),
        ("what-if gpt-5-mini, by model", lambda: whatif.what_if(conn, catalog, "gpt-5-mini", ["model"], everything)),
    ]


def measure(path: Path, threads: int | None, runs: int) -> dict:
    """Time every report on the ledger at ``path`` (in this process); figures as a JSON-ready dict."""
    conn = open_ledger(path, read_only=True)
    if threads:
        conn.execute(f"SET threads = {threads}")
    rows = conn.execute("SELECT count(*) FROM requests").fetchone()[0]
    figures = {}
    for name, fn in reports(conn):
        fn()  # warm-up: file pages read, caches filled
        times, cpu = [], []
        for _ in range(runs):
            started, used = time.perf_counter(), time.process_time()
            fn()
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - used)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        figures[name] = {"times": times, "cpu": cpu, "peak_rss_mb": peak}
    threads_used = conn.execute("SELECT current_setting('threads')").fetchone()[0]
    conn.close()
    return {"rows": rows, "threads": threads_used, "reports": figures}


def rows_given(text: str) -> int:
    """``1M``, ``30m``, ``500k`` or a plain number of rows."""
    text = text.strip().lower().replace("_", "").replace(",", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="10M", help="Ledger sizes, comma-separated: 1M, 10M, 30M or a number.")
    parser.add_argument("--threads", type=int, help="DuckDB threads (default: DuckDB's, every core).")
    parser.add_argument("--runs", type=int, default=5, help="Timed runs of each report (after one warm-up).")
    parser.add_argument("--keep", type=Path, help="Keep (and reuse) the generated ledgers in this directory.")
    parser.add_argument("--generate", type=Path, help=argparse.SUPPRESS)  # child: make this ledger
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # child: time the reports on it
    args = parser.parse_args()
    if args.generate:
        seconds = generate(args.generate, rows_given(args.rows))
        print(json.dumps({"seconds": seconds}))
        return
    if args.measure:
        print(json.dumps(measure(args.measure, args.threads, args.runs)))
        return
    sizes = [rows_given(r) for r in args.rows.split(",") if r.strip()]
    scratch = Path(tempfile.mkdtemp(prefix="tokenward-bench-", dir="/tmp"))
    folder = args.keep or scratch
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    load_before = os.getloadavg()
    try:
        for rows in sizes:
            path = folder / f"ledger-{rows}.duckdb"
            if not path.exists():
                made = _child("--generate", str(path), "--rows", str(rows))
                print(f"generated {rows:,} rows in {made['seconds']:.1f} s ({path.stat().st_size / MB:,.0f} MB)")
            extra = ["--threads", str(args.threads)] if args.threads else []
            results.append(_child("--measure", str(path), "--runs", str(args.runs), *extra))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _print(results, load_before, os.getloadavg())


def _print(results: list[dict], load_before: tuple[float, ...], load_after: tuple[float, ...]) -> None:
    width = 38
    runs = len(next(iter(results[0]["reports"].values()))["times"])
    print(f"\nDuckDB threads: {results[0]['threads']}; seconds, median of {runs} runs: wall / CPU")
    print(f"{'report':<{width}}" + "".join(f"{r['rows'] / 1e6:>14,.0f}M" for r in results))
    spreads = []
    for name in results[0]["reports"]:
        cells = []
        for result in results:
            times = result["reports"][name]["times"]
            median = statistics.median(times)
            spreads.append((max(times) - min(times)) / median if median else 0)
            cells.append(f"{median:>8.3f} /{statistics.median(result['reports'][name]['cpu']):>5.2f}")
        print(f"{name:<{width}}" + "".join(cells))
    medians = [[statistics.median(f["times"]) for f in r["reports"].values()] for r in results]
    print(f"{'median of the reports':<{width}}" + "".join(f"{statistics.median(m):>15.3f}" for m in medians))
    print(f"{'slowest':<{width}}" + "".join(f"{max(m):>15.3f}" for m in medians))
    peaks = [max(f["peak_rss_mb"] for f in r["reports"].values()) for r in results]
    print(f"{'peak RSS (MB)':<{width}}" + "".join(f"{p:>15,.0f}" for p in peaks))
    print(
        f"\nnoise: a report's runs spread by {statistics.median(spreads):.0%} of its median (median), "
        f"{max(spreads):.0%} at most; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )


if __name__ == "__main__":
    main()
