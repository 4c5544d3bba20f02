"""How much tokenward adds over calling the upstream directly. Prints figures; asserts nothing.

Starts two mock upstreams (``bench/mock_upstream.py``: one answering at once, one after 50 ms,
as a model's time to first token)
and ``tokenward serve`` in front of them; pins the proxy to CPU 0 and the mocks and this load
generator to CPU 1 when the machine has two cores. Then measures, for the direct path, the
metered path (``/v1/chat/completions``) and the unmetered pass-through path (metering off):

* latency p50/p99 at concurrency 1 and 64, and requests per second at concurrency 64;
* CPU time of the proxy process per request (from /proc, user + system);
* time to first byte of 1 and of 100 concurrent streams, and whether events arrive one per
  read (not bunched).

    .venv/bin/python bench/bench_proxy.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
TICKS = os.sysconf("SC_CLK_TCK")
BODY = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello in one sentence."}]})
STREAM_BODY = json.dumps(
    {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Count to twenty."}]}
)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def pin(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if (os.cpu_count() or 1) > 1 and _has("taskset") else []


def _has(tool: str) -> bool:
    return any((Path(p) / tool).exists() for p in os.environ.get("PATH", "").split(":"))


def wait_port(port: int, timeout: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open")


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def load(url: str, concurrency: int, seconds: float, body: str, upstream: str = "fast") -> list[float]:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    headers = {"content-type": "application/json", "authorization": "Bearer sk-bench", "x-tokenward-upstream": upstream}
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                latencies.append((time.perf_counter() - t0) * 1000)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def streams(url: str, concurrency: int) -> tuple[list[float], float]:
    """Time to first event (ms) per stream, and the share of reads that carried more than one event."""
    ttfb: list[float] = []
    reads = bunched = 0
    headers = {"content-type": "application/json", "authorization": "Bearer sk-bench", "x-tokenward-upstream": "slow"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one() -> None:
            nonlocal reads, bunched
            t0 = time.perf_counter()
            first = None
            async with session.post(url, data=STREAM_BODY, headers=headers) as resp:
                async for data in resp.content.iter_any():
                    if first is None and b"data:" in data:
                        first = (time.perf_counter() - t0) * 1000
                    events = data.count(b"data:")
                    reads += 1
                    bunched += events > 1
            ttfb.append(first or float("nan"))

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return ttfb, bunched / max(reads, 1)


def row(label: str, values: list[float], seconds: float | None = None) -> str:
    text = f"{label:<34} p50 {statistics.median(values):8.3f} ms   p99 {pct(values, 99):8.3f} ms"
    if seconds:
        text += f"   {len(values) / seconds:8.0f} req/s"
    return text


async def main(seconds: float) -> None:
    os.sched_setaffinity(0, {1}) if (os.cpu_count() or 1) > 1 else None
    tmp = Path(tempfile.mkdtemp(prefix="tokenward-bench-"))
    procs = []
    try:
        for port, delay in ((9101, 0), (9102, 50)):
            procs.append(
                subprocess.Popen(
                    [
                        *pin(1),
                        sys.executable,
                        str(HERE / "mock_upstream.py"),
                        "--port",
                        str(port),
                        "--delay-ms",
                        str(delay),
                        "--events",
                        "20",
                        "--gap-ms",
                        "20",
                    ],
                    stdout=subprocess.DEVNULL,
                )
            )
        config = tmp / "bench.yaml"
        config.write_text(
            "upstreams:\n"
            "  - {name: fast, base_url: 'http://127.0.0.1:9101/v1', provider: openai, default: true}\n"
            "  - {name: slow, base_url: 'http://127.0.0.1:9102/v1', provider: openai}\n"
            f"ledger: {{path: '{tmp / 'bench.duckdb'}'}}\n"
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
                "9200",
                "--log-level",
                "warning",
            ]
        )
        procs.append(proxy)
        for port in (9101, 9102, 9200):
            wait_port(port)
        direct = {
            "fast": "http://127.0.0.1:9101/v1/chat/completions",
            "slow": "http://127.0.0.1:9102/v1/chat/completions",
        }
        metered = "http://127.0.0.1:9200/v1/chat/completions"
        unmetered = "http://127.0.0.1:9200/v1/bench-passthrough/chat/completions"
        await load(metered, 8, 1.0, BODY)  # warm up
        await load(unmetered, 8, 1.0, BODY)

        print(f"tokenward benchmark ({os.cpu_count()} cores; proxy pinned to CPU 0), {seconds:.0f} s per scenario\n")
        print("latency, upstream answering at once")
        for c in (1, 64):
            results = {}
            for label, url in (
                ("direct", direct["fast"]),
                ("metered", metered),
                ("unmetered (pass-through)", unmetered),
            ):
                before = cpu_seconds(proxy.pid)
                values = await load(url, c, seconds, BODY)
                cpu = (cpu_seconds(proxy.pid) - before) / len(values) * 1000
                results[label] = values
                extra = f"   proxy CPU {cpu:.3f} ms/req" if label != "direct" else ""
                print(row(f"  c={c:<3} {label}", values, seconds) + extra)
            for label in ("metered", "unmetered (pass-through)"):
                added = statistics.median(results[label]) - statistics.median(results["direct"])
                print(f"  c={c:<3} added p50 by {label}: {added:.3f} ms")
        print("\nthroughput, upstream answering after 50 ms, concurrency 64")
        for label, url in (("direct", direct["slow"]), ("metered", metered), ("unmetered", unmetered)):
            before = cpu_seconds(proxy.pid)
            values = await load(url, 64, seconds, BODY, upstream="slow")
            cpu = (cpu_seconds(proxy.pid) - before) / len(values) * 1000
            extra = f"   proxy CPU {cpu:.3f} ms/req" if label != "direct" else ""
            print(row(f"  {label}", values, seconds) + extra)
        print("\nstreams: first event after 50 ms, then 20 events 20 ms apart")
        for c in (1, 100):
            await streams(metered, c)  # warm the connection pools
            d_ttfb, d_bunch = await streams(direct["slow"], c)
            p_ttfb, p_bunch = await streams(metered, c)
            print(
                f"  {c:>3} concurrent: first event direct p50 {statistics.median(d_ttfb):.2f} ms, via tokenward "
                f"p50 {statistics.median(p_ttfb):.2f} ms p99 {pct(p_ttfb, 99):.2f} ms "
                f"(added p50 {statistics.median(p_ttfb) - statistics.median(d_ttfb):.2f} ms); "
                f"reads with >1 event: direct {d_bunch:.0%}, tokenward {p_bunch:.0%}"
            )
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)  # the proxy drains and exits; the mock upstream just exits
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    asyncio.run(main(parser.parse_args().seconds))
