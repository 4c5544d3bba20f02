"""What a serving proxy keeps out of memory: packages it does not need are never imported."""

from __future__ import annotations

import subprocess
import sys

SERVE_AND_PROBE = """
import sys, urllib.error, urllib.request
from tokenward.proxy.app import create_app
from tokenward.proxy.config import config_from_args
from tokenward.proxy.server import running_in_thread

config = config_from_args("http://127.0.0.1:9/v1", db=sys.argv[1])
statuses = []
with running_in_thread(create_app(config)) as url:
    for path in ("/healthz", "/metrics", "/dashboard", "/v1/chat/completions"):
        data = b'{"model": "gpt-4o-mini", "messages": []}' if path.startswith("/v1") else None
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, data=data), timeout=30) as reply:
                statuses.append(reply.status)
        except urllib.error.HTTPError as exc:
            statuses.append(exc.code)
print(statuses, sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in ("pydantic", "pydantic_core", "tiktoken")}))
"""


def test_a_serving_proxy_imports_neither_pydantic_nor_tiktoken(tmp_path):
    """Litestar adds Pydantic plugins whenever pydantic is installed (the openai SDK needs it): 7.5 MB of RSS;
    tiktoken's extension module is over 1 MB more, and only a count (an estimate, a budget's bound) needs it.

    The app, its Litestar routes (health, metrics, dashboard) and a metered request through the
    front dispatcher (upstream refused: 502) run without either.
    """
    db = str(tmp_path / "l.duckdb")
    found = subprocess.run(
        [sys.executable, "-c", SERVE_AND_PROBE, db], capture_output=True, text=True, check=True, timeout=120
    )
    assert found.stdout.strip().splitlines()[-1] == "[200, 200, 200, 502] []"


def test_the_mover_child_imports_neither_asyncio_nor_ssl():
    """The mover child holds DuckDB while moves come; what it imports besides costs RSS beside each proxy.

    It reads write-ahead logs (``reports.ledger.wal``, whose asyncio is for the proxy's writer only):
    asyncio with its ssl, subprocess and concurrent.futures was 3.2 MB of the child's RSS.
    """
    code = (
        "import sys, tokenward.reports.ledger.mover, tokenward.reports.ledger.moves\n"
        "print(sorted(m for m in ('asyncio', 'ssl', 'concurrent.futures') if m in sys.modules))"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert found.stdout.strip() == "[]"


SERVE_THEN_SCRAPE = """
import sys, urllib.error, urllib.request
from tokenward.proxy.app import create_app
from tokenward.proxy.config import config_from_args
from tokenward.proxy.server import running_in_thread

config = config_from_args("http://127.0.0.1:9/v1", db=sys.argv[1])
seen = []
with running_in_thread(create_app(config)) as url:
    for path in ("/healthz", "/v1/chat/completions", "/metrics"):
        seen.append("prometheus_client" in sys.modules)
        data = b'{"model": "gpt-4o-mini", "messages": []}' if path.startswith("/v1") else None
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, data=data), timeout=30) as reply:
                body = reply.read().decode()
        except urllib.error.HTTPError as exc:
            body = ""
    seen.append("prometheus_client" in sys.modules)
print(seen, [line for line in body.splitlines() if line.startswith("tokenward_requests_total")])
"""


def test_prometheus_client_is_imported_at_the_first_scrape(tmp_path):
    """Rows are counted in plain dicts; ``prometheus_client`` (0.4 MB of RSS) comes with the first ``/metrics``.

    The metered request is refused by its upstream (port 9): one ``upstream_unreachable`` row, counted.
    """
    db = str(tmp_path / "l.duckdb")
    found = subprocess.run(
        [sys.executable, "-c", SERVE_THEN_SCRAPE, db], capture_output=True, text=True, check=True, timeout=120
    )
    assert found.stdout.strip().splitlines()[-1] == (
        "[False, False, False, True] "
        "['tokenward_requests_total{endpoint=\"chat_completions\",outcome=\"upstream_unreachable\",upstream=\"default\"} 1.0']"
    )
