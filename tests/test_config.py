"""Config files: validated, with errors naming the file and the field."""

from __future__ import annotations

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
    assert [u.name for u in config.upstreams][:2] == ["openai", "deepseek"]
    assert config.auth.mode == "passthrough"


UP = "upstreams: [{name: a, base_url: 'http://x'}]\n"


def test_the_example_configs_commented_budgets_guard_and_alerts_are_valid(tmp_path):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "config.example.yaml").read_text()
    head, tail = text.split("  # - name: research-daily", 1)
    uncommented = re.sub(r"(?m)^(\s*)# ", r"\1", "  # - name: research-daily" + tail)
    config = load_config(write(tmp_path, head + uncommented))
    assert [b.name for b in config.budgets] == ["all-traffic-monthly", "research-daily"]
    assert config.budgets[1].action == "block" and config.alerts.smtp is not None
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
