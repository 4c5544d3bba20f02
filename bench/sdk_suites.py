"""Run an SDK's own test suite through tokenward and directly against its mock server, and compare.

The ``openai`` and ``anthropic`` Python SDKs test every API method against a mock server built from
their OpenAPI spec (Stainless' Steady, ``@stdy/cli`` on npm), at ``TEST_API_BASE_URL``. This script
runs that suite once against the mock (the baseline: what fails there is not tokenward's doing),
then with tokenward in front of the mock, in each auth mode asked for, and prints per run the tests
run, passed, failed and skipped, the tests whose outcome differs from the baseline, and what the
ledger recorded (one row per request that reached tokenward; the refusals grouped by path and
reason). It fetches and installs nothing: you give it an SDK checkout, an interpreter that has the
SDK and its test dependencies installed, and the mock's command.

    python bench/sdk_suites.py --flavor openai --sdk ~/src/openai-python --python ~/venvs/oai/bin/python \\
        --mock "steady --host 127.0.0.1 -p {port} --validator-query-array-format=brackets \\
                --validator-form-array-format=brackets --validator-query-object-format=brackets \\
                --validator-form-object-format=brackets api_reference/openapi.transformed.yml" \\
        --modes passthrough,virtual_keys

``{port}`` in the mock's command is replaced by a free port; the command runs in the SDK checkout.
Flavors: ``openai`` (mock paths at its root, the client's base URL ``<tokenward>/v1``; test keys
``My API Key``, admin ``My Admin API Key``) and ``anthropic`` (mock paths under ``/v1``, the
client's base URL ``<tokenward>``; test key ``my-anthropic-api-key``). In ``virtual_keys`` mode the
test key is a virtual key (``--role user`` by default, so isolation applies) and the admin key an
admin one, with ``auth.allow_unmetered: ["*"]``; tokenward sends the mock its own key.
``--count-http-tests`` also runs the suite against a stub that answers every request with 400 at
once (no retries, unlike a closed port): the tests whose outcome then changes are the ones that
really go over HTTP (the rest use ``respx`` mocks or no network).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FLAVORS: dict[str, dict[str, str]] = {
    "openai": {"upstream_path": "", "client_path": "/v1", "key": "My API Key", "admin_key": "My Admin API Key"},
    "anthropic": {"upstream_path": "/v1", "client_path": "", "key": "my-anthropic-api-key", "admin_key": ""},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen[bytes], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited with status {process.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{what} did not listen on port {port} within {timeout_s:.0f} s")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group we started (tokenward flushes its ledger), SIGKILL if it lingers."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class _Refuse(BaseHTTPRequestHandler):
    """Answers anything with 400 (SDKs do not retry it), after reading the body."""

    def _refuse(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = b'{"error": {"message": "stub", "type": "invalid_request_error", "param": null, "code": null}}'
        self.send_response(400)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.send_header("connection", "close")
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _refuse

    def log_message(self, *_: object) -> None:
        pass


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """Test id -> (passed | failed | error | skipped, first line of the message)."""
    found: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        state, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                state = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or "").splitlines()[0][:160] if child.get("message") else ""
                break
        found[test_id] = (state, message)
    return found


def run_suite(args: argparse.Namespace, name: str, base_url: str, out: Path) -> dict[str, tuple[str, str]]:
    junit = out / f"{name}.xml"
    command = [args.python, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    command += ["-n", str(args.workers)] if args.workers else ["-p", "no:xdist"]
    command += args.pytest_args
    env = {**os.environ, "TEST_API_BASE_URL": base_url, "DEFER_PYDANTIC_BUILD": "false"}
    started = time.monotonic()
    with open(out / f"{name}.log", "wb") as log:
        subprocess.run(command, cwd=args.sdk, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    print(f"  {name}: {time.monotonic() - started:.0f} s (log {out / (name + '.log')})", flush=True)
    return outcomes(junit)


def tokenward_command(args: argparse.Namespace, mode: str, mock_port: int, port: int, out: Path) -> list[str]:
    flavor = FLAVORS[args.flavor]
    upstream = f"http://127.0.0.1:{mock_port}{flavor['upstream_path']}"
    db = str(out / f"{mode}.duckdb")
    base = [sys.executable, "-m", "tokenward.proxy", "serve", "--port", str(port), "--db", db, "--no-access-log"]
    base += ["--log-level", "warning"]
    if mode == "passthrough":
        return base + ["--upstream", upstream] + (["--provider", "anthropic"] if args.flavor == "anthropic" else [])
    anthropic = args.flavor == "anthropic"
    upstream_entry: dict[str, Any] = {"name": "mock", "base_url": upstream, "api_key_env": "SDK_SUITES_MOCK_KEY"}
    upstream_entry.update(default=True, dialect=args.flavor)
    if anthropic:
        upstream_entry.update(api_key_header="x-api-key", api_key_prefix="", provider="anthropic")
    keys = [{"name": "sdk-tests", "key": args.key or flavor["key"], "role": args.role}]
    if (args.admin_key or flavor["admin_key"]) and args.role != "admin":
        keys.append({"name": "sdk-admin", "key": args.admin_key or flavor["admin_key"], "role": "admin"})
    config = {
        "auth": {"mode": "virtual_keys", "allow_unmetered": ["*"]},
        "upstreams": [upstream_entry],
        "virtual_keys": keys,
    }
    path = out / "virtual_keys.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return base + ["--config", str(path)]


def ledger_rows(db: Path) -> list[dict[str, Any]]:
    target = db.with_suffix(".jsonl")
    command = [sys.executable, "-m", "tokenward.proxy", "export", "--db", str(db), "-o", str(target)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in target.read_text().splitlines() if line]


def summary_line(name: str, found: dict[str, tuple[str, str]]) -> str:
    counts = collections.Counter(state for state, _ in found.values())
    cells = [len(found), counts["passed"], counts["failed"], counts["error"], counts["skipped"]]
    return f"{name:<18}" + "".join(f"{n:>9}" for n in cells)


def compare(name: str, base: dict[str, tuple[str, str]], other: dict[str, tuple[str, str]], show: int) -> None:
    bad = ("failed", "error")
    broke = sorted(t for t, (state, _) in other.items() if state in bad and base.get(t, ("",))[0] == "passed")
    fixed = sorted(t for t, (state, _) in other.items() if state == "passed" and base.get(t, ("",))[0] in bad)
    print(f"\n{name}: {len(broke)} tests fail here and pass direct; {len(fixed)} pass here and fail direct")
    reasons = collections.Counter(other[t][1] for t in broke)
    for reason, count in reasons.most_common(show):
        print(f"  {count:>5}  {reason}")
    for test in broke[:show]:
        print(f"         {test}")


def report_rows(name: str, rows: list[dict[str, Any]], show: int) -> None:
    statuses = collections.Counter(r["http_status"] for r in rows)
    print(f"\n{name} ledger: {len(rows)} rows (requests that reached tokenward), by status {dict(statuses)}")
    refused = collections.Counter(
        (r["http_status"], r["method"], r["path"], (r["error"] or "")[:100]) for r in rows if r["http_status"] >= 400
    )
    for (status, method, path, error), count in refused.most_common(show):
        print(f"  {count:>5}  {status} {method} {path}  {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdk", type=Path, required=True, help="the SDK checkout (its tests/ is run)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with the SDK and its test deps")
    parser.add_argument("--mock", required=True, help="the mock server's command, with {port}")
    parser.add_argument("--flavor", choices=sorted(FLAVORS), required=True)
    parser.add_argument("--modes", default="passthrough", help="comma-separated: passthrough, virtual_keys")
    parser.add_argument("--role", choices=("user", "admin"), default="user", help="the test key's role (virtual_keys)")
    parser.add_argument("--key", help="the key the SDK's tests send (default: the flavor's)")
    parser.add_argument("--admin-key", help="an admin key the tests send (openai: its admin_api_key)")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (0: no xdist)")
    parser.add_argument("--count-http-tests", action="store_true", help="also run against a stub answering 400")
    parser.add_argument("--out", type=Path, help="where logs, junit files and ledgers go (default: a temp dir)")
    parser.add_argument("--show", type=int, default=15, help="how many tests and refusals to list")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    args.sdk = args.sdk.resolve()
    out = (args.out or Path(tempfile.mkdtemp(prefix="sdk-suites-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    flavor = FLAVORS[args.flavor]
    mock_port = free_port()
    mock_log = open(out / "mock.log", "wb")  # noqa: SIM115 - open for the mock's whole life
    mock = subprocess.Popen(
        shlex.split(args.mock.replace("{port}", str(mock_port))),
        cwd=args.sdk,
        stdout=mock_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    results: dict[str, dict[str, tuple[str, str]]] = {}
    ledgers: dict[str, list[dict[str, Any]]] = {}
    try:
        wait_for_port(mock_port, mock, "the mock server")
        print(f"mock on port {mock_port}; output in {out}", flush=True)
        results["direct"] = run_suite(args, "direct", f"http://127.0.0.1:{mock_port}", out)
        if args.count_http_tests:
            stub = ThreadingHTTPServer(("127.0.0.1", 0), _Refuse)
            threading.Thread(target=stub.serve_forever, daemon=True).start()
            try:
                results["400 stub"] = run_suite(args, "stub", f"http://127.0.0.1:{stub.server_port}", out)
            finally:
                stub.shutdown()
        for mode in args.modes.split(","):
            port = free_port()
            env = {**os.environ, "SDK_SUITES_MOCK_KEY": "sk-mock-upstream-key"}
            with open(out / f"tokenward-{mode}.log", "wb") as log:
                proxy = subprocess.Popen(
                    tokenward_command(args, mode, mock_port, port, out),
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                try:
                    wait_for_port(port, proxy, "tokenward")
                    results[mode] = run_suite(args, mode, f"http://127.0.0.1:{port}{flavor['client_path']}", out)
                finally:
                    stop(proxy)
            ledgers[mode] = ledger_rows(out / f"{mode}.duckdb")
    finally:
        stop(mock)
        mock_log.close()
    print(f"\n{'run':<18}{'tests':>9}{'passed':>9}{'failed':>9}{'errors':>9}{'skipped':>9}")
    for name, found in results.items():
        print(summary_line(name, found))
    if "400 stub" in results:
        over_http = [t for t, (s, _) in results["400 stub"].items() if s != results["direct"].get(t, ("",))[0]]
        print(f"\n{len(over_http)} tests go over HTTP to the mock (their outcome changes against the 400 stub)")
    for mode in ledgers:
        compare(mode, results["direct"], results[mode], args.show)
        report_rows(mode, ledgers[mode], args.show)


if __name__ == "__main__":
    main()
