"""What an open dashboard costs the request path. Prints figures; asserts nothing.

Starts the mock upstream and ``tokenward serve`` (with three budgets, so the live feed tracks
budget burn too), pinned as in ``bench_proxy.py``, then measures metered requests at
concurrency 1 and 16 in alternating rounds:

* ``no dashboard``: nobody polls;
* ``dashboard x2``: two browsers' worth of polling, ``GET /dashboard/api/state`` every 2 s each;
* ``stress x8 @ 100 ms``: eight pollers every 100 ms (40 times what two open pages do).

and reports p50/p99 latency, the proxy's CPU per request, the API's own latency and how many
ledger reads the dashboard made. Also the in-process cost of ``LiveFeed.add`` per row.

    .venv/bin/python bench/bench_dashboard.py [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

import aiohttp
from bench_proxy import BODY, cpu_seconds, pct, pin, wait_port

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def requests(url: str, concurrency: int, seconds: float) -> list[float]:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    headers = {"content-type": "application/json", "authorization": "Bearer sk-bench"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def worker() -> None:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                async with session.post(url, data=BODY, headers=headers) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                latencies.append((time.perf_counter() - t0) * 1000)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def pollers(url: str, count: int, every_s: float, stop: asyncio.Event, out: list[float]) -> None:
    async with aiohttp.ClientSession() as session:

        async def one(offset: float) -> None:
            await asyncio.sleep(offset)
            while not stop.is_set():
                t0 = time.perf_counter()
                async with session.get(url) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                out.append((time.perf_counter() - t0) * 1000)
                try:
                    await asyncio.wait_for(stop.wait(), every_s)
                except TimeoutError:
                    pass

        await asyncio.gather(*(one(every_s * i / count) for i in range(count)))


async def scenario(proxy_pid: int, base: str, concurrency: int, seconds: float, polling: tuple[int, float] | None):
    stop = asyncio.Event()
    api: list[float] = []
    task = None
    if polling:
        task = asyncio.create_task(pollers(f"{base}/dashboard/api/state", *polling, stop, api))
        await asyncio.sleep(0.2)
    before = cpu_seconds(proxy_pid)
    values = await requests(f"{base}/v1/chat/completions", concurrency, seconds)
    cpu = (cpu_seconds(proxy_pid) - before) / len(values) * 1000
    stop.set()
    if task:
        await task
    return values, cpu, api


def feed_cost() -> tuple[float, float]:
    sys.path.insert(0, str(HERE.parent))
    from tokenward.pricing.budgets import Budget
    from tokenward.proxy.live import LiveFeed
    from tokenward.reports.ledger import ROW_COLUMNS

    row = {name: None for name in ROW_COLUMNS}
    row.update(
        row_kind="request",
        cost_usd=Decimal("0.000120"),
        input_tokens=8,
        output_tokens=10,
        principal="fp-x",
        team="t",
        served_model="gpt-4o-2024-08-06",
        requested_model="gpt-4o",
    )
    budgets = [
        Budget("a", Decimal(1)),
        Budget("b", Decimal(1), scope=(("team", "t"),)),
        Budget("c", Decimal(1), scope=(("model", "gpt-4o"),)),
    ]
    result = []
    for tracked in ([], budgets):
        feed = LiveFeed(tracked)
        n = 200_000
        t0 = time.perf_counter()
        for i in range(n):
            feed.add([row], now=1000.0 + i / 1000)
        result.append((time.perf_counter() - t0) / n * 1e6)
    return result[0], result[1]


async def main(seconds: float, rounds: int) -> None:
    os.sched_setaffinity(0, {1}) if (os.cpu_count() or 1) > 1 else None
    tmp = Path(tempfile.mkdtemp(prefix="tokenward-dash-bench-"))
    upstream_port, proxy_port = free_port(), free_port()
    procs = []
    try:
        procs.append(
            subprocess.Popen(
                [*pin(1), sys.executable, str(HERE / "mock_upstream.py"), "--port", str(upstream_port)],
                stdout=subprocess.DEVNULL,
            )
        )
        config = tmp / "bench.yaml"
        config.write_text(
            f"upstreams:\n  - {{name: fast, base_url: 'http://127.0.0.1:{upstream_port}/v1', provider: openai, "
            "default: true}\n"
            f"ledger: {{path: '{tmp / 'bench.duckdb'}'}}\n"
            "budgets:\n"
            "  - {name: all-daily, limit_usd: 1000, period: day}\n"
            "  - {name: gpt4o-month, limit_usd: 5000, period: month, scope: {model: gpt-4o-mini}}\n"
            "  - {name: hourly, limit_usd: 100, period: rolling, rolling_hours: 1}\n"
        )
        proxy = subprocess.Popen(
            [
                *pin(0),
                sys.executable,
                "-m",
                "tokenward.proxy",
                "serve",
                "--config",
                str(config),
                "--port",
                str(proxy_port),
                "--log-level",
                "warning",
            ]
        )
        procs.append(proxy)
        wait_port(upstream_port)
        wait_port(proxy_port)
        base = f"http://127.0.0.1:{proxy_port}"
        await requests(f"{base}/v1/chat/completions", 8, 2.0)  # warm up, and rows for the ledger queries
        print(
            f"dashboard cost on the request path ({os.cpu_count()} cores, proxy pinned to CPU 0), "
            f"{rounds} alternating rounds of {seconds:.0f} s\n"
        )
        variants = {"no dashboard": None, "dashboard x2 @ 2 s": (2, 2.0), "stress x8 @ 100 ms": (8, 0.1)}
        for concurrency in (1, 16):
            found: dict[str, tuple[list[float], list[float], list[float]]] = {k: ([], [], []) for k in variants}
            for _ in range(rounds):
                for label, polling in variants.items():
                    values, cpu, api = await scenario(proxy.pid, base, concurrency, seconds, polling)
                    found[label][0].extend(values)
                    found[label][1].append(cpu)
                    found[label][2].extend(api)
            baseline = statistics.median(found["no dashboard"][0])
            for label, (values, cpus, api) in found.items():
                line = (
                    f"  c={concurrency:<3} {label:<20} p50 {statistics.median(values):7.3f} ms  "
                    f"p99 {pct(values, 99):7.3f} ms  CPU {statistics.median(cpus):.3f} ms/req  "
                    f"({len(values) / (seconds * rounds):6.0f} req/s)"
                )
                if api:
                    line += (
                        f"  +{statistics.median(values) - baseline:6.3f} ms p50;  API p50 "
                        f"{statistics.median(api):.2f} ms p99 {pct(api, 99):.2f} ms ({len(api)} polls)"
                    )
                print(line)
        async with aiohttp.ClientSession() as session, session.get(f"{base}/dashboard/api/state") as resp:
            body = json.loads(await resp.read())
        print(
            f"\nstate document: {len(json.dumps(body)) / 1024:.1f} KB; ledger rows today: "
            f"{body['ledger']['today']['requests']}; a ledger read took {body['ledger']['query_ms']:.0f} ms "
            "(in a worker thread; repeated every 5 s at most)"
        )
        plain, tracked = feed_cost()
        print(f"LiveFeed.add per row: {plain:.2f} us without budgets, {tracked:.2f} us with 3 budgets")
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.seconds, args.rounds))
