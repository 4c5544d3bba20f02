"""tokenward against the floor: calling the upstream directly, a bare Python relay, and tokenward, in one run.

The protocol of issue 13 (prints figures; asserts nothing):

* the upstream mock and the load generator share CPU 0; each gateway is pinned to CPU 1 (taskset);
* the mock is nginx (Debian's package, with its echo module for the 50 ms delays and the SSE
  events); without the echo module nginx serves the instant replies and hands the delayed ones
  to ``bench/mock_upstream.py``; without nginx that Python mock serves everything (and may
  itself be the limit at high rates: the script says which mock ran);
* the load generator is wrk (Debian's package); without it, an aiohttp loop in this process;
* gateways, each measured on the same requests in turn, every scenario repeated ``--repeat``
  times: ``direct`` (no gateway), ``relay`` (``bench/bare_relay.py``: aiohttp client under
  uvicorn with uvloop and httptools, bytes relayed, no parsing), ``tokenward`` (metering on,
  passthrough auth, no budgets), ``tokenward+budget`` (one blocking budget covering all
  traffic, far from its limit: every request is bounded by its bytes) and ``tokenward+count``
  (the same with ``guard.bytes_bound_share: 0``, so the worst-case token count runs on every
  request, as it does near a limit); with ``--postgres``, the first two on a
  Postgres ledger (``tokenward-pg``, ``tokenward+budget-pg``: rows COPYed in by the flush, the
  budget reserved and settled in the database, one round trip each) on a throwaway cluster whose
  server processes share CPU 0 with the mock;
* latency figures are added over ``direct`` measured next to them; CPU per request is the
  gateway process's own user + system time (``/proc/<pid>/stat``, all threads) over the run,
  divided by the requests wrk completed; RSS idle is read after start (no request yet), peak is
  the process's high-water mark (``VmHWM``) at the end; "private RSS" is ``RssAnon``, the part that
  is not file-backed (DuckDB's shared library alone puts ~40 MB of code pages in RSS once a
  connection has been opened: shared with every process using it, and reclaimable).

Upstream replies: ``fast`` at once, ``slow`` after 50 ms, ``stream`` after 50 ms then 20 content
events, a usage event and ``[DONE]``, each 20 ms after the one before. The client asks for
stream usage itself (``stream_options.include_usage``), so every path carries the same bytes.

    make bench            # or: .venv/bin/python bench/bench_floor.py [--seconds 5] [--repeat 2]
    apt-get install -y nginx libnginx-mod-http-echo wrk     # the tools the protocol wants
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from mock_upstream import DONE, REPLY, event  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
MOCK_PORT, PY_MOCK_PORT, RELAY_PORT, TW_PORT, TW_BUDGET_PORT = 9301, 9302, 9401, 9402, 9403
TW_PG_PORT, TW_PG_BUDGET_PORT, TW_COUNT_PORT = 9404, 9405, 9406
ECHO_MODULE = Path("/usr/lib/nginx/modules/ngx_http_echo_module.so")
EVENTS, GAP_S, DELAY_S = 20, 0.020, 0.050
HEADERS = {"content-type": "application/json", "authorization": "Bearer sk-bench-0123456789"}


def body(stream: bool = False, size: int = 0) -> bytes:
    text = "Say hello in one sentence."
    if size:
        text += " lorem ipsum" * ((size - 120) // 12)
    doc: dict = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]}
    if stream:
        doc |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(doc, separators=(",", ":")).encode()


# ---------------------------------------------------------------- processes


def two_cores() -> bool:
    return len(os.sched_getaffinity(0)) > 1 and shutil.which("taskset") is not None


def pinned(cpu: int, argv: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *argv] if two_cores() else argv


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its live descendants (tokenward's mover child, say), from ``/proc``."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += parents.get(current, [])
    return found


def cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants: live ones, and those it has reaped (cutime, cstime)."""
    total = 0
    for member in tree_pids(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(fields[i]) for i in (11, 12, 13, 14))
    return total / TICKS


def tree_memory_mb(pid: int, field_name: str) -> float:
    """``field_name`` (``VmRSS``, ``RssAnon``, ``VmHWM``) added over ``pid`` and its live descendants.

    For ``VmHWM`` the sum is an upper bound of the tree's peak (each member's own peak, whenever it came).
    """
    total = 0.0
    for member in tree_pids(pid):
        try:
            total += memory_mb(member, field_name)
        except OSError:
            pass
    return total


def pss_mb(pid: int) -> float:
    """Proportional set size of ``pid`` and its live descendants (shared pages split between their users)."""
    total = 0.0
    for member in tree_pids(pid):
        try:
            for line in Path(f"/proc/{member}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def memory_mb(pid: int, field_name: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def core_busy() -> list[tuple[int, int]]:
    """(busy, total) jiffies per CPU, from /proc/stat."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            values = [int(v) for v in line.split()[1:]]
            idle = values[3] + values[4]
            out.append((sum(values) - idle, sum(values)))
    return out


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode} before opening port {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open")


class Processes:
    """Every process the benchmark starts; all of them are stopped on exit, whatever happens."""

    def __init__(self) -> None:
        self.procs: list[tuple[subprocess.Popen, bool]] = []  # (process, is a mock)

    def start(self, argv: list[str], port: int, *, mock: bool = False, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)
        self.procs.append((proc, mock))
        wait_port(port, proc)
        return proc

    def stop(self) -> None:
        """Gateways first (tokenward drains and flushes its ledger), then the mocks they may still be reading."""
        for mocks in (False, True):
            group = [proc for proc, mock in self.procs if mock is mocks and proc.poll() is None]
            for proc in group:
                proc.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        self.procs.clear()


# ---------------------------------------------------------------- the upstream mock


def nginx_conf(tmp: Path, echo: bool) -> str:
    def quoted(data: bytes) -> str:
        text = data.decode()
        assert "'" not in text and "$" not in text and "\\" not in text, "the canned replies need nginx quoting"
        return "'" + text.replace("\n", "\\n") + "'"

    stream = [f"echo_sleep {DELAY_S};"]
    events = [event(i, False) for i in range(EVENTS)] + [event(EVENTS, True), DONE]
    for i, data in enumerate(events):
        stream.append(f"echo -n {quoted(data)}; echo_flush;")
        if i < len(events) - 1:
            stream.append(f"echo_sleep {GAP_S};")
    if echo:
        slow = f"default_type application/json; echo_sleep {DELAY_S}; echo -n {quoted(REPLY)};"
        stream_location = "default_type text/event-stream; " + " ".join(stream)
    else:
        slow = stream_location = f"proxy_pass http://python_mock; {_NGINX_PROXY}"
    return f"""
{f"load_module {ECHO_MODULE};" if echo else ""}
daemon off;
master_process off;
worker_processes 1;
error_log {tmp}/nginx-error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/nginx-body;
  proxy_temp_path {tmp}/nginx-proxy;
  keepalive_requests 10000000;
  keepalive_timeout 300s;
  upstream python_mock {{ server 127.0.0.1:{PY_MOCK_PORT}; keepalive 512; }}
  server {{
    listen 127.0.0.1:{MOCK_PORT} backlog=8192;
    location /fast/ {{ default_type application/json; return 200 {quoted(REPLY)}; }}
    location /slow/ {{ {slow} }}
    location /stream/ {{ {stream_location} }}
  }}
}}
"""


_NGINX_PROXY = "proxy_http_version 1.1; proxy_set_header Connection ''; proxy_buffering off;"


def start_mock(procs: Processes, tmp: Path, force_python: bool = False) -> tuple[str, subprocess.Popen]:
    """Start the upstream mock on CPU 0; returns its description and its (main) process."""
    nginx = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)
    nginx = None if force_python else nginx
    python_mock = [sys.executable, str(HERE / "mock_upstream.py"), "--delay-ms", str(DELAY_S * 1000)]
    python_mock += ["--events", str(EVENTS), "--gap-ms", str(GAP_S * 1000)]
    if nginx is None:
        if not force_python:
            print("! nginx not found (apt-get install -y nginx libnginx-mod-http-echo): the Python mock serves all")
        argv = pinned(0, [*python_mock, "--port", str(MOCK_PORT)])
        proc = procs.start(argv, MOCK_PORT, mock=True, stdout=subprocess.DEVNULL)
        return "Python mock (bench/mock_upstream.py)", proc
    echo = ECHO_MODULE.exists()
    if not echo:
        print("! nginx's echo module is missing (apt-get install -y libnginx-mod-http-echo): nginx serves the")
        print("  instant replies and hands the 50 ms ones and the streams to the Python mock")
        argv = pinned(0, [*python_mock, "--port", str(PY_MOCK_PORT)])
        procs.start(argv, PY_MOCK_PORT, mock=True, stdout=subprocess.DEVNULL)
    conf = tmp / "nginx.conf"
    conf.write_text(nginx_conf(tmp, echo))
    argv = pinned(0, [nginx, "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "nginx-error.log")])
    proc = procs.start(argv, MOCK_PORT, mock=True)
    return ("nginx (echo module for delays and SSE)" if echo else "nginx + Python mock for delays and SSE"), proc


# ---------------------------------------------------------------- gateways


@dataclass
class Gateway:
    name: str
    url: Callable[[str], str]  # kind (fast/slow/stream) -> URL of the chat completions endpoint
    headers: Callable[[str], dict[str, str]]
    pid: int | None = None
    rss_idle: float = float("nan")
    anon_idle: float = float("nan")  # RssAnon: the private part of rss_idle (no shared library code pages)


def tokenward_config(tmp: Path, name: str, budget: bool | str, url: str | None = None) -> Path:
    """A config for one tokenward; ``budget``: one blocking budget over all traffic (``"count"``: with
    ``guard.bytes_bound_share: 0``, so the worst-case token count runs on every request)."""
    base = f"http://127.0.0.1:{MOCK_PORT}"
    lines = ["upstreams:"]
    for kind in ("fast", "slow", "stream"):
        default = ", default: true" if kind == "fast" else ""
        lines.append(f"  - {{name: {kind}, base_url: '{base}/{kind}/v1', provider: openai{default}}}")
    if url:
        lines.append(f"ledger: {{url: '{url}', spool_dir: '{tmp / (name + '.spool')}'}}")
    else:
        lines.append(f"ledger: {{path: '{tmp / (name + '.duckdb')}'}}")
    if budget:  # never reached: the point is the bound on every request
        lines += ["budgets:", "  - {name: bench-block, limit_usd: 1000000000, period: month, action: block}"]
    if budget == "count":  # far from the limit the body's bytes bound it; this counts its tokens all the same
        lines += ["guard: {bytes_bound_share: 0}"]
    path = tmp / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def start_gateways(procs: Processes, tmp: Path, names: list[str], pg_url: str | None = None) -> list[Gateway]:
    mock = f"http://127.0.0.1:{MOCK_PORT}"
    plain = lambda kind: HEADERS  # noqa: E731
    gateways = [Gateway("direct", lambda kind: f"{mock}/{kind}/v1/chat/completions", plain)]
    if "relay" in names:
        argv = [sys.executable, str(HERE / "bare_relay.py"), "--port", str(RELAY_PORT), "--upstream", mock]
        proc = procs.start(pinned(1, argv), RELAY_PORT)
        relay = f"http://127.0.0.1:{RELAY_PORT}"
        gateways.append(Gateway("relay", lambda kind: f"{relay}/{kind}/v1/chat/completions", plain, proc.pid))
    tokenwards = [
        ("tokenward", TW_PORT, False, None),
        ("tokenward+budget", TW_BUDGET_PORT, True, None),
        ("tokenward+count", TW_COUNT_PORT, "count", None),
    ]
    if pg_url:
        tokenwards += [
            ("tokenward-pg", TW_PG_PORT, False, pg_url),
            ("tokenward+budget-pg", TW_PG_BUDGET_PORT, True, pg_url),
        ]
    for name, port, budget, url in tokenwards:
        if name not in names:
            continue
        config = tokenward_config(tmp, name.replace("+", "-"), budget, url)
        argv = [sys.executable, "-m", "tokenward.proxy", "serve", "--config", str(config), "--port", str(port)]
        with open(tmp / f"{name}.log", "w") as log:  # shown if it fails to start
            proc = procs.start(pinned(1, [*argv, "--log-level", "warning"]), port, stderr=log)
        base = f"http://127.0.0.1:{port}"
        gateways.append(
            Gateway(
                name,
                lambda kind, base=base: f"{base}/v1/chat/completions",
                lambda kind: HEADERS | {"x-tokenward-upstream": kind},
                proc.pid,
            )
        )
    time.sleep(1.0)  # let start-up work (scheduler, first ledger flush) settle before reading idle RSS
    for gateway in gateways:
        if gateway.pid is not None:
            gateway.rss_idle = tree_memory_mb(gateway.pid, "VmRSS")  # with tokenward's mover child, if running
            gateway.anon_idle = tree_memory_mb(gateway.pid, "RssAnon")
    return gateways


# ---------------------------------------------------------------- load generators


@dataclass
class Load:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


_WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [==[{body}]==]
{headers}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("WRKJSON {{\\"requests\\": %d, \\"duration_us\\": %d, \\"p50_us\\": %d, \\"p99_us\\": %d, "
    .. "\\"errors\\": %d}}\\n", summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def wrk_load(tmp: Path, url: str, headers: dict[str, str], payload: bytes, concurrency: int, seconds: float) -> Load:
    script = tmp / "load.lua"
    lines = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
    script.write_text(_WRK_SCRIPT.format(body=payload.decode(), headers=lines))
    argv = [
        "wrk",
        "-t1",
        f"-c{concurrency}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "-s",
        str(script),
        url,
    ]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("WRKJSON "))
    data = json.loads(line.removeprefix("WRKJSON "))
    return Load(
        data["requests"], data["duration_us"] / 1e6, data["p50_us"] / 1000, data["p99_us"] / 1000, data["errors"]
    )


async def _python_load(url: str, headers: dict[str, str], payload: bytes, concurrency: int, seconds: float) -> Load:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    stop = start + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                async with session.post(url, data=payload, headers=headers) as resp:
                    await resp.read()
                    errors += resp.status != 200
                latencies.append((time.perf_counter() - t0) * 1000)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return Load(len(latencies), time.perf_counter() - start, statistics.median(ordered), p99, errors)


def python_load(tmp: Path, url: str, headers: dict[str, str], payload: bytes, concurrency: int, seconds: float) -> Load:
    return asyncio.run(_python_load(url, headers, payload, concurrency, seconds))


@dataclass
class Streams:
    ttfe_p50_ms: float
    ttfe_p99_ms: float
    merged: int  # reads that carried more than one event
    reads: int
    errors: int


async def _one_stream(url: str, headers: dict[str, str], payload: bytes, start: asyncio.Event) -> tuple:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = f"POST {parts.path} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-length: {len(payload)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    request = head.encode() + payload
    await start.wait()
    t0 = time.perf_counter()
    writer.write(request)
    first = None
    reads = merged = 0
    seen = b""
    try:
        async with asyncio.timeout(30):
            while not seen.endswith(b"0\r\n\r\n"):
                data = await reader.read(65536)
                if not data:
                    break
                events = data.count(b"data:")
                if events and first is None:
                    first = (time.perf_counter() - t0) * 1000
                reads += events > 0
                merged += events > 1
                seen = (seen + data)[-16:]
    finally:
        writer.close()
    return first, reads, merged


async def _streams(url: str, headers: dict[str, str], payload: bytes, concurrency: int) -> Streams:
    start = asyncio.Event()
    tasks = [asyncio.ensure_future(_one_stream(url, headers, payload, start)) for _ in range(concurrency)]
    await asyncio.sleep(0.3)  # every connection open before the first request goes
    start.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    good = [r for r in results if isinstance(r, tuple) and r[0] is not None]
    firsts = sorted(r[0] for r in good)
    p99 = firsts[min(len(firsts) - 1, int(0.99 * len(firsts)))] if firsts else float("nan")
    return Streams(
        statistics.median(firsts) if firsts else float("nan"),
        p99,
        sum(r[2] for r in good),
        sum(r[1] for r in good),
        len(results) - len(good),
    )


def streams(url: str, headers: dict[str, str], payload: bytes, concurrency: int) -> Streams:
    try:
        import uvloop

        return uvloop.run(_streams(url, headers, payload, concurrency))
    except ImportError:
        return asyncio.run(_streams(url, headers, payload, concurrency))


# ---------------------------------------------------------------- scenarios and the table


@dataclass
class Sample:
    load: Load | None = None
    streams: Streams | None = None
    cpu_ms: float = float("nan")
    mock_cpu_ms: float = float("nan")
    core_busy: list[float] = field(default_factory=list)
    rss_mb: float = float("nan")  # the gateway's RSS right after the scenario
    anon_mb: float = float("nan")  # its private part (RssAnon)


SCENARIOS = {  # name: (kind, concurrency, body)
    "c1": ("fast", 1, body()),
    "c1_4k": ("fast", 1, body(size=4096)),
    "c64": ("slow", 64, body()),
    "c128": ("slow", 128, body()),
    "c64_stream": ("stream", 64, body(stream=True)),
}


def measure(run_load, tmp: Path, gateway: Gateway, mock_pid: int, scenario: str, seconds: float) -> Sample:
    before_cores = core_busy()
    before = cpu_seconds(gateway.pid) if gateway.pid else 0.0
    before_mock = cpu_seconds(mock_pid)
    if scenario == "streams100":
        result = streams(gateway.url("stream"), gateway.headers("stream"), body(stream=True), 100)
        sample = Sample(streams=result)
        count = 100
    else:
        kind, concurrency, payload = SCENARIOS[scenario]
        result = run_load(tmp, gateway.url(kind), gateway.headers(kind), payload, concurrency, seconds)
        sample = Sample(load=result)
        count = max(result.requests, 1)
    if gateway.pid:
        sample.cpu_ms = (cpu_seconds(gateway.pid) - before) / count * 1000
        sample.rss_mb = tree_memory_mb(gateway.pid, "VmRSS")
        sample.anon_mb = tree_memory_mb(gateway.pid, "RssAnon")
    sample.mock_cpu_ms = (cpu_seconds(mock_pid) - before_mock) / count * 1000
    after_cores = core_busy()
    sample.core_busy = [
        100 * (b1 - b0) / max(t1 - t0, 1) for (b0, t0), (b1, t1) in zip(before_cores, after_cores, strict=False)
    ]
    return sample


def spread(values: list[float], fmt: str) -> str:
    values = [v for v in values if v == v]  # drop NaN
    if not values:
        return "-"
    text = format(statistics.median(values), fmt)
    if len(values) > 1:
        text += f" [{format(min(values), fmt)}..{format(max(values), fmt)}]"
    return text


def ratio(values: list[float], floor: list[float], fmt: str = ".2f") -> str:
    """The median ratio to the relay, or, when the relay's figure is not above 0 (an added latency that
    came out at or under calling directly, say), the median difference, signed, in the row's unit."""
    pairs = [(v, f) for v, f in zip(values, floor, strict=False) if v == v and f == f]
    if not pairs:
        return "-"
    if all(f > 0 for _, f in pairs):
        return f"{statistics.median(v / f for v, f in pairs):.2f}x"
    return format(statistics.median(v - f for v, f in pairs), "+" + fmt.lstrip("+,"))


Results = dict[str, dict[str, list[Sample]]]  # gateway -> scenario -> one sample per repeat


def rows(results: Results, gateways: list[Gateway]) -> list[tuple[str, str, Callable[[str, int], float], bool]]:
    """(label, format, value(gateway, repeat), shown for direct)."""

    def load(g: str, r: int, s: str) -> Load:
        return results[g][s][r].load  # type: ignore[return-value]

    def added(s: str, attr: str, scale: float) -> Callable[[str, int], float]:
        return lambda g, r: (getattr(load(g, r, s), attr) - getattr(load("direct", r, s), attr)) * scale

    def stream(g: str, r: int) -> Streams:
        return results[g]["streams100"][r].streams  # type: ignore[return-value]

    peak = {g.name: g for g in gateways}
    return [
        ("added p50 at c=1 (us)", ",.0f", added("c1", "p50_ms", 1000), False),
        ("added p99 at c=1 (us)", ",.0f", added("c1", "p99_ms", 1000), False),
        ("added p50 at c=1, 4 KB request (us)", ",.0f", added("c1_4k", "p50_ms", 1000), False),
        ("gateway CPU per request at c=64, 50 ms (ms)", ".3f", lambda g, r: results[g]["c64"][r].cpu_ms, False),
        ("gateway CPU per request at c=128, 50 ms (ms)", ".3f", lambda g, r: results[g]["c128"][r].cpu_ms, False),
        (
            "gateway CPU per streamed request at c=64 (ms)",
            ".3f",
            lambda g, r: results[g]["c64_stream"][r].cpu_ms,
            False,
        ),
        ("requests/s at c=64, 50 ms upstream", ",.0f", lambda g, r: load(g, r, "c64").rps, True),
        ("requests/s at c=128, 50 ms upstream", ",.0f", lambda g, r: load(g, r, "c128").rps, True),
        ("added p99 at c=64, 50 ms upstream (ms)", "+.1f", added("c64", "p99_ms", 1), False),
        ("streamed requests/s at c=64", ",.0f", lambda g, r: load(g, r, "c64_stream").rps, True),
        (
            "100 streams: added first-event p99 (ms)",
            "+.1f",
            lambda g, r: stream(g, r).ttfe_p99_ms - stream("direct", r).ttfe_p99_ms,
            False,
        ),
        ("100 streams: merged events (reads > 1 event)", ",.0f", lambda g, r: stream(g, r).merged, True),
        ("RSS idle (MB)", ".0f", lambda g, r: peak[g].rss_idle, False),
        (
            "RSS peak (MB)",
            ".0f",
            lambda g, r: tree_memory_mb(peak[g].pid, "VmHWM") if peak[g].pid else float("nan"),
            False,
        ),
        ("private RSS idle (MB, RssAnon)", ".0f", lambda g, r: peak[g].anon_idle, False),
        (
            "private RSS, largest after a scenario (MB)",
            ".0f",
            lambda g, r: max((v[r].anon_mb for v in results[g].values() if len(v) > r), default=float("nan")),
            False,
        ),
    ]


def table(results: Results, gateways: list[Gateway], repeat: int) -> str:
    names = [g.name for g in gateways]
    header = ["", *names]
    if "relay" in names:
        header[2:] = [h for name in names[1:] for h in ([name] if name == "relay" else [name, "/relay"])]
    lines = [header]
    for label, fmt, value, for_direct in rows(results, gateways):
        line = [label]
        floor = [value("relay", r) for r in range(repeat)] if "relay" in names else None
        for name in names:
            values = [value(name, r) for r in range(repeat)] if (name != "direct" or for_direct) else []
            line.append(spread(values, fmt))
            if floor is not None and name not in ("direct", "relay"):
                line.append(ratio(values, floor, fmt))
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = []
    for i, row in enumerate(lines):
        out.append(" | ".join(cell.ljust(widths[j]) if j == 0 else cell.rjust(widths[j]) for j, cell in enumerate(row)))
        if i == 0:
            out.append("-+-".join("-" * w for w in widths))
    return "\n".join(out)


def direct_figures(results: Results, repeat: int) -> str:
    def med(s: str, get: Callable) -> str:
        return spread([get(results["direct"][s][r]) for r in range(repeat)], ".2f")

    return (
        f"direct (absolute): c=1 p50 {med('c1', lambda x: x.load.p50_ms)} ms, p99 {med('c1', lambda x: x.load.p99_ms)}"
        f" ms; c=64 p99 {med('c64', lambda x: x.load.p99_ms)} ms; 100 streams first event p99 "
        f"{med('streams100', lambda x: x.streams.ttfe_p99_ms)} ms"
    )


def rss_note(results: Results, gateways: list[Gateway]) -> str:
    lines = [
        "RSS (MB; private RssAnon in brackets: the rest is shared library code, such as DuckDB's) after each"
        " scenario of the first run:"
    ]
    for gateway in gateways:
        if gateway.pid:
            steps = ", ".join(f"{s} {v[0].rss_mb:.0f} [{v[0].anon_mb:.0f}]" for s, v in results[gateway.name].items())
            lines.append(f"  {gateway.name}: idle {gateway.rss_idle:.0f} [{gateway.anon_idle:.0f}], {steps}")
    return "\n".join(lines)


def busy_note(results: Results) -> str:
    worst = []
    for gateway, scenarios in results.items():
        for scenario, samples in scenarios.items():
            if scenario in ("c1", "c1_4k"):  # a closed loop at c=1 keeps CPU 0 busy by design
                continue
            for sample in samples:
                if len(sample.core_busy) > 1 and sample.core_busy[0] > 90:
                    worst.append(f"{gateway}/{scenario} ({sample.core_busy[0]:.0f}%)")
    if not worst:
        return "CPU 0 (mock + load generator) stayed under 90% busy in every load scenario."
    return "! CPU 0 (mock + load generator) was over 90% busy in: " + ", ".join(sorted(set(worst))[:8])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per load run (default 5)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of every scenario (default 2; medians printed)")
    parser.add_argument(
        "--gateways",
        default="relay,tokenward,tokenward+budget,tokenward+count",
        help="comma-separated: relay, tokenward, tokenward+budget, tokenward+count",
    )
    parser.add_argument(
        "--postgres",
        action="store_true",
        help="also run tokenward-pg and tokenward+budget-pg on a throwaway Postgres cluster (Debian's postgresql)",
    )
    parser.add_argument("--json", type=Path, help="also write every sample to this file")
    parser.add_argument(
        "--python-tools", action="store_true", help="use the Python mock and loader even if nginx/wrk exist"
    )
    args = parser.parse_args()
    names = [n.strip() for n in args.gateways.split(",") if n.strip()]
    if args.postgres and args.gateways == parser.get_default("gateways"):
        names += ["tokenward-pg", "tokenward+budget-pg"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below
    if two_cores():
        os.sched_setaffinity(0, {0})  # this process (stream client, fallback loader) shares CPU 0 with the mock
    else:
        print("! fewer than 2 cores (or no taskset): nothing is pinned, figures mix gateway and load")
    run_load = wrk_load if shutil.which("wrk") and not args.python_tools else python_load
    if run_load is python_load and not args.python_tools:
        print(
            "! wrk not found (apt-get install -y wrk): an aiohttp loop generates the load (slower; it may be the limit)"
        )
    tmp = Path(tempfile.mkdtemp(prefix="tokenward-floor-"))
    procs = Processes()
    cluster = None
    try:
        pg_url = None
        if args.postgres:
            cluster, pg_url = start_postgres()
        mock_name, mock = start_mock(procs, tmp, args.python_tools)
        gateways = start_gateways(procs, tmp, names, pg_url)
        for gateway in gateways:  # warm up: connection pools, first-use imports, the tokenizer
            for scenario in ("c64", "c64_stream", "c1_4k"):
                kind, concurrency, payload = SCENARIOS[scenario]
                run_load(tmp, gateway.url(kind), gateway.headers(kind), payload, concurrency, 1)
            streams(gateway.url("stream"), gateway.headers("stream"), body(stream=True), 100)
        print(
            f"tokenward floor benchmark: {mock_name} and {'wrk' if run_load is wrk_load else 'aiohttp'} on CPU 0, "
            f"each gateway on CPU 1; {args.seconds:g} s per load run, {args.repeat} run(s) of each, "
            f"median [min..max]; ratios are to the bare relay (a signed difference where the relay's figure"
            f" is 0 or less)\n"
        )
        results: Results = {g.name: {} for g in gateways}
        for repeat in range(args.repeat):
            for scenario in (*SCENARIOS, "streams100"):
                for gateway in gateways:
                    sample = measure(run_load, tmp, gateway, mock.pid, scenario, args.seconds)
                    results[gateway.name].setdefault(scenario, []).append(sample)
                    if sample.load is not None and sample.load.errors:
                        print(f"! {gateway.name}/{scenario}: {sample.load.errors} failed requests")
                    if sample.streams is not None and sample.streams.errors:
                        print(f"! {gateway.name}/{scenario}: {sample.streams.errors} streams failed")
            print(f"  run {repeat + 1}/{args.repeat} done", file=sys.stderr)
        print(table(results, gateways, args.repeat))
        print()
        print(direct_figures(results, args.repeat))
        print(rss_note(results, gateways))
        print(busy_note(results))
        if args.json:
            dump = {g: {s: [sample_dict(x) for x in v] for s, v in sc.items()} for g, sc in results.items()}
            args.json.write_text(json.dumps(dump, indent=1))
    except RuntimeError:
        for log in tmp.glob("*.log"):
            print(f"--- {log.name}:\n" + "\n".join(log.read_text().splitlines()[-20:]), file=sys.stderr)
        raise
    finally:
        procs.stop()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def start_postgres():
    """A throwaway cluster (tests/pgcluster.py), its server pinned to CPU 0; ``(cluster, database URL)``."""
    sys.path.insert(0, str(HERE.parent))
    from tests.pgcluster import start_cluster

    cluster = start_cluster()
    if cluster is None:
        raise SystemExit("--postgres needs Debian's postgresql package (apt-get install -y postgresql)")
    postmaster = (cluster.data / "postmaster.pid").read_text().split()[0]
    if two_cores():  # backends fork from the postmaster: they inherit CPU 0
        subprocess.run(["taskset", "-a", "-p", "-c", "0", postmaster], check=False, capture_output=True)
    return cluster, cluster.create_database("bench")


def sample_dict(sample: Sample) -> dict:
    return {
        "load": vars(sample.load) if sample.load else None,
        "streams": vars(sample.streams) if sample.streams else None,
        "cpu_ms": sample.cpu_ms,
        "mock_cpu_ms": sample.mock_cpu_ms,
        "core_busy": sample.core_busy,
        "rss_mb": sample.rss_mb,
    }


if __name__ == "__main__":
    main()
