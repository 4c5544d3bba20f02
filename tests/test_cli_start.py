"""`tokenward serve` as users start it: validated at start with one-line errors, logs worth reading.

Real processes: the command runs in a subprocess and is judged by its exit code and stderr.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import click
import httpx
import pytest
from click.testing import CliRunner

from tokenward.proxy.cli import main

ROOT = Path(__file__).resolve().parents[1]
CHAT = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokenward(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenward.proxy", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The single ``Error:`` line of a failed start (click's usage lines may precede it)."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    assert result.stderr.rstrip().endswith(errors[0])
    return errors[0]


UP = "upstreams: [{name: a, base_url: 'http://127.0.0.1:9/v1'}]\n"


@pytest.mark.parametrize(
    ("args", "config", "env", "expected"),
    [
        (  # before: logged 86540 and listened on 86540 - 65536 = 21004
            ["--port", "86540"],
            None,
            {},
            "Error: Invalid value for '--port': 86540 is not in the range 1<=x<=65535.",
        ),
        (
            ["--log-level", "loud"],
            None,
            {},
            "Error: Invalid value for '--log-level': 'loud' is not one of 'critical', 'error', 'warning', 'info', 'debug'.",
        ),
        ([], f"{UP}server: {{port: 86540}}", {}, ":2: Expected `int` <= 65535 - at `$.server.port`"),
        (  # before: accepted, then every request was a 500
            [],
            "upstreams: [{name: a, base_url: 'http://127.0.0.1:9/v1', retries: -3}]",
            {},
            ":1: Expected `int` >= 0 - at `$.upstreams[0].retries`",
        ),
        (
            [],
            "upstreams: [{name: a, base_url: 'http://127.0.0.1:9/v1', read_timeout_s: 0}]",
            {},
            ":1: Expected `float` > 0.0 - at `$.upstreams[0].read_timeout_s`",
        ),
        (
            [],
            "upstreams: [{name: a, base_url: 'http://127.0.0.1:9/v1', connect_timeout_s: -2}]",
            {},
            ":1: Expected `float` > 0.0 - at `$.upstreams[0].connect_timeout_s`",
        ),
        (
            [],
            f"{UP}virtual_keys: [{{name: a, key: tw-one}}, {{name: b, key: tw-one}}]",
            {},
            ":2: virtual keys 'a' and 'b' have the same key - at `$.virtual_keys[1]`",
        ),
        (
            [],
            f"{UP}alerts: {{smtp: {{host: 127.0.0.1, username_env: TW_TEST_SMTP_USER, password_env: TW_TEST_SMTP_PW}}}}",
            {"TW_TEST_SMTP_PW": "secret"},
            ": alerts.smtp.username_env: environment variable TW_TEST_SMTP_USER is not set "
            "(alert mail could not log in to the SMTP server)",
        ),
        (
            [],
            f"{UP}alerts: {{webhooks: [{{name: ops, url_env: TW_TEST_HOOK}}]}}\n"
            "budgets: [{name: b, limit_usd: 5, notify: [ops]}]",
            {},
            ": alerts.webhooks[0].url_env: environment variable TW_TEST_HOOK is not set "
            "(alerts to webhook 'ops' would be lost)",
        ),
        (
            [],
            f"{UP}alerts: {{webhooks: [{{name: ops, url: 'http://127.0.0.1:9/h', secret_env: TW_TEST_HOOK_SECRET}}]}}\n"
            "budgets: [{name: b, limit_usd: 5, notify: [ops]}]",
            {},
            ": alerts.webhooks[0].secret_env: environment variable TW_TEST_HOOK_SECRET is not set "
            "(alerts to webhook 'ops' would be lost)",
        ),
    ],
    ids=[
        "port", "log-level", "config-port", "retries", "read-timeout", "connect-timeout", "dup-keys", "smtp", "hook",
        "hook-secret",
    ],
)
def test_bad_starts_fail_with_one_line(tmp_path, args, config, env, expected):
    if config is None:
        args = ["--upstream", "http://127.0.0.1:9/v1", *args]
    else:
        path = tmp_path / "c.yaml"
        path.write_text(config)
        args = ["--config", str(path), *args]
        expected = f"Error: {path}{expected}"  # schema errors with the line: `c.yaml:2: ...`
    error = one_line_error(tokenward("serve", "--db", str(tmp_path / "l.duckdb"), *args, env=env))
    assert error == expected
    assert not (tmp_path / "l.duckdb").exists()  # refused before anything was opened


def wait_healthy(url: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, "proxy did not start"
        time.sleep(0.1)


def stop(process: subprocess.Popen[str]) -> str:
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    return stderr


def test_a_running_proxy_logs_requests_and_warnings_but_not_its_scheduler(tmp_path, simulator, sample):
    port = free_port()
    config = tmp_path / "c.yaml"
    config.write_text(
        f"upstreams:\n"
        f"  - {{name: openai, base_url: '{simulator.url}/openai/v1', provider: openai, default: true,"
        f" api_key_env: TW_TEST_UNSET_KEY}}\n"
        f"auth: {{mode: virtual_keys}}\n"
        f"virtual_keys: [{{name: agent, key: tw-agent-key-0001}}]\n"
        f"server: {{port: {port}, admin_token_env: TW_TEST_UNSET_ADMIN}}\n"
        f"ledger: {{path: l.duckdb, flush_interval_s: 0.2}}\n"
        f"budgets: [{{name: monthly, limit_usd: 100}}]\n"
        f"alerts: {{evaluate_every_s: 1, webhooks: [{{name: spare, url_env: TW_TEST_UNSET_HOOK}}]}}\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenward.proxy", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json=sample[CHAT].request["body"],
            headers={"authorization": "Bearer tw-agent-key-0001"},
        )
        assert reply.status_code == 500 and reply.json()["error"]["code"] == "upstream_key_missing"
        time.sleep(2.5)  # two budget checks at least
    finally:
        stderr = stop(process)
    lines = stderr.splitlines()
    # warned at start, and the proxy started anyway (decisions in proxy/preflight.py)
    assert any(
        "WARNING tokenward.proxy: alerts.webhooks[0].url_env: environment variable TW_TEST_UNSET_HOOK is not set "
        "(nothing sends to 'spare')" in line
        for line in lines
    )
    # each once: said by the start checks (proxy/preflight.py, as `config check` says them), not again by the app
    assert sum("upstream openai: environment variable TW_TEST_UNSET_KEY is not set" in line for line in lines) == 1
    assert sum("server.admin_token_env names TW_TEST_UNSET_ADMIN, which is not set" in line for line in lines) == 1
    access = [line for line in lines if " INFO tokenward.access: " in line]
    assert len(access) == 1 and "POST /v1/chat/completions 500 proxy_error upstream=openai model=gpt-4o" in access[0]
    assert any(
        "WARNING tokenward.requests: request " in line
        and "failed in tokenward (500): Upstream 'openai' has no API key: set TW_TEST_UNSET_KEY." in line
        for line in lines
    )
    assert "Aborted" not in stderr  # Ctrl-C after a graceful shutdown is no error
    assert not any("Running job" in line or "executed successfully" in line for line in lines)
    assert any(f"starting tokenward on http://127.0.0.1:{port}/v1" in line for line in lines)


def test_no_access_log_keeps_warnings(tmp_path, simulator):
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenward.proxy",
            "serve",
            "--upstream",
            f"http://127.0.0.1:{free_port()}/v1",
            "--db",
            str(tmp_path / "l.duckdb"),
            "--port",
            str(port),
            "--no-access-log",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "gpt-4o", "messages": []})
        assert reply.status_code == 502
        time.sleep(0.5)
    finally:
        stderr = stop(process)
    assert "tokenward.access" not in stderr
    assert "WARNING tokenward.requests: request " in stderr and "upstream default unreachable (502)" in stderr


def all_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    context = click.Context(group)
    for name in group.list_commands(context):  # click's own listing: the report commands load lazily
        command = group.get_command(context, name)
        found.append((*prefix, name))
        if isinstance(command, click.Group):
            found += all_commands(command, (*prefix, name))
    return found


def test_every_command_answers_dash_h_and_the_version_is_shown():
    commands = all_commands(main)
    assert ("serve",) in commands and ("config", "reference") in commands and len(commands) > 20
    for path in [(), *commands]:
        result = CliRunner().invoke(main, [*path, "-h"], catch_exceptions=False)
        assert result.exit_code == 0, path
        assert result.output.startswith("Usage: " + " ".join(("main", *path))), path
    script = Path(sys.executable).parent / "tokenward"  # the installed command, as users run it
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("tokenward, version 0.")
    help_text = subprocess.run([str(script), "serve", "-h"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and help_text.stdout.startswith("Usage: tokenward serve [OPTIONS]")


def test_config_check_validates_like_serve(tmp_path):
    good = tokenward("config", "check", "--config", str(ROOT / "config.example.yaml"))
    assert good.returncode == 0 and "config.example.yaml: ok (5 upstreams, 1 budget, auth passthrough"  # before: "1 budgets" in good.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("upstreams: [{name: a, base_url: 'http://x', retries: -3}]\n")
    assert one_line_error(tokenward("config", "check", "--config", str(bad))).endswith("$.upstreams[0].retries`")
    # a YAML mistake was five lines naming "<unicode string>" with a caret, not the file
    unclosed = tmp_path / "unclosed.yaml"
    unclosed.write_text("budgets: [\n")
    for command in (("config", "check"), ("serve",)):
        error = one_line_error(tokenward(*command, "--config", str(unclosed)))
        assert error == (
            f"Error: cannot read config {unclosed}: not valid YAML at line 2, column 1: expected the node content, "
            "but found '<stream end>' (while parsing a flow node)"
        )
    for command in (("report",), ("keys", "list"), ("pricing", "check")):  # the readers of --config too
        error = one_line_error(tokenward(*command, "--config", str(unclosed)))
        assert error.endswith(
            "not valid YAML at line 2, column 1: expected the node content, but found '<stream end>' "
            "(while parsing a flow node)"
        ), command
    tab = tmp_path / "tab.yaml"
    tab.write_text("server:\n\tport: 4000\n")
    assert one_line_error(tokenward("config", "check", "--config", str(tab))).endswith(
        "not valid YAML at line 2, column 1: found character '\\t' that cannot start any token "
        "(while scanning for the next token)"
    )
    missing = one_line_error(tokenward("config", "check", "--config", str(tmp_path / "nope.yaml")))
    assert missing.startswith("Error: ") and "nope.yaml" in missing


def test_make_run_takes_a_port(tmp_path):
    installed = ROOT / ".venv" / "bin" / ".installed"
    if not installed.exists() or installed.stat().st_mtime < (ROOT / "pyproject.toml").stat().st_mtime:
        pytest.skip("make run would (re)install .venv first")
    port = free_port()
    ledger = tmp_path / "run.duckdb"
    process = subprocess.Popen(
        ["make", "-s", "-C", str(ROOT), "run", f"PORT={port}", f"DB={ledger}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        assert ledger.exists()
    finally:
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    assert f"starting tokenward on http://127.0.0.1:{port}/v1 (ledger {ledger}, auth passthrough)" in stderr


SIM = "upstreams: [{name: openai, base_url: 'http://127.0.0.1:9/v1', provider: openai}]\n"


@pytest.mark.parametrize(
    ("config", "prices", "expected"),
    [
        (  # before: the allowed values were left to find in the docs
            f"{SIM}budgets: [{{name: b, limit_usd: 5, period: daily}}]",
            None,
            "Invalid enum value 'daily' - at `$.budgets[0].period`; expected one of day, hour, month, rolling, total, week",
        ),
        (
            f"{SIM}auth: {{mode: virtual_key}}",
            None,
            "Invalid enum value 'virtual_key' - at `$.auth.mode`; expected one of passthrough, virtual_keys",
        ),
        (  # a typo is named with the field meant
            f"{SIM}budgets: [{{name: b, limt_usd: 5}}]",
            None,
            "Object contains unknown field `limt_usd` - at `$.budgets[0]`; did you mean `limit_usd`?",
        ),
        (f"{SIM}budget: []", None, "Object contains unknown field `budget`; did you mean `budgets`?"),
        (  # nothing close: the fields the section takes
            f"{SIM}virtual_keys: [{{name: a, key: tw-a, max_budget: 5}}]",
            None,
            "Object contains unknown field `max_budget` - at `$.virtual_keys[0]`; this section takes name, key, "
            "key_sha256, team, project, org, pool, allow_unmetered, attribution, runs, role, expires",
        ),
        (  # before: accepted, and a blocking budget that matched no request refused nothing
            f"{SIM}budgets: [{{name: b, limit_usd: 5, scope: {{upstream: opneai}}, action: block}}]",
            None,
            "budget 'b': scope upstream 'opneai' is not a configured upstream (configured: openai) "
            "- at `$.budgets[0].scope`",
        ),
        (  # before: `config check` said ok and `serve` refused to start
            f"{SIM}pricing: {{files: [prices.yaml]}}",
            "entries: [{id: acme/large, provider: acme, model: large, input: 2, outptu: 6, source: 'https://a', "
            "checked: 2026-11-29}]",
            "{dir}/prices.yaml: entry 'acme/large': field 'outptu': unknown field; did you mean 'output'?",
        ),
    ],
    ids=["enum", "enum-auth", "typo", "typo-top", "unknown-field", "budget-upstream", "price-file"],
)
def test_config_mistakes_say_what_to_write(tmp_path, config, prices, expected):
    path = tmp_path / "c.yaml"
    path.write_text(config)
    if prices is not None:
        (tmp_path / "prices.yaml").write_text(prices)
    expected = expected.format(dir=tmp_path)
    if not expected.startswith(str(tmp_path)):  # schema errors name the config file and the line (all on 2)
        expected = f"{path}:2: {expected}"
    check = tokenward("config", "check", "--config", str(path))
    assert one_line_error(check) == f"Error: {expected}"
    serve = tokenward("serve", "--config", str(path), "--db", str(tmp_path / "l.duckdb"), "--port", str(free_port()))
    assert one_line_error(serve) == f"Error: {expected}"  # the check says what serve says


def test_config_check_warns_as_serve_does(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "upstreams:\n"
        "  - {name: openai, base_url: 'http://127.0.0.1:9/v1', provider: openai, api_key_env: TW_TEST_UNSET_KEY}\n"
        "  - {name: claude, base_url: 'http://127.0.0.1:9/v1', provider: anthropik, models: ['claude-*']}\n"
        "server: {admin_token_env: TW_TEST_UNSET_ADMIN, metrics_token_env: TW_TEST_UNSET_METRICS}\n"
        "auth: {mode: virtual_keys}\n"
    )
    check = tokenward("config", "check", "--config", str(path))
    assert check.returncode == 0 and check.stdout.startswith(f"{path}: ok (2 upstreams")
    assert check.stderr.splitlines() == [  # before: only "ok", and serve then logged the first four
        "warning: upstream openai: environment variable TW_TEST_UNSET_KEY is not set; "
        "its requests will be refused (virtual_keys mode)",
        "warning: upstream claude: no api_key_env; its requests will be refused (virtual_keys mode)",
        "warning: server.admin_token_env names TW_TEST_UNSET_ADMIN, which is not set: the dashboard refuses everyone",
        "warning: server.metrics_token_env names TW_TEST_UNSET_METRICS, which is not set: /metrics refuses every token",
        "note: upstream claude: no prices for provider 'anthropik' in the catalog (did you mean provider: anthropic?); "
        "its models are priced by name (vendor/model prefix or the same model at another provider) or stay unpriced",
    ]
    passthrough = tmp_path / "p.yaml"
    passthrough.write_text(
        f"{SIM}budgets:\n"
        "  - {name: research, limit_usd: 5, scope: {team: research}, action: block}\n"
        "  - {name: per-pool, limit_usd: 5, per: pool, scope: {project: x}}\n"
        "  - {name: users, limit_usd: 5, per: end_user}\n"
    )
    check = tokenward("config", "check", "--config", str(passthrough))
    assert check.returncode == 0 and check.stderr.splitlines() == [
        "warning: budgets[0] 'research': team comes from virtual keys, and auth.mode is passthrough: this budget "
        "matches no request (set auth.mode: virtual_keys, or scope it on key, end_user, model, upstream or tag)",
        "warning: budgets[1] 'per-pool': project and pool come from virtual keys, and auth.mode is passthrough: this "
        "budget matches no request (set auth.mode: virtual_keys, or scope it on key, end_user, model, upstream or tag)",
    ]


def test_ledger_copy_onto_itself_says_so(tmp_path):
    ledger = tmp_path / "l.duckdb"
    assert tokenward("ledger", "migrate", "--db", str(ledger)).returncode == 0
    copy = tokenward("ledger", "copy", "--from", str(ledger), "--to", f"{tmp_path}/./l.duckdb")
    # before: "ledger ... is in use by another process (0 rows copied before)", the process being the copy itself
    assert one_line_error(copy) == f"Error: --from and --to name the same ledger ({ledger}): nothing to copy"


def test_pins_and_budgets_on_models_without_a_price_are_named(tmp_path):
    port = free_port()
    path = tmp_path / "c.yaml"
    path.write_text(
        "upstreams: [{name: azure, base_url: 'http://127.0.0.1:9/v1', provider: openai, price_as: gpt-4o-mnii}]\n"
        "pricing: {aliases: {prod-4o: gpt-4oo}, price_as: {contoso: gpt-4o}}\n"  # contoso's pin has a price
        "budgets: [{name: m, limit_usd: 5, scope: {model: gpt-4o-mnii}}]\n"
        f"server: {{port: {port}}}\nledger: {{path: l.duckdb}}\n"
    )
    expected = [  # before: "ok", and every request pinned there was recorded unpriced
        "upstreams[0].price_as: no price for 'gpt-4o-mnii' in the catalog (did you mean 'gpt-4o-mini'?); "
        "every request to azure will be unpriced",
        "pricing.aliases: prod-4o -> 'gpt-4oo': no price for 'gpt-4oo' in the catalog (did you mean 'gpt-4o'?)",
        "budgets[0] 'm': scope model 'gpt-4o-mnii': no price for 'gpt-4o-mnii' in the catalog (did you mean "
        "'gpt-4o-mini'?), so this budget counts no spend for it",
    ]
    check = tokenward("config", "check", "--config", str(path))
    assert check.returncode == 0 and check.stderr.splitlines() == [f"warning: {w}" for w in expected]
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenward.proxy", "serve", "--config", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
    finally:
        stderr = stop(process)
    for warning in expected:  # serve says the same, once
        assert sum(line.endswith(f" WARNING tokenward.proxy: {warning}") for line in stderr.splitlines()) == 1


def test_a_postgres_ledger_that_is_down_is_named_once(tmp_path):
    url = f"postgresql://tokenward:s3cret@127.0.0.1:{free_port()}/tokenward"  # nothing listens there
    start = tokenward("serve", "--upstream", "http://127.0.0.1:9/v1", "--db", url, "--port", str(free_port()))
    error = one_line_error_or_last(start)
    shown = url.replace(":s3cret", ":***")  # the password never shows
    # before: "cannot open the ledger <url>: cannot connect to the ledger <url>: connection failed: ..."
    assert error.startswith(f"Error: cannot connect to the ledger {shown}: connection failed: ")
    assert start.stderr.count(shown) == 1 and "s3cret" not in start.stderr
    # `--upstream` without `--provider` prices by model name, as asked: no note that 'default' has no prices
    assert "provider 'default'" not in start.stderr


def one_line_error_or_last(result: subprocess.CompletedProcess[str]) -> str:
    """The ``Error:`` line of a failed start whose reason may run on (a driver's hint on the next line)."""
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_a_port_in_use_is_said_in_one_line_before_anything_starts(tmp_path):
    # before: "Application startup complete", then uvicorn's "[Errno 98] error while attempting to bind
    # on address", exit 3, with the ledger already opened and migrated
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = tokenward(
            "serve", "--upstream", "http://127.0.0.1:9/v1", "--port", str(port), "--db", str(tmp_path / "l.duckdb")
        )
    assert one_line_error(result) == (
        f"Error: cannot listen on 127.0.0.1:{port}: it is in use (another tokenward, or another program): "
        "pick another --port"
    )
    assert result.returncode == 1 and not (tmp_path / "l.duckdb").exists()
