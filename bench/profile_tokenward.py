"""Where tokenward's CPU and memory go, next to the bare relay (issue 13). Prints figures; asserts nothing.

Same set-up as ``bench/bench_floor.py`` (nginx mock and wrk on CPU 0, the gateway on CPU 1):

    profile_tokenward.py pyspy  [--gateway tokenward|relay] [--seconds 10] [--rate 200] [--scenarios c64,c1]
        py-spy samples the pinned gateway under wrk at c=64 (50 ms upstream, then streamed);
        prints self and cumulative time per request by module group and by function, in us,
        scaled to the CPU per request measured in the same run (py-spy's pauses slow the run;
        the shares are what counts). Needs ``pip install py-spy`` in the venv.
    profile_tokenward.py ablate [--seconds 5] [--repeat 2]
        tokenward variants with one part switched off by monkeypatching (proxy/ is unchanged):
        CPU per request at c=64, non-streamed and streamed, and what each part costs.
    profile_tokenward.py memory
        RSS of each heavy package imported alone, what ``tokenward serve`` imports, RSS (private
        RssAnon / file-backed RssFile) after app creation, after duckdb is imported, a connection
        opened and queried, after the tokenizer loads; tracemalloc's top files; then a running
        ``tokenward serve`` mapping by mapping (/proc/PID/smaps: DuckDB's library, the heap,
        anonymous memory...), idle and after 3 s of load on the Python mock.
    profile_tokenward.py moves [--rows 9000] [--moves 16] [--set "SET threads = 1"]
        ROWS rows (the bench's real row) through the write-ahead log, then one move into DuckDB
        (``DuckLedger.flush``, in a worker thread as the proxy runs it), MOVES times: the move's
        CPU and peak RSS above the RSS before it, by phase (open, largest segment insert, close:
        the checkpoint), and the private RSS after. ``--set``: statements run on each move's
        connection once it opens (to try DuckDB settings).
    profile_tokenward.py count
        what a blocking budget's worst-case count costs per KB of request body.
    profile_tokenward.py ab --tree base=/path/to/checkout --tree new=. [--budget] [--repeat 3]
        A/B in one run: ``tokenward serve`` from each source tree (a checkout holding proxy/,
        pricing/, reports/; ``git archive REV proxy pricing reports | tar -x -C DIR`` makes one)
        next to the bare relay, the loads interleaved; CPU per request, requests/s, p99 and RSS.
    profile_tokenward.py serve --config FILE --port N [--off part,part]
        (used by ``ablate``) tokenward with the named parts switched off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_floor as floor  # noqa: E402
from mock_upstream import event  # noqa: E402

Decimal_one = Decimal("0.01")

# ---------------------------------------------------------------- switching parts off (serve)

PARTS = {
    "metrics": "Metrics.observe does nothing (no counters per row)",
    "wal": "the write-ahead log's appends are dropped (no writer thread hand-off; rows still built and encoded)",
    "flush": "no periodic move of the log into DuckDB (no DuckDB session per flush_interval_s)",
    "recorder": "the recorder only marks exchanges recorded: no pricing, no row, no metrics, no log, no flush",
    "watch": "no DisconnectWatch (no receive future per request)",
    "litestar": "not switched off, put back: /v1 through Litestar's api route (no proxy/front.py)",
    "gc": "not switched off, put back: the collector as Python sets it (no gc.freeze(), gen0 threshold 700)",
}
# also for `serve --off`, printed at exit (stop it with SIGINT): "gcstats" the collector's time by generation,
# "flushstats" the moves of the log into the ledger


def _run_now(coroutine):
    """Run a coroutine that never waits (the in-memory book store) to its end, without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the coroutine waited")


def _switch_off(parts: set[str]) -> None:

    from tokenward.proxy import forward, metrics, recorder, relay, server
    from tokenward.reports.ledger import wal

    if "metrics" in parts:
        metrics.Metrics.observe = lambda self, row: None
    if "wal" in parts or "recorder" in parts:

        def done(self, *args):
            future = asyncio.get_running_loop().create_future()
            future.set_result(None)
            return future

        wal.WriteAheadLog.admit = lambda self, request_id, row: None
        wal.WriteAheadLog.forward = done
        wal.WriteAheadLog.commit = done
    if "flush" in parts or "recorder" in parts:

        async def no_flush(self, *, quiet=False):
            return 0

        recorder.Recorder.flush = no_flush
    if "recorder" in parts:

        def finish(self, ex, estimate=None):
            ex.recorded = True
            if self.guard is not None:
                self.guard.release(ex.reservation)

        async def commit(self, ex, estimate=None):
            finish(self, ex)

        recorder.Recorder.finish = finish
        recorder.Recorder.commit = commit
    if "watch" in parts:

        class NoWatch:
            __slots__ = ()
            pending = asyncio.Future  # replaced per instance below

            def __init__(self, receive) -> None:
                pass

            def gone(self) -> bool:
                return False

            def close(self) -> None:
                pass

        class _Never:
            def add_done_callback(self, fn):
                pass

            def remove_done_callback(self, fn):
                pass

        NoWatch.pending = _Never()  # type: ignore[assignment]
        relay.DisconnectWatch = NoWatch  # type: ignore[misc]
        forward.DisconnectWatch = NoWatch  # type: ignore[misc]
    if "litestar" in parts:
        server.front = lambda app: app
    if "gc" in parts:
        server.settle_collector = lambda: None


def _gc_stats() -> None:
    """At exit, print the time the collector took by generation (stderr)."""
    import atexit
    import gc

    spent = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    started = [0.0]

    def callback(phase, info) -> None:
        if phase == "start":
            started[0] = time.process_time()
        else:
            entry = spent[info["generation"]]
            entry[0] += 1
            entry[1] += time.process_time() - started[0]

    gc.callbacks.append(callback)
    atexit.register(
        lambda: print(
            "gc: " + ", ".join(f"gen{g} {n} collections {t * 1000:.0f} ms" for g, (n, t) in spent.items()),
            file=sys.stderr,
        )
    )


def _flush_stats() -> None:
    """At exit, print the moves of the log into the ledger: count, rows, wall and CPU time (stderr)."""
    import atexit

    from tokenward.reports.ledger import DuckLedger

    moves = []  # (rows, wall s, CPU s of the process during the move)
    peaks = []  # rows:VmHWM MB after each move
    real = DuckLedger.flush

    def timed(self, wal=None):
        wall, cpu = time.perf_counter(), time.process_time()
        rows = real(self, wal)
        if rows:
            moves.append((rows, time.perf_counter() - wall, time.process_time() - cpu))
            peaks.append(f"{rows}:{floor.memory_mb(os.getpid(), 'VmHWM'):.0f}")
        return rows

    DuckLedger.flush = timed

    def report() -> None:
        rows, wall, cpu = (sum(m[i] for m in moves) for i in range(3))
        print(
            f"ledger moves: {len(moves)}, {rows} rows, {wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU of the "
            f"process meanwhile ({cpu * 1000 / max(len(moves), 1):.1f} ms per move, {cpu * 1e6 / max(rows, 1):.1f} us "
            "per row); rows:peak RSS MB after each: " + " ".join(peaks),
            file=sys.stderr,
        )

    atexit.register(report)


def serve(config_path: str, port: int, parts: set[str]) -> None:
    import logging

    from tokenward.proxy.app import create_app
    from tokenward.proxy.config import load_config
    from tokenward.proxy.server import run

    logging.basicConfig(level=logging.WARNING)
    _switch_off(parts)
    if "gcstats" in parts:
        _gc_stats()
    if "flushstats" in parts:
        _flush_stats()
    run(create_app(load_config(config_path)), "127.0.0.1", port, log_level="warning")


# ---------------------------------------------------------------- common set-up


class Bench:
    """The mock on CPU 0 and gateways started on CPU 1, stopped on exit."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="tokenward-profile-"))
        self.procs = floor.Processes()
        if floor.two_cores():
            os.sched_setaffinity(0, {0})
        if not shutil.which("wrk"):
            raise SystemExit("wrk is needed: apt-get install -y wrk")
        self.mock_name, self.mock = floor.start_mock(self.procs, self.tmp)

    def __enter__(self) -> Bench:
        return self

    def __exit__(self, *exc) -> None:
        self.procs.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def tokenward(self, port: int, off: set[str] = frozenset(), budget: bool = False) -> floor.Gateway:
        config = floor.tokenward_config(self.tmp, f"tw-{port}", budget)
        argv = [sys.executable, __file__, "serve", "--config", str(config), "--port", str(port)]
        if off:
            argv += ["--off", ",".join(sorted(off))]
        proc = self.procs.start(floor.pinned(1, argv), port, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        return floor.Gateway(
            "tokenward", lambda kind: f"{base}/v1/chat/completions",
            lambda kind: floor.HEADERS | {"x-tokenward-upstream": kind}, proc.pid,
        )  # fmt: skip

    def tree(self, port: int, name: str, source: Path, budget: bool = False) -> floor.Gateway:
        """``tokenward serve`` with the packages of the source tree ``source`` (put ahead of the installed ones)."""
        shim = self.tmp / f"shim-{port}" / "tokenward"
        shim.mkdir(parents=True)
        for package in ("proxy", "pricing", "reports"):
            (shim / package).symlink_to(source.resolve() / package)
        config = floor.tokenward_config(self.tmp, f"tw-{port}", budget)
        argv = [sys.executable, "-m", "tokenward.proxy", "serve", "--config", str(config), "--port", str(port)]
        env = os.environ | {"PYTHONPATH": str(shim.parent)}
        proc = self.procs.start(floor.pinned(1, [*argv, "--log-level", "warning"]), port, env=env)
        base = f"http://127.0.0.1:{port}"
        gateway = floor.Gateway(
            name, lambda kind: f"{base}/v1/chat/completions",
            lambda kind: floor.HEADERS | {"x-tokenward-upstream": kind}, proc.pid,
        )  # fmt: skip
        return gateway

    def gateway(self, name: str) -> floor.Gateway:
        if name == "tokenward":
            return self.tokenward(floor.TW_PORT)
        gateways = floor.start_gateways(self.procs, self.tmp, [name])
        return gateways[-1]

    def load(self, gateway: floor.Gateway, scenario: str, seconds: float) -> tuple[floor.Load, float]:
        """Run one wrk load; returns it and the gateway's CPU ms per request."""
        kind, concurrency, payload = floor.SCENARIOS[scenario]
        before = floor.cpu_seconds(gateway.pid)
        result = floor.wrk_load(self.tmp, gateway.url(kind), gateway.headers(kind), payload, concurrency, seconds)
        if result.errors:
            print(f"! {gateway.url(kind)} ({scenario}): {result.errors} failed requests")
        return result, (floor.cpu_seconds(gateway.pid) - before) / max(result.requests, 1) * 1000

    def warm(self, gateway: floor.Gateway) -> None:
        for scenario in ("c64", "c64_stream"):
            self.load(gateway, scenario, 1)


# ---------------------------------------------------------------- py-spy

GROUPS = [  # (group, pattern on "function (file:line)"), first match wins; matched on the leaf frame for self time
    ("tokenizer/tiktoken", r"tiktoken|proxy/tokenizer\.py|count_input|_count_for_bound|bounds\.py"),
    ("ledger moves (DuckDB sessions)", r"reports/ledger/(__init__|duck|migrations)\.py|duckdb"),
    ("write-ahead log (appends, writer thread)", r"reports/ledger/wal\.py"),
    ("prometheus metrics", r"prometheus_client|proxy/metrics\.py"),
    ("pricing (quote, cost)", r"pricing/(quote|cost|catalog|rates|usage)\.py"),
    ("row building + recorder queue", r"proxy/recorder\.py"),
    ("metering (meter, dialect, SSE)", r"proxy/(metering|sse)\.py|proxy/dialects/"),
    ("msgspec decode", r"msgspec"),
    ("forwarder (headers, routing, admit)", r"proxy/(forward|routing|keys|guard)\.py"),
    ("relay (reply headers, send loop)", r"proxy/relay\.py"),
    ("exchange dataclass + uuid", r"proxy/exchange\.py|uuid\.py|<string>"),
    ("upstream client wrapper", r"proxy/upstream\.py|multidict"),
    ("aiohttp client", r"aiohttp/|yarl/"),
    ("litestar", r"litestar/"),
    ("uvicorn + httptools", r"uvicorn/|httptools"),
    ("logging", r"logging/"),
    ("asyncio + uvloop", r"asyncio/|uvloop|contextvars"),
    ("apscheduler", r"apscheduler|tzlocal"),
    ("other", r"."),
]
_IDLE = re.compile(r"acquire_lock|SimpleQueue_get|epoll_pwait|pthread_cond_(timed)?wait|select \(selectors")


def group_of(frame: str) -> str:
    return next(name for name, pattern in GROUPS if re.search(pattern, frame))


def _frame_name(frame: str) -> str:
    """``function (file:line)`` -> ``file:function`` (lines dropped, so one function is one row)."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    return f"{match.group(2)}:{match.group(1)}" if match else frame


def summarise(raw: Path, cpu_ms: float, top: int) -> str:
    """Self time by group, then functions by self and by cumulative time, in us per request."""
    stacks: list[tuple[list[str], int]] = []
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if _IDLE.search(frames[-1]):
            continue
        stacks.append((frames, int(count)))
    total = sum(n for _, n in stacks) or 1
    per = cpu_ms * 1000 / total  # us per request for one sample
    by_group: Counter[str] = Counter()
    group_cum: Counter[str] = Counter()
    self_fn: Counter[str] = Counter()
    cum_fn: Counter[str] = Counter()
    for frames, n in stacks:
        python = [f for f in frames if re.search(r"\.py:\d+\)$|<string>|<frozen", f)]
        leaf = python[-1] if python else frames[-1]
        stack = ";".join(frames)
        leaf_group = None
        if "DuckLedger.flush" in stack:
            leaf_group = "ledger moves (DuckDB sessions)"
        elif "threading.py" in leaf and "reports/ledger/wal.py" in stack:  # the hand-offs: notify, wait, locks
            leaf_group = "write-ahead log (appends, writer thread)"
        by_group[leaf_group or group_of(leaf)] += n
        for group in {group_of(f) for f in frames[1:]}:
            group_cum[group] += n
        self_fn[_frame_name(leaf)] += n
        for name in {_frame_name(f) for f in frames}:
            cum_fn[name] += n
    out = [f"  {total} on-CPU samples for {cpu_ms * 1000:.0f} us of CPU per request (one sample: {per:.3f} us)"]
    out.append("  self time by group (us/request, share):")
    for name, n in by_group.most_common():
        out.append(f"    {name:<42} {n * per:7.1f}  {100 * n / total:5.1f}%")
    out.append(f"  top {top} functions by self time (us/request):")
    for name, n in self_fn.most_common(top):
        out.append(f"    {n * per:7.1f}  {name}")
    out.append(f"  top {top} tokenward/litestar/aiohttp functions by cumulative time (us/request):")
    shown = 0
    for name, n in cum_fn.most_common():
        if re.search(r"proxy/|pricing/|reports/|litestar/|aiohttp/|prometheus", name) and shown < top:
            out.append(f"    {n * per:7.1f}  {name}")
            shown += 1
    return "\n".join(out)


def pyspy(args: argparse.Namespace) -> None:
    tool = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(tool).exists():
        raise SystemExit("py-spy is needed: .venv/bin/pip install py-spy")
    with Bench() as bench:
        gateway = bench.gateway(args.gateway)
        bench.warm(gateway)
        for scenario in args.scenarios.split(","):
            raw = bench.tmp / f"{scenario}.txt"
            argv = [tool, "record", "-p", str(gateway.pid), "--rate", str(args.rate), "--format", "raw"]
            argv += ["-o", str(raw), "--duration", str(int(args.seconds)), "--threads"]
            argv += ["--native"] if args.native else ["--nonblocking"]
            spy = subprocess.Popen(floor.pinned(0, argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
            result, cpu_ms = bench.load(gateway, scenario, args.seconds)
            spy.wait(60)
            kind, concurrency, _ = floor.SCENARIOS[scenario]
            label = {"stream": "streamed", "slow": "non-streamed, 50 ms upstream", "fast": "instant upstream"}[kind]
            print(
                f"\n{args.gateway}, c={concurrency} {label}: {result.rps:.0f} req/s under py-spy,"
                f" {cpu_ms:.3f} ms CPU per request"
            )
            print(summarise(_strip_threads(raw), cpu_ms, args.top))
            if args.keep:
                shutil.copy(raw, Path(args.keep) / f"{args.gateway}-{scenario}{'-native' if args.native else ''}.txt")


def _strip_threads(raw: Path) -> Path:
    """Drop py-spy's leading ``thread (0x..)`` frame; keep a marker for non-main threads."""
    out = raw.with_suffix(".stacks")
    lines = []
    for line in raw.read_text().splitlines():
        frames = line.split(";")
        if frames and frames[0].startswith(("thread (", "process ")):
            frames = frames[1:]
        lines.append(";".join(frames))
    out.write_text("\n".join(lines) + "\n")
    return out


# ---------------------------------------------------------------- ablation


def ablate(args: argparse.Namespace) -> None:
    variants = [("full", set())] + [(f"-{p}", {p}) for p in ("watch", "metrics", "wal", "flush", "recorder")]
    variants += [("+litestar", {"litestar"}), ("+gc defaults", {"gc"})]
    results: dict[str, dict[str, list[float]]] = {name: {"c64": [], "c64_stream": []} for name, _ in variants}
    with Bench() as bench:
        relay = bench.gateway("relay")
        gateways = [(name, bench.tokenward(9500 + i, off)) for i, (name, off) in enumerate(variants)]
        gateways.append(("relay (floor)", relay))
        results["relay (floor)"] = {"c64": [], "c64_stream": []}
        for _, gateway in gateways:
            bench.warm(gateway)
        for _ in range(args.repeat):
            for scenario in ("c64", "c64_stream"):
                for name, gateway in gateways:
                    _, cpu_ms = bench.load(gateway, scenario, args.seconds)
                    results[name][scenario].append(cpu_ms)
    full = {s: statistics.median(results["full"][s]) for s in ("c64", "c64_stream")}
    floor_cpu = {s: statistics.median(results["relay (floor)"][s]) for s in ("c64", "c64_stream")}
    print(f"CPU per request at c=64 (ms; median of {args.repeat}, [min..max]); saved = full - variant\n")
    print(
        f"{'variant':<28} {'non-streamed':>22} {'saved':>7} {'/relay':>7} {'streamed':>22} {'saved':>7} {'/relay':>7}"
    )
    for name, _ in [*variants, ("relay (floor)", None)]:
        cells = []
        for scenario in ("c64", "c64_stream"):
            values = results[name][scenario]
            med = statistics.median(values)
            cells.append(f"{med:.3f} [{min(values):.3f}..{max(values):.3f}]".rjust(22))
            cells.append(f"{full[scenario] - med:+.3f}".rjust(7))
            cells.append(f"{med / floor_cpu[scenario]:.2f}x".rjust(7))
        print(f"{name:<28} " + " ".join(cells))
    print("\nparts switched off:")
    for part, what in PARTS.items():
        print(f"  -{part}: {what}")


# ---------------------------------------------------------------- A/B of source trees


def ab(args: argparse.Namespace) -> None:
    """CPU per request (and requests/s, p99, RSS) of tokenward from several source trees, in one run."""
    trees = [(spec.split("=", 1)[0], Path(spec.split("=", 1)[1])) for spec in args.tree]
    scenarios = args.scenarios.split(",")
    with Bench() as bench:
        gateways = [("relay", bench.gateway("relay"))]
        gateways += [(name, bench.tree(9600 + i, name, path, args.budget)) for i, (name, path) in enumerate(trees)]
        time.sleep(1.0)
        # the serving process and its live children (tokenward's mover): RSS, private, PSS, and the parent alone
        idle = {name: floor.tree_memory_mb(g.pid, "VmRSS") for name, g in gateways}
        private = {name: floor.tree_memory_mb(g.pid, "RssAnon") for name, g in gateways}
        idle_pss = {name: floor.pss_mb(g.pid) for name, g in gateways}
        idle_own = {name: floor.memory_mb(g.pid, "VmRSS") for name, g in gateways}
        for _, gateway in gateways:
            bench.warm(gateway)
        results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        loaded: dict[str, float] = {}
        for repeat in range(args.repeat):
            for scenario in scenarios:
                order = gateways[repeat % len(gateways) :] + gateways[: repeat % len(gateways)]
                for name, gateway in order:  # a different gateway first in each repeat
                    load, cpu_ms = bench.load(gateway, scenario, args.seconds)
                    results.setdefault((name, scenario), []).append((cpu_ms, load.rps, load.p99_ms))
                    loaded[name] = max(loaded.get(name, 0.0), floor.tree_memory_mb(gateway.pid, "VmRSS"))
        peak = {name: floor.tree_memory_mb(g.pid, "VmHWM") for name, g in gateways}
        peak_own = {name: floor.memory_mb(g.pid, "VmHWM") for name, g in gateways}
        private_end = {name: floor.tree_memory_mb(g.pid, "RssAnon") for name, g in gateways}
        end_pss = {name: floor.pss_mb(g.pid) for name, g in gateways}
        time.sleep(args.settle)  # tokenward's mover stops after 5 s without a move
        settled = {name: floor.tree_memory_mb(g.pid, "VmRSS") for name, g in gateways}
    print(f"median of {args.repeat} [min..max]; /relay = median of the per-repeat ratios to the relay\n")
    for scenario in scenarios:
        print(f"{scenario}: {'CPU ms/request':>28} {'/relay':>7} {'requests/s':>20} {'p99 ms':>22}")
        floor_cpu = [cpu for cpu, _, _ in results[("relay", scenario)]]
        for name, _ in gateways:
            samples = results[(name, scenario)]
            cpu, rps, p99 = ([s[i] for s in samples] for i in range(3))
            ratios = statistics.median(c / f for c, f in zip(cpu, floor_cpu, strict=True))
            print(
                f"  {name:<12} {floor.spread(cpu, '.3f'):>24} {ratios:6.2f}x {floor.spread(rps, ',.0f'):>20} "
                f"{floor.spread(p99, '.1f'):>22}"
            )
    print("\nRSS (MB) of the process and its children (the mover); private RssAnon in brackets, PSS, the parent alone:")
    for name, _ in gateways:
        print(
            f"  {name}: idle {idle[name]:.0f} [{private[name]:.0f}] PSS {idle_pss[name]:.0f} "
            f"(parent {idle_own[name]:.0f}); "
            f"largest after a load {loaded[name]:.0f}; peak <= {peak[name]:.0f} (sum of each one's VmHWM; parent "
            f"{peak_own[name]:.0f}); end [{private_end[name]:.0f}] PSS {end_pss[name]:.0f}; "
            f"{args.settle:.0f} s later {settled[name]:.0f}"
        )


# ---------------------------------------------------------------- memory

HEAVY = [
    "litestar", "uvicorn", "uvloop", "aiohttp", "httpx", "anyio", "httpx_aiohttp", "duckdb", "tiktoken", "msgspec",
    "prometheus_client", "apscheduler", "click", "rich", "pygments", "pygal", "openai", "yaml", "aiosmtplib",
    "brotli", "zstandard", "watchfiles",
]  # fmt: skip
_RSS = "import re;print(int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1)))"
_RSS3 = (
    "import re;_s = open('/proc/self/status').read()\n"
    "print(*(int(re.search(k + r':\\s+(\\d+)', _s).group(1)) for k in ('VmRSS', 'RssAnon', 'RssFile')))"
)


def _rss_after(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code + "\n" + _RSS], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / 1024


def _rss3_after(code: str) -> tuple[float, ...]:
    """(RSS, private RssAnon, file-backed RssFile) in MB after running ``code`` in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", code + "\n" + _RSS3], capture_output=True, text=True, check=True)
    return tuple(int(v) / 1024 for v in out.stdout.split()[-3:])


def _serve_modules() -> dict[str, list[str]]:
    """Third-party modules `tokenward serve` has imported once its app exists, by top-level package, in order."""
    code = (
        "import sys, json\nimport tokenward.proxy.cli, tokenward.proxy.app, tokenward.proxy.server\n"
        "std = set(sys.stdlib_module_names)\nby = {}\n"
        "for m in list(sys.modules):\n"
        "    top = m.split('.')[0]\n"
        "    if top not in std and not top.startswith('_') and top not in ('tokenward', 'cython_runtime'):\n"
        "        by.setdefault(top, []).append(m)\nprint(json.dumps(by))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def _imports(modules: list[str]) -> str:
    return "".join(f"try:\n    import {m}\nexcept Exception:\n    pass\n" for m in modules)


def memory(args: argparse.Namespace) -> None:
    base = _rss_after("pass")
    loaded = _serve_modules()
    print(f"python alone: {base:.1f} MB RSS; `tokenward serve` imports {len(loaded)} third-party packages:")
    print("  " + " ".join(loaded))
    print("\nRSS (MB) a package's modules (those serve imports) add imported alone, and last (after every other")
    print("module serve imports: about what importing it lazily would save; 0 = something else needs it too)")
    start = "import re\nr0 = int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
    for name in HEAVY:
        modules = loaded.get(name, [name])
        try:
            alone = _rss_after(_imports(modules) + f"import {modules[0]}") - base
        except subprocess.CalledProcessError:
            print(f"  {name:<20}   (not installed)")
            continue
        others = _imports([m for top, mods in loaded.items() if top != name for m in mods])
        code = others + start + _imports(modules) + _RSS.replace("print(", "print(-r0 + ")
        last = (
            int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split()[-1]) / 1024
        )
        where = f"{len(modules)} modules imported by serve" if name in loaded else "not imported by serve"
        print(f"  {name:<20} alone {alone:6.1f}   last {last:6.1f}   ({where})")
    everything = _imports([m for mods in loaded.values() for m in mods])
    print(f"  (all of them together: {_rss_after(everything) - base:.1f})")
    steps = [
        ("import tokenward.proxy.cli (what `tokenward serve` imports first)", "import tokenward.proxy.cli"),
        ("+ import tokenward.proxy.app, server", "import tokenward.proxy.app, tokenward.proxy.server"),
        ("+ create_app(config) (catalog, scheduler, app)", "app = tokenward.proxy.app.create_app(config)"),
        ("+ import duckdb (what the ledger modules import)", "import duckdb"),
        ("+ open the ledger (DuckDB connection, migrations) and close it", "from tokenward.reports.ledger import "
         "open_ledger\nopen_ledger(config.ledger.path).close()"),
        ("+ open it again, read one row, close it (a move's pages of the library)",
         "open_ledger(config.ledger.path).execute('SELECT count(*) FROM requests').fetchall()"),
        ("+ tokenizer o200k_base loaded (first estimate or budget count)",
         "from tokenward.proxy import tokenizer\n"
         "tokenizer.count_tokens('hello', tokenizer.encoding_for_model('gpt-4o'))"),
    ]  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="tokenward-mem-"))
    try:
        config = floor.tokenward_config(tmp, "mem", False)
        prelude = f"from tokenward.proxy.config import load_config\nconfig = load_config({str(config)!r})\n"
        code = ""
        print("\ntokenward serve, step by step (cumulative MB: RSS = private RssAnon + file-backed RssFile):")
        for label, step in steps:
            code += step + "\n"
            rss, anon, file = _rss3_after("import tokenward.proxy.cli\n" + prelude + code)
            print(f"  {label:<72} {rss:6.1f} = {anon:5.1f} + {file:5.1f}")
        script = (
            "import sys, tracemalloc\ntracemalloc.start()\nimport tokenward.proxy.cli, tokenward.proxy.app\n"
            + prelude
            + "app = tokenward.proxy.app.create_app(config)\n"
            "snap = tracemalloc.take_snapshot()\nimport collections, re\nby = collections.Counter()\n"
            "for s in snap.statistics('filename'):\n"
            "    f = s.traceback[0].filename\n"
            "    m = re.search(r'site-packages/([^/]+)', f) or re.search(r'/(proxy|pricing|reports)/', f)\n"
            "    by[m.group(1) if m else ('stdlib/other')] += s.size\n"
            "print('tracemalloc (Python objects only) after create_app:', round(sum(by.values())/2**20, 1), 'MB')\n"
            "for k, v in by.most_common(12): print(f'  {k:<28} {v/2**20:6.1f}')\n"
            "mods = collections.Counter(m.split('.')[0] for m in sys.modules)\n"
            "print('modules loaded:', len(sys.modules), '; by top-level package:',"
            " ', '.join(f'{k} {v}' for k, v in mods.most_common(16)))\n"
        )
        print()
        print(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
        importtime(prelude)
        serving(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _mappings(pid: int) -> dict[str, list[int]]:
    """RSS and private (anonymous) kB of a process by mapping: library file name, ``[heap]``, ``[anon]``..."""
    by: dict[str, list[int]] = {}
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            name = Path(fields[5]).name if len(fields) > 5 else "[anon]"
            name = "[stack]" if name.startswith("[stack") else name
        elif fields[0] in ("Rss:", "Anonymous:"):
            by.setdefault(name, [0, 0])[fields[0] == "Anonymous:"] += int(fields[1])
    return by


def _mapping_table(pid: int, label: str) -> None:
    by = _mappings(pid)
    rss, anon = (sum(v[i] for v in by.values()) / 1024 for i in (0, 1))
    print(f"\n{label}: RSS {rss:.1f} MB, private (anonymous) {anon:.1f}, file-backed {rss - anon:.1f}; by mapping:")
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])
    for name, (kb, anon_kb) in ranked[:10]:
        what = {
            "[heap]": "the brk heap (glibc malloc of the main thread)",
            "[anon]": "anonymous mmaps: pymalloc arenas, thread stacks and malloc arenas, large buffers",
        }.get(name, "")
        print(f"  {name[:44]:<44} {kb / 1024:6.1f} MB (private {anon_kb / 1024:5.1f})  {what}")
    rest = ranked[10:]
    print(
        f"  {f'{len(rest)} other mappings':<44} {sum(v[0] for _, v in rest) / 1024:6.1f} MB "
        f"(private {sum(v[1] for _, v in rest) / 1024:5.1f})"
    )


def serving(tmp: Path) -> None:
    """A running ``tokenward serve`` (the bench's config, the Python mock upstream): idle, then after load."""
    procs = floor.Processes()
    try:
        mock = [sys.executable, str(HERE / "mock_upstream.py"), "--port", str(floor.MOCK_PORT)]
        procs.start(mock, floor.MOCK_PORT, mock=True, stdout=subprocess.DEVNULL)
        config = floor.tokenward_config(tmp, "serving", False)
        argv = [sys.executable, "-m", "tokenward.proxy", "serve", "--config", str(config), "--port", str(floor.TW_PORT)]
        proxy = procs.start([*argv, "--log-level", "warning"], floor.TW_PORT, stderr=subprocess.DEVNULL)
        time.sleep(1.5)  # as bench_floor: start-up work settles before idle is read
        _mapping_table(proxy.pid, "tokenward serve, idle")
        url = f"http://127.0.0.1:{floor.TW_PORT}/v1/chat/completions"
        headers = floor.HEADERS | {"x-tokenward-upstream": "fast"}
        load = floor.python_load(tmp, url, headers, floor.body(), 64, 3)
        time.sleep(2.5)  # the last rows moved into the ledger
        _mapping_table(proxy.pid, f"after {load.requests} requests at c=64 and their moves")
        print(f"  peak (VmHWM) so far: {floor.memory_mb(proxy.pid, 'VmHWM'):.1f} MB")
        for child in floor.tree_pids(proxy.pid)[1:]:  # the mover, until it stops after 30 s without a move
            print(
                f"  child {child}: RSS {floor.memory_mb(child, 'VmRSS'):.1f} MB "
                f"[{floor.memory_mb(child, 'RssAnon'):.1f} private], peak {floor.memory_mb(child, 'VmHWM'):.1f}"
            )
        print(f"  the tree's PSS: {floor.pss_mb(proxy.pid):.1f} MB")
    finally:
        procs.stop()


# ---------------------------------------------------------------- moves of the log into DuckDB

_MOVES = r"""
import asyncio, json, os, re, sys, time, uuid
rows, moves, path, settings = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
import tokenward.proxy.app, tokenward.proxy.server  # the libraries a serving proxy has loaded
import tokenward.reports.ledger.moves as ledger_module  # where DuckLedger.flush's move opens and inserts
from tokenward.proxy.limits import return_large_buffers
from tokenward.reports.ledger import DuckLedger, WriteAheadLog, duck
from tokenward.reports.ledger.wal import encode_row, fill_row

template = fill_row(json.loads(sys.argv[5]))

def mb(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024

def reset_peak():  # VmHWM back to the current RSS
    with open("/proc/self/clear_refs", "w") as out:
        out.write("5")

phases = []
def phase(name, fn):
    def timed(*args, **kwargs):
        before = mb("VmRSS")
        reset_peak()
        try:
            return fn(*args, **kwargs)
        finally:
            phases.append((name, before, mb("VmHWM")))
    return timed

class Connection:  # the move's connection, its close (DuckDB's checkpoint) measured
    def __init__(self, conn):
        self._conn = conn
        self.settings = [s for s in settings.split(";") if s.strip()]  # run before the first insert
    def __getattr__(self, name):
        return getattr(self._conn, name)
    def close(self):
        phase("close", self._conn.close)()

opened = phase("open", duck.open_ledger)
ledger_module.open_ledger = lambda *a, **k: Connection(opened(*a, **k))
def insert_lines(conn, *args, **kwargs):  # after the flush's own settings, so that --set overrides them
    while conn.settings:
        conn.execute(conn.settings.pop(0))
    return duck.insert_lines(conn, *args, **kwargs)

ledger_module.insert_lines = phase("insert", insert_lines)
return_large_buffers()  # as `tokenward serve` does
ledger = DuckLedger(path)
ledger.migrate()
wal = WriteAheadLog(ledger.spool_dir)

async def main():
    wal.open(asyncio.get_running_loop())
    for k in range(moves):
        for i in range(rows):
            waiter = wal.commit([str(i)], encode_row(dict(template, request_id=uuid.uuid4().hex)))
            if i % 200 == 0:
                await waiter
        await waiter
        phases.clear()
        before, cpu = mb("VmRSS"), time.process_time()
        moved = await asyncio.to_thread(ledger.flush, wal)
        cpu = time.process_time() - cpu
        inserts = [p for p in phases if p[0] == "insert"]
        top = max(p[2] for p in phases)
        worst = max(inserts, key=lambda p: p[2] - p[1])
        close = phases[-1]
        print(json.dumps([k, moved, cpu * 1000, before, top, len(inserts), worst[2] - worst[1], close[2] - close[1],
                          mb("VmRSS"), mb("RssAnon")]), flush=True)

asyncio.run(main())
wal.close()
"""


def _bench_row() -> dict:
    """A ledger row as the bench's tokenward writes it (a non-streamed gpt-4o-mini request, priced)."""
    cost_lines = [
        {"component": "input", "quantity": 56, "rate": "0.15", "amount": "0.0000084", "rule": "base"},
        {"component": "cached_input", "quantity": 64, "rate": "0.075", "amount": "0.0000048", "rule": "base"},
        {"component": "output", "quantity": 48, "rate": "0.60", "amount": "0.0000288", "rule": "base"},
    ]
    usage = json.loads(floor.REPLY)["usage"]
    return {
        "started_at": 1796149056.518868, "ended_at": 1796149056.521151, "principal": "fp-ebadd1f77d7c",
        "method": "POST", "path": "/v1/chat/completions", "endpoint": "chat_completions", "upstream": "fast",
        "provider": "openai", "requested_model": "gpt-4o-mini", "served_model": "gpt-4o-mini-2024-07-18",
        "http_status": 200, "outcome": "ok", "stream": False, "usage_source": "reported", "cost_usd": "0.0000420",
        "price_status": "priced", "price_entry_id": "openai/gpt-4o-mini", "price_resolved_by": "snapshot",
        "cost_lines": cost_lines, "output_cost_usd": "0.0000288", "cache_savings_usd": "0.0000048",
        "service_tier": "default", "latency_ms": 2.282987999933539, "ttfb_ms": 2.2761789987271186,
        "raw_usage": usage, "row_kind": "request", "key_id": "fp-ebadd1f77d7c", "input_tokens": 120,
        "cached_input_tokens": 64, "output_tokens": 48, "image_variant": "",
    }  # fmt: skip


def moves(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="tokenward-moves-"))
    argv = [sys.executable, "-c", _MOVES, str(args.rows), str(args.moves), str(tmp / "moves.duckdb"), args.set]
    argv.append(json.dumps(_bench_row()))
    try:
        settings = f", on each connection: {args.set}" if args.set else ""
        print(f"{args.moves} moves of {args.rows} rows each{settings}")
        print("peaks are MB above the RSS before the move; close = DuckDB's checkpoint of what the move inserted\n")
        print(" move | rows  | CPU ms | RSS before | peak | inserts | worst insert | close | RSS after | private after")
        peaks, cpus = [], []
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                k, moved, cpu, before, top, inserts, insert, close, after, anon = json.loads(line)
                peaks.append(top - before)
                cpus.append(cpu)
                print(
                    f" {k:4d} | {moved:5d} | {cpu:6.0f} | {before:10.1f} | +{top - before:4.0f} | {inserts:7d} | "
                    f"{insert:+12.1f} | {close:+5.0f} | {after:9.1f} | {anon:13.1f}"
                )
        if peaks:
            print(
                f"\npeak above the RSS before: median +{statistics.median(peaks):.0f}, largest +{max(peaks):.0f} MB; "
                f"CPU per move median {statistics.median(cpus):.0f} ms, total {sum(cpus):.0f} ms"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def importtime(prelude: str) -> None:
    """Top-level packages by cumulative import time at `tokenward serve` start (python -X importtime)."""
    code = "import tokenward.proxy.cli, tokenward.proxy.app, tokenward.proxy.server\n"
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True).stderr
    top: Counter[str] = Counter()
    for line in err.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if match and len(match.group(3)) <= 2:  # modules imported by tokenward itself (or first level)
            top[match.group(4).split(".")[0]] += int(match.group(2))
    print("import time at start by top-level package (ms, cumulative, first level only):")
    print("  " + ", ".join(f"{k} {v / 1000:.0f}" for k, v in top.most_common(16)))


# ---------------------------------------------------------------- per-request steps, timed alone


def _per_call(fn, number: int = 2000) -> float:
    """Median us of this process's CPU per call over 7 batches (CPU time: the machine is shared)."""
    batches = []
    for _ in range(7):
        t0 = time.process_time()
        for _ in range(number):
            fn()
        batches.append((time.process_time() - t0) / number * 1e6)
    return statistics.median(batches)


def micro(args: argparse.Namespace) -> None:
    """Time each per-request step of a metered chat completion alone, in this process (no server)."""
    import datetime as dt
    import uuid

    from multidict import CIMultiDict

    from tokenward.pricing.quote import quote, worst_case
    from tokenward.proxy import forward, keys, relay
    from tokenward.proxy.app import create_app
    from tokenward.proxy.config import load_config
    from tokenward.proxy.exchange import Exchange, Outcome
    from tokenward.proxy.metering import Meter
    from tokenward.proxy.recorder import build_rows
    from tokenward.reports.ledger import encode_row, open_ledger
    from tokenward.reports.ledger.duck import insert_lines

    tmp = Path(tempfile.mkdtemp(prefix="tokenward-micro-"))
    try:
        app = create_app(load_config(floor.tokenward_config(tmp, "micro", budget=True)))
        fw, rec = app.state.forwarder, app.state.recorder
        payload = floor.body()
        scope = {
            "type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "query_string": b"", "headers": [
                (b"host", b"127.0.0.1:9402"), (b"content-length", str(len(payload)).encode()),
                (b"content-type", b"application/json"), (b"authorization", b"Bearer sk-bench-0123456789"),
                (b"x-tokenward-upstream", b"slow"),
            ],
        }  # fmt: skip
        reply_headers = [
            (b"server", b"nginx/1.22.1"), (b"date", b"Tue, 01 Dec 2026 09:51:53 GMT"),
            (b"content-type", b"application/json"), (b"transfer-encoding", b"chunked"), (b"connection", b"keep-alive"),
        ]  # fmt: skip
        ex = Exchange(endpoint="chat_completions", method="POST", path="/v1/chat/completions")
        inbound = fw._inbound(scope, ex, keep_length=False)
        head = forward._read_head(payload)
        ex.requested_model = head.model
        route = fw.router.pick(ex.requested_model, inbound.upstream)
        fw._attach(ex, route, inbound)
        meter = Meter("openai")
        meter.feed_body(floor.REPLY)
        result = meter.finish()
        ex.http_status, ex.served_model, ex.usage, ex.raw_usage = 200, result.model, result.usage, result.raw_usage
        ex.end(Outcome.OK)
        rows = build_rows(ex, rec.catalog)
        at = dt.datetime.fromtimestamp(ex.started_at, dt.UTC)
        stream_chunks = [event(i, False) for i in range(20)] + [event(20, True), floor.DONE]
        steps: list[tuple[str, float]] = []

        def step(label: str, fn, number: int = 2000) -> None:
            steps.append((label, _per_call(fn, number)))

        step(
            "Exchange(...) incl. uuid4().hex, time(), perf_counter()",
            lambda: Exchange(endpoint="chat_completions", method="POST", path="/v1/chat/completions"),
        )
        step("  of which uuid.uuid4().hex", lambda: uuid.uuid4().hex)
        step(
            "Forwarder._inbound: one pass over the client's headers, identify",
            lambda: fw._inbound(
                scope, Exchange(endpoint="c", method="POST", path="/", request_id="x"), keep_length=False
            ),
        )
        step(
            "  of which keys.fingerprint (sha256 of the key, passthrough)",
            lambda: keys.fingerprint("sk-bench-0123456789"),
        )
        step("request head (_read_head: one scan, case-clash check)", lambda: forward._read_head(payload))
        step(
            "Router.pick + Forwarder._attach",
            lambda: fw._attach(ex, fw.router.pick("gpt-4o-mini", "slow"), forward._Inbound(headers=[])),
        )
        step(
            "headers to CIMultiDict for aiohttp (AiohttpUpstream.send)",
            lambda: CIMultiDict([(n.decode("latin-1"), v.decode("latin-1")) for n, v in inbound.headers]),
        )
        step("_AiohttpReply: lower-case the reply's raw headers", lambda: [(n.lower(), v) for n, v in reply_headers])
        step(
            "Relay: reply header filter + request id + content-type lookup",
            lambda: (
                [(n, v) for n, v in reply_headers if n not in relay._REPLY_DROPPED]
                + [(b"x-tokenward-request-id", b"x")],
                relay.header(reply_headers, b"content-type"),
            ),
        )
        step(
            "Meter(...) + feed_body(reply) + finish()",
            lambda: (lambda m: (m.feed_body(floor.REPLY), m.finish()))(Meter("openai", None)),
        )
        step(
            "quote(usage) (pricing)",
            lambda: quote(rec.catalog, ex.usage, model=ex.served_model, provider="openai", at=at),
        )
        step("build_rows(ex) (quote + row dict)", lambda: build_rows(ex, rec.catalog))
        step("Metrics.observe(row) (counters per row)", lambda: rec.metrics.observe(rows[0]))
        step("row encoding for the write-ahead log (msgspec JSON line)", lambda: encode_row(rows[0]))

        def meter_stream() -> None:
            m = Meter("openai", None)
            for chunk in stream_chunks:
                m.feed_stream(chunk)
            m.end_stream()
            m.finish()

        step("streamed: Meter over 22 events (feed_stream each, finish)", meter_stream, 500)
        guard = fw.guard
        attributes = forward._attributes(ex)
        step(
            "budget: guard.in_scope(attributes, blocking_only)", lambda: guard.in_scope(attributes, blocking_only=True)
        )
        step(
            "budget: _count_for_bound (decode, tiktoken, scan), small body",
            lambda: forward._count_for_bound("openai", payload, "gpt-4o-mini", "chat/completions"),
            500,
        )
        step(
            "budget: worst_case(...) (pricing bound)",
            lambda: worst_case(
                rec.catalog, model="gpt-4o-mini", provider="openai", at=at, input_tokens=30, max_output_tokens=16384
            ),
        )
        step(
            "budget: guard.admit + release",
            lambda: guard.release(_run_now(guard.admit(attributes, Decimal_one, at))),
        )
        step(
            "budget: guard.tightest + budget headers", lambda: forward._budget_headers(*guard.tightest(attributes, at))
        )

        async def in_loop() -> None:
            async def receive():
                await asyncio.Future()

            def watch() -> None:
                w = relay.DisconnectWatch(receive)
                w.close()

            loop_steps = []
            for label, fn in (("DisconnectWatch(receive) + close (a Task per request)", watch),):
                fn()
                await asyncio.sleep(0)
                batches = []
                for _ in range(7):
                    t0 = time.process_time()
                    for _ in range(1000):
                        fn()
                    await asyncio.sleep(0)  # let the cancelled tasks finish, as the server does
                    batches.append((time.process_time() - t0) / 1000 * 1e6)
                loop_steps.append((label, statistics.median(batches)))
            await asyncio.to_thread(lambda: None)
            t0 = time.process_time()
            for _ in range(300):
                await asyncio.to_thread(lambda: None)
            loop_steps.append(
                ("budget: asyncio.to_thread round trip (CPU, both threads)", (time.process_time() - t0) / 300 * 1e6)
            )
            steps.extend(loop_steps)

        import uvloop

        uvloop.run(in_loop())
        path = tmp / "micro.duckdb"
        open_ledger(path).close()
        for n in (1, 100, 1000, 5000):  # what DuckLedger.flush does with one closed segment of n rows
            segment = tmp / f"segment-{n}.rows.jsonl"
            segment.write_bytes(b"".join(encode_row(dict(rows[0], request_id=f"r{n}-{i}")) for i in range(n)))
            t0 = time.process_time()
            conn = open_ledger(path)
            insert_lines(conn, [segment], dedupe=False, quarantine=tmp / "q.jsonl", scratch=tmp)
            conn.close()
            steps.append(
                (
                    f"ledger move of {n} rows (DuckDB connect, migration check, insert, close), per move",
                    (time.process_time() - t0) * 1e6,
                )
            )
        print("per-request steps of a metered chat completion, timed alone in one process (us per call, median)\n")
        for label, us in steps:
            print(f"  {us:9.1f}  {label}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- worst-case count


def count(args: argparse.Namespace) -> None:
    from tokenward.proxy import forward, tokenizer

    tokenizer.count_tokens("warm", tokenizer.encoding_for_model("gpt-4o-mini"))
    readme = (HERE.parent / "README.md").read_text()
    texts = {"English prose (README.md)": readme, "source code": _code(len(readme))}

    def timed(body: bytes, calls: int) -> tuple[int, float]:
        times = []
        for _ in range(calls):
            t0 = time.thread_time()
            tokens, _ = forward._count_for_bound("openai", body, "gpt-4o-mini", "chat/completions")
            times.append((time.thread_time() - t0) * 1e6)
        return tokens, statistics.median(times)

    print("blocking budget worst-case count: _count_for_bound (one msgspec decode, tiktoken o200k per text, scan)")
    print("CPU time of the calling thread, median; a chat body with one user message of the given text\n")
    print(f"{'text':<28} {'body':>8} {'tokens':>7} {'us/call':>9} {'us per KB':>10}")
    for label, source in texts.items():
        for kb in (1, 4, 16, 64, 256):
            text = (source * (kb * 1024 // len(source) + 1))[: kb * 1024 - 60]
            body = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]}).encode()
            tokens, us = timed(body, 200 if kb <= 16 else 30)
            print(f"{label:<28} {len(body) / 1024:6.1f}KB {tokens:7d} {us:9.1f} {us / (len(body) / 1024):10.1f}")

    async def hop() -> float:
        await asyncio.to_thread(lambda: None)
        t0 = time.process_time()
        for _ in range(500):
            await asyncio.to_thread(lambda: None)
        return (time.process_time() - t0) / 500 * 1e6

    print(f"\nasyncio.to_thread round trip around it (CPU of both threads): {asyncio.run(hop()):.1f} us per request")


def _code(size: int) -> str:
    line = "    for index, item in enumerate(items): total += item.price * quantities[index]  # sum\n"
    return (line * (size // len(line) + 1))[:size]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pyspy")
    p.add_argument(
        "--gateway", default="tokenward", choices=["tokenward", "relay", "tokenward+budget", "tokenward+count"]
    )
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--rate", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--native", action="store_true", help="sample native frames too (slower, pauses the process)")
    p.add_argument("--scenarios", default="c64,c64_stream", help="of bench_floor.SCENARIOS (default c64,c64_stream)")
    p.add_argument("--keep", help="copy the raw py-spy stacks into this directory")
    p = sub.add_parser("ablate")
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--repeat", type=int, default=2)
    sub.add_parser("memory")
    p = sub.add_parser("moves")
    p.add_argument("--rows", type=int, default=9000, help="rows per move (default 9000)")
    p.add_argument("--moves", type=int, default=16, help="moves (default 16)")
    p.add_argument("--set", default="", help="';'-separated statements run on each move's connection")
    sub.add_parser("count")
    p = sub.add_parser("ab")
    p.add_argument("--tree", action="append", required=True, help="NAME=DIR (a checkout with proxy/ pricing/ reports/)")
    p.add_argument("--scenarios", default="c64,c64_stream", help="of bench_floor.SCENARIOS (default c64,c64_stream)")
    p.add_argument("--budget", action="store_true", help="with one blocking budget over all traffic")
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--settle", type=float, default=7.0, help="seconds after the loads before the last RSS reading")
    sub.add_parser("micro")
    p = sub.add_parser("serve")
    p.add_argument("--config", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--off", default="")
    args = parser.parse_args()
    if args.command == "serve":
        serve(args.config, args.port, {p for p in args.off.split(",") if p})
        return
    commands = {"pyspy": pyspy, "ablate": ablate, "ab": ab, "memory": memory, "moves": moves, "count": count}
    (commands | {"micro": micro})[args.command](args)


if __name__ == "__main__":
    main()
