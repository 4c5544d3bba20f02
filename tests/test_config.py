"""Config files: validated, with errors naming the file and the field."""

from __future__ import annotations

import hashlib
import re

import pytest

from tokenward.proxy.config import ConfigError, config_from_args, load_config


def write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_example_config_loads_with_paths_relative_to_the_file():
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "config.example.yaml"
    config = load_config(example)
    assert config.ledger.path == str(example.parent / "tokenward.duckdb")
    assert [u.name for u in config.upstreams][:3] == ["openai", "anthropic", "deepseek"]
    assert config.auth.mode == "passthrough"


UP = "upstreams: [{name: a, base_url: 'http://x'}]\n"
SAME_SHA256 = hashlib.sha256(b"tw-same").hexdigest().upper()


def test_the_example_configs_commented_budgets_guard_and_alerts_are_valid(tmp_path):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "config.example.yaml").read_text()
    head, tail = text.split("  # - name: research-daily", 1)
    uncommented = re.sub(r"(?m)^(\s*)# ", r"\1", "  # - name: research-daily" + tail)
    config = load_config(write(tmp_path, head + uncommented))
    assert [b.name for b in config.budgets] == [
        "all-traffic-monthly",
        "research-daily",
        "agents-last-24h",
        "agents",
        "chat-user",
    ]
    assert [b.name for b in config.budget_list()][3:] == ["agents/hour", "agents/day", "agents/month", "agents/last-6h"]
    agents = config.budget_list()[3]
    assert agents.degrade is not None and agents.degrade.cheaper("gpt-4o-2024-08-06") == "gpt-4o-mini"
    assert agents.velocity is not None and agents.velocity.window_minutes == 15
    assert [(t.name, t.per) for t in config.budget_templates()] == [("chat-user", "end_user")]
    assert config.budgets[1].action == "block" and config.alerts.smtp is not None
    assert (config.budgets[2].period, config.budgets[2].rolling_hours) == ("rolling", 24)
    assert [(w.name, w.url, w.url_env, w.secret_env) for w in config.alerts.webhooks] == [
        ("ops-slack", None, "SLACK_WEBHOOK_URL", None),
        ("ops-hook", "https://hooks.example.com/tokenward", None, None),
        ("signed-hook", "https://hooks.example.com/signed", None, "TOKENWARD_HOOK_SECRET"),
    ]
    assert config.alerts.smtp.timeout_s == 30
    assert (config.guard.image_tokens, config.alerts.digest.timezone) == (3000, "Europe/Paris")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("upstreams: []", "at least one upstream"),
        ("upstreams: [{name: a, base_url: 'ftp://x'}]", "$.upstreams[0].base_url"),
        ("upstreams: [{name: a, base_url: 'http://x', colour: red}]", "colour"),
        ("upstreams: [{name: a, base_url: 'http://x'}, {name: a, base_url: 'http://y'}]", "duplicate upstream name"),
        ("upstreams: [{name: a, base_url: 'http://x', port: nope}]", "port"),
        (f"{UP}budgets: [{{name: b, limit_usd: 5, notify: [a@example.com]}}]", "needs an SMTP server (alerts.smtp)"),
        (
            f"{UP}budgets: [{{name: b, limit_usd: -5}}]",
            "budget 'b': limit_usd must be a positive amount of USD - at `$.budgets[0]`",
        ),
        (f"{UP}alerts: {{admins: [ops]}}", "$.alerts.admins"),
        (f"{UP}alerts: {{digest: {{to: [ops], at: 8am}}}}", "digest time '8am' is not HH:MM"),
        ("upstreams: [{name: a, base_url: 'http://x'}]\nvirtual_keys: [{name: k}]", "exactly one of key or key_sha256"),
        ("upstreams: [{name: a, base_url: 'http://x', read_timeout_s: soon}]", "read_timeout_s"),
        ("upstreams: [", "cannot read config"),
        ("upstreams: [{name: a, base_url: 'http://x'}]\nledger: {flush_interval_s: 0}", "flush_interval_s must be > 0"),
        # accepted before, then every request was a 500
        (
            "upstreams: [{name: a, base_url: 'http://x', retries: -3}]",
            "Expected `int` >= 0 - at `$.upstreams[0].retries`",
        ),
        ("upstreams: [{name: a, base_url: 'http://x', retries: 1000}]", "<= 10 - at `$.upstreams[0].retries`"),
        (
            "upstreams: [{name: a, base_url: 'http://x', read_timeout_s: 0}]",
            "> 0.0 - at `$.upstreams[0].read_timeout_s`",
        ),
        ("upstreams: [{name: a, base_url: 'http://x', connect_timeout_s: -1}]", "$.upstreams[0].connect_timeout_s"),
        ("upstreams: [{name: a, base_url: 'http://x', retry_backoff_s: -0.5}]", "$.upstreams[0].retry_backoff_s"),
        ("upstreams: [{name: a, base_url: 'http://x', retry_statuses: [200]}]", "$.upstreams[0].retry_statuses[0]"),
        (f"{UP}server: {{port: 86540}}", "Expected `int` <= 65535 - at `$.server.port`"),
        (f"{UP}server: {{port: 0}}", "Expected `int` >= 1 - at `$.server.port`"),
        (f"{UP}server: {{drain_after_disconnect_s: -1}}", "$.server.drain_after_disconnect_s"),
        (f"{UP}server: {{shutdown_grace_s: -1}}", "Expected `float` >= 0.0 - at `$.server.shutdown_grace_s`"),
        (f"{UP}server: {{shutdown_grace_s: 7200}}", "Expected `float` <= 3600.0 - at `$.server.shutdown_grace_s`"),
        (f"{UP}server: {{shutdown_grace: 5}}", "did you mean `shutdown_grace_s`?"),
        (
            f"{UP}virtual_keys: [{{name: a, key: tw-same}}, {{name: b, key: tw-same}}]",
            "virtual keys 'a' and 'b' have the same key - at `$.virtual_keys[1]`",
        ),
        (  # the same secret, once in clear and once by its sha256 (upper-case hex)
            f"{UP}virtual_keys: [{{name: a, key: tw-same}}, {{name: b, key_sha256: {SAME_SHA256}}}]",
            "virtual keys 'a' and 'b' have the same key",
        ),
    ],
)
def test_invalid_configs_name_the_problem(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and fragment in str(info.value)


def test_command_line_config():
    config = config_from_args("https://api.openai.com/v1", db="x.duckdb", port=4100)
    assert (config.upstreams[0].base_url, config.ledger.path, config.server.port, config.auth.mode) == (
        "https://api.openai.com/v1",
        "x.duckdb",
        4100,
        "passthrough",
    )
    with pytest.raises(ConfigError, match="virtual_keys needs keys"):
        config_from_args("https://api.openai.com/v1", auth="virtual_keys")
    with pytest.raises(ConfigError, match="--upstream must be an http"):
        config_from_args("not a url")


def test_duplicate_key_errors_do_not_show_the_key(tmp_path):
    path = write(tmp_path, f"{UP}virtual_keys: [{{name: a, key: tw-secret-1}}, {{name: b, key: tw-secret-1}}]")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "tw-secret-1" not in str(info.value)


def test_a_section_given_twice_is_refused_with_both_lines_not_silently_replaced(tmp_path):
    # an operator appends a second `budgets:` to the file: PyYAML kept only the last one, so the
    # blocking team budget vanished and `config check` said "ok (1 budgets)"
    text = (
        UP
        + "budgets:\n"
        + "  - {name: eng-daily, limit_usd: 10, scope: {team: eng}, period: day, action: block}\n"
        + "auth: {mode: passthrough}\n"
        + "budgets:\n"
        + "  - {name: all-monthly, limit_usd: 500, period: month}\n"
    )
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, text))
    assert str(refused.value) == (
        f"cannot read config {tmp_path / 'config.yaml'}: not valid YAML at line 5, column 1: key 'budgets' "
        "appears twice in one mapping (first at line 2); only the last would count: merge the two"
    )
    with pytest.raises(ConfigError, match="key 'limit_usd' appears twice in one mapping \\(first at line 4\\)"):
        load_config(write(tmp_path, UP + "budgets:\n  - name: b\n    limit_usd: 10\n    limit_usd: 1000\n"))


def test_a_merge_key_may_still_be_overridden(tmp_path):
    text = (
        "upstreams:\n"
        "  - &base {name: a, base_url: 'http://x', connect_timeout_s: 3}\n"
        "  - {<<: *base, name: b, models: ['b-*']}\n"
    )
    config = load_config(write(tmp_path, text))
    assert [(u.name, u.connect_timeout_s) for u in config.upstreams] == [("a", 3), ("b", 3)]


def test_a_schema_error_names_the_line_of_the_field(tmp_path):
    # a block-style file as an operator writes it: the message said only `$.budgets[1].limit_usd`,
    # and counting list items by hand in a 250-line file is how typos survive
    head = "upstreams:\n  - name: a\n    base_url: http://x\nbudgets:\n  - name: ok\n    limit_usd: 5\n  - name: eng\n"
    cases = {
        "    limit_usd: ten\n": (8, "Invalid decimal string - at `$.budgets[1].limit_usd`"),
        "    limit_usd: 5\n    period: daily\n": (9, "Invalid enum value 'daily' - at `$.budgets[1].period`"),
        "    limit_usd: 5\n    scope:\n      teams: eng\n": (7, "unknown scope 'teams'"),
        "    limit_usd: 5\n    notfy: [a@example.com]\n": (9, "unknown field `notfy` - at `$.budgets[1]`"),
    }
    for tail, (line, message) in cases.items():
        path = write(tmp_path, head + tail)
        with pytest.raises(ConfigError) as refused:
            load_config(path)
        assert str(refused.value).startswith(f"{path}:{line}: "), str(refused.value)
        assert message in str(refused.value)
    path = write(tmp_path, head + "    limit_usd: 5\nbudget: []\n")  # top level: the misspelt section's line
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:9: Object contains unknown field `budget`"):
        load_config(path)
