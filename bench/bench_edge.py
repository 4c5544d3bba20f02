"""What the request-edge checks cost per request. Prints figures; asserts nothing.

Times, in one process on one core, the per-request work :mod:`tokenward.proxy.edge` and the
attribution rules add: checking the raw path and query (``target``), building and re-checking
the upstream URL (``Base.url``), the unmetered allow-list and dialect lookups, an attribution
policy with rules, the credential count in the header pass, and the old string concatenation
for comparison. The issue's budget is +0.05 ms (50,000 ns) per request; these are nanoseconds.

    .venv/bin/python bench/bench_edge.py [--number 20000]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from collections.abc import Callable

from tokenward.proxy.config import AttributionRule, AttributionSettings
from tokenward.proxy.edge import FREE_ENDPOINTS, UnmeteredPolicy, parse_base, request_dialect, target
from tokenward.proxy.keys import Attribution

BASE_TEXT = "https://api.openai.com/v1"
BASE = parse_base(BASE_TEXT)
POLICY = UnmeteredPolicy([*FREE_ENDPOINTS, "files", "files/*", "GET batches/*"])
RULES = Attribution.from_settings(
    (
        "auth.attribution",
        AttributionSettings(end_user=AttributionRule(prefix="org/"), tags=AttributionRule(allow=["a", "b", "c"])),
    )
)
REQUESTS = [
    ("POST", b"/v1/chat/completions", b""),
    ("GET", b"/v1/files/file-abc123/content", b""),
    ("GET", b"/v1/models/ft%3Agpt-4o-mini%3Aacme%3A1", b""),
    ("GET", b"/v1/responses/resp_1", b"include%5B%5D=file_search_call.results&after=%2A"),
]


def measure(label: str, job: Callable[[], object], number: int) -> tuple[float, float]:
    """Median wall ns per call over 5 runs of ``number`` calls, and the mean CPU ns of the same runs."""
    runs = []
    cpu = time.process_time()
    for _ in range(5):
        runs.append(timeit.timeit(job, number=number) / number * 1e9)
    cpu_ns = (time.process_time() - cpu) / (5 * number) * 1e9
    median = statistics.median(runs)
    print(f"  {label:<58} {median:8.0f} ns   (cpu {cpu_ns:6.0f} ns, min {min(runs):6.0f})")
    return median, cpu_ns


def bench_request(method: str, raw: bytes, query: bytes, number: int) -> tuple[float, float]:
    """Time each edge step for one request line; returns the summed (wall, CPU) ns of the new steps."""
    print(f"{method} {raw.decode()}{'?' + query.decode() if query else ''}")
    found = target(raw, method, query)
    assert found is not None
    steps = [
        measure("target(): check path + query, find the endpoint", lambda: target(raw, method, query), number),
        measure("Base.url(): build from components + check", lambda: BASE.url(found.tail, found.query), number),
        measure("UnmeteredPolicy.allows()", lambda: POLICY.allows(method, found.tail), number),
        measure("request_dialect()", lambda: request_dialect(found.tail, False), number),
    ]
    text, rest = raw.decode(), ("?" + query.decode() if query else "")
    measure("old: base_url + raw_path[3:] + '?' + query (string glue)", lambda: BASE_TEXT + text[3:] + rest, number)
    return sum(wall for wall, _ in steps), sum(cpu for _, cpu in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20000)
    number = parser.parse_args().number
    print(f"per call, median of 5 x {number} (one process, one core; noisy on a shared machine)")
    totals = [bench_request(method, raw, query, number) for method, raw, query in REQUESTS]
    print("attribution")
    rules = measure(
        "Attribution.settle() with a prefix and an allowlist", lambda: RULES.settle("org/u", ("a",), None), number
    )
    walls, cpus = [t[0] for t in totals], [t[1] for t in totals]
    print(f"edge total per request: {min(walls):.0f} to {max(walls):.0f} ns wall, ", end="")
    print(f"{min(cpus):.0f} to {max(cpus):.0f} ns CPU")
    print(f"attribution rules add {rules[0]:.0f} ns wall, {rules[1]:.0f} ns CPU (budget: 50,000 ns each)")


if __name__ == "__main__":
    main()
