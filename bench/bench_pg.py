"""The Postgres ledger measured: driver round trips, rows/s ingested, and report times (prints figures).

    python bench/bench_pg.py [--rows 10000000] [--drivers-only] [--url postgresql://...]

Without ``--url`` a throwaway cluster is started (tests/pgcluster.py, Debian's postgresql).

1. Budget round trips: ``tw_reserve`` then ``tw_settle`` (what a request in scope of a blocking
   budget costs in Postgres mode) through psycopg 3 (async, the driver tokenward uses) and
   asyncpg, one at a time (p50 latency) and 32 at once over a pool of 4 (calls/s).
2. Ingest: the synthetic ledger of ``bench_reports.py`` (``--rows``) written as write-ahead-log
   segments of 100,000 rows and moved in by the flush's own insert (COPY into a staging table,
   ``INSERT ... ON CONFLICT DO NOTHING``): rows/s.
3. Reports: the local DuckDB copy synced from Postgres (cold, then after 10,000 new rows), then
   the reports of ``bench_reports.py`` on it and on the DuckDB file, and one report in
   Postgres's own SQL for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import statistics
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import psycopg  # noqa: E402
from bench_reports import generate, timed  # noqa: E402

from tokenward.reports import queries  # noqa: E402
from tokenward.reports.ledger import open_ledger  # noqa: E402
from tokenward.reports.ledger.postgres import PgLedger  # noqa: E402

START = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
RESERVE = "SELECT hold_id FROM tw_reserve($1, $2, $3::timestamptz[], $4::numeric[], $5::numeric[], false)"
SETTLE = "SELECT tw_settle($1, $2, $3, $4, $5::timestamptz[], $6::numeric[])"


async def psycopg_calls(url: str, n: int, concurrency: int) -> tuple[float, float, float]:
    from tokenward.reports.ledger.pg_pool import AsyncPool

    pool = AsyncPool(url, 4)
    args = ["bench", ["b1", "b2"], [START, START], [Decimal(10**9)] * 2, [Decimal("0.001")] * 2]

    async def one() -> float:
        started = time.perf_counter()
        async with pool.connection() as conn:
            row = await (
                await conn.execute(
                    RESERVE.replace("$1", "%s")
                    .replace("$2", "%s")
                    .replace("$3", "%s")
                    .replace("$4", "%s")
                    .replace("$5", "%s"),
                    args,
                )
            ).fetchone()
        async with pool.connection() as conn:
            await conn.execute(
                SETTLE.replace("$1", "%s")
                .replace("$2", "%s")
                .replace("$3", "%s")
                .replace("$4", "%s")
                .replace("$5", "%s")
                .replace("$6", "%s"),
                [row[0], None, START, ["b1"], [START], [Decimal("0.001")]],
            )
        return time.perf_counter() - started

    result = await run(one, n, concurrency)
    await pool.close()
    return result


async def asyncpg_calls(url: str, n: int, concurrency: int) -> tuple[float, float, float]:
    import asyncpg

    pool = await asyncpg.create_pool(url, min_size=4, max_size=4)
    args = ["bench", ["b1", "b2"], [START, START], [Decimal(10**9)] * 2, [Decimal("0.001")] * 2]

    async def one() -> float:
        started = time.perf_counter()
        async with pool.acquire() as conn:
            hold = await conn.fetchval(RESERVE, *args)
        async with pool.acquire() as conn:
            await conn.execute(SETTLE, hold, None, START, ["b1"], [START], [Decimal("0.001")])
        return time.perf_counter() - started

    result = await run(one, n, concurrency)
    await pool.close()
    return result


async def run(one, n: int, concurrency: int) -> tuple[float, float, float]:
    for _ in range(50):
        await one()  # warm-up: connections, prepared plans
    cpu = time.process_time()
    if concurrency == 1:
        samples = [await one() for _ in range(n)]
        return statistics.median(samples) * 1000, n / sum(samples), (time.process_time() - cpu) / n * 1000
    started = time.perf_counter()
    gate = asyncio.Semaphore(concurrency)

    async def gated() -> float:
        async with gate:
            return await one()

    samples = await asyncio.gather(*(gated() for _ in range(n)))
    rate = n / (time.perf_counter() - started)
    return statistics.median(samples) * 1000, rate, (time.process_time() - cpu) / n * 1000


def drivers(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO budget_replicas VALUES ('bench', now() + interval '1 day') ON CONFLICT DO NOTHING")
    print("reserve + settle (two books), one round trip each; CPU is this process's, per reserve + settle:")
    header = f"  {'driver':<10} {'p50 ms (1 at a time)':>21} {'CPU ms':>7}"
    print(header + f" {'calls/s (32 at once, pool of 4)':>32} {'CPU ms':>7}")
    for name, fn in (("psycopg 3", psycopg_calls), ("asyncpg", asyncpg_calls)):
        p50, _, cpu1 = asyncio.run(fn(url, 2000, 1))
        _, rate, cpu32 = asyncio.run(fn(url, 4000, 32))
        print(f"  {name:<10} {p50:>21.3f} {cpu1:>7.3f} {rate:>32,.0f} {cpu32:>7.3f}")


def ingest(url: str, duck: Path, scratch: Path, rows: int) -> PgLedger:
    ledger = PgLedger(url, scratch / "spool")
    ledger.migrate()
    conn = open_ledger(duck, read_only=True)
    casts = ", ".join(
        f"{c}::VARCHAR AS {c}"
        for c in ("cost_usd", "output_cost_usd", "cache_savings_usd", "provider_cost_usd", "reserved_usd")
    )
    size, seconds, inserted = 0, 0.0, 0
    path = scratch / "segment.rows.jsonl"
    with ledger.pool.connection() as pg:
        for offset in range(0, rows, 100_000):  # one segment at a time: written, then timed going in
            conn.execute(
                f"COPY (SELECT * REPLACE (epoch(started_at) AS started_at, epoch(ended_at) AS ended_at, {casts}) "
                f"FROM requests WHERE rowid >= {offset} AND rowid < {offset + 100_000}) TO '{path}' (FORMAT json)"
            )
            size += path.stat().st_size
            started = time.perf_counter()
            inserted += ledger._insert_files(pg, [path])
            seconds += time.perf_counter() - started
            path.unlink()
    conn.close()
    print(
        f"\ningest: {inserted:,} rows ({size / 1e6:,.0f} MB of log) in {seconds:.1f} s: "
        f"{inserted / seconds:,.0f} rows/s"
    )
    return ledger


def reports(ledger: PgLedger, duck: Path) -> None:
    started = time.perf_counter()
    conn = ledger.mirror.open()
    print(
        f"\nreport copy, first sync: {time.perf_counter() - started:.1f} s "
        f"({ledger.mirror.path.stat().st_size / 1e6:,.0f} MB)"
    )
    conn.close()
    ledger.write_rows([{**row, "request_id": f"new-{i}"} for i, row in enumerate(_sample_rows(10_000))])
    started = time.perf_counter()
    conn = ledger.mirror.open()
    print(f"report copy, sync after 10,000 new rows: {time.perf_counter() - started:.2f} s")
    conn.close()
    started = time.perf_counter()
    ledger.mirror.open().close()
    print(
        f"report copy, sync with nothing new (what every report pays): {(time.perf_counter() - started) * 1000:.0f} ms"
    )
    tz = "Europe/Paris"
    month = queries.Selection(None, None, {}, tz)
    cases = [
        ("by model", ["model"]),
        ("by day, model", ["day", "model"]),
        ("by key, top 10", ["key"]),
        ("by end user", ["end_user"]),
        ("by tag", ["tag"]),
    ]
    print(f"\n  {'report':<18} {'DuckDB file s':>14} {'Postgres (copy) s':>18}")
    for name, by in cases:
        figures = []
        top = 10 if name.endswith("top 10") else None
        for source in (lambda: open_ledger(duck, read_only=True), lambda: ledger.connect(read_only=True)):

            def once(source=source, by=by, top=top) -> None:
                conn = source()
                try:
                    conn.execute("SET threads = 1")
                    rows = queries.spend(conn, by, tz=tz, top=top)
                    queries.spend_totals(conn, month, groups=None if "tag" in by else rows)
                finally:
                    conn.close()

            figures.append(timed(once))
        print(f"  {name:<18} {figures[0]:>14.3f} {figures[1]:>18.3f}")
    with ledger.pool.connection() as pg:
        pg.execute("SET max_parallel_workers_per_gather = 0")
        started = time.perf_counter()
        pg.execute(
            "SELECT coalesce(served_model, requested_model, '(none)'), count(*), sum(input_tokens), "
            "sum(output_tokens), sum(cost_usd) FROM requests GROUP BY 1"
        ).fetchall()
        print(f"\n  by model in Postgres's own SQL (one core, no index): {time.perf_counter() - started:.3f} s")


def _sample_rows(n: int) -> list[dict]:
    sys.path.insert(0, str(HERE.parent))
    from tests.test_ledger import make_row

    now = time.time()
    return [make_row("x", started_at=now, ended_at=now + 1, served_model="gpt-4o") for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--url", help="an empty Postgres database (default: a throwaway cluster)")
    parser.add_argument("--drivers-only", action="store_true")
    args = parser.parse_args()
    cluster = None
    url = args.url
    if url is None:
        from tests.pgcluster import start_cluster

        cluster = start_cluster()
        if cluster is None:
            raise SystemExit("needs Debian's postgresql package (apt-get install -y postgresql), or --url")
        url = cluster.create_database("bench")
    try:
        with tempfile.TemporaryDirectory() as scratch_dir:
            scratch = Path(scratch_dir)
            PgLedger(url, scratch / "spool").migrate()
            drivers(url)
            if args.drivers_only:
                return
            duck = scratch / "bench.duckdb"
            seconds = generate(duck, args.rows)
            print(f"\ngenerated {args.rows:,} rows in DuckDB in {seconds:.1f} s")
            ledger = ingest(url, duck, scratch, args.rows)
            reports(ledger, duck)
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    main()
