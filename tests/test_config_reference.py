"""The configuration reference is generated from the schema, committed up to date, and the example shows every option."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from click.testing import CliRunner

from tokenward.proxy.cli import main
from tokenward.proxy.config_reference import options, render

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "config-reference.md"
EXAMPLE = ROOT / "config.example.yaml"

_KEY = re.compile(r"([A-Za-z_]\w*):(?:\s+(.*))?$")


def yaml_paths(text: str) -> set[str]:
    """Dotted option paths a YAML file sets or shows commented out (list items without ``[]``).

    A commented line counts as YAML indented at the comment's column plus its own indent, the
    way ``config.example.yaml`` comments options out; prose comments produce no valid path.
    """
    paths: set[str] = set()
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        content = line.lstrip()
        indent = len(line) - len(content)
        if content.startswith("#"):
            content = content[1:].removeprefix(" ")
            indent += len(content) - len(content.lstrip())
            content = content.lstrip()
        content = re.sub(r"\s+#.*$", "", content).rstrip()
        if not content:
            continue
        if content.startswith("- "):
            indent += 2
            content = content[2:].lstrip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = ".".join(name for _, name in stack)
        if content.startswith("{"):
            paths |= _flow_paths(content, parent)
            continue
        match = _KEY.match(content)
        if match is None:
            continue
        key, value = match.group(1), match.group(2) or ""
        path = f"{parent}.{key}" if parent else key
        paths.add(path)
        if value.startswith("{"):
            paths |= _flow_paths(value, path)
        stack.append((indent, key))
    return paths


def _flow_paths(text: str, parent: str) -> set[str]:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return set()
    found: set[str] = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            path = f"{parent}.{key}" if parent else str(key)
            found.add(path)
            if isinstance(inner, dict):
                found |= _flow_paths(yaml.safe_dump(inner, default_flow_style=True), path)
    return found


_RULES = re.compile(r"^(?:auth|virtual_keys)\.attribution\.(?:end_user|tags|session)\.")


def same_rule(paths: set[str]) -> set[str]:
    """Attribution rules have one shape for every field, globally and per key: shown once is enough."""
    return {_RULES.sub("attribution.*.", path) for path in paths}


def schema_paths() -> set[str]:
    return same_rule({option.path.replace("[]", "") for option in options()})


def test_the_parser_reads_commented_and_flow_options():
    text = (
        "server:\n  port: 4000  # a comment\n# guard:\n#   image_tokens: 3000\n"
        "upstreams:\n  - name: a\n    # retries: 0\n# alerts:\n#   webhooks:\n#     - {name: w, url: 'http://x'}\n"
        "# Options every upstream takes (defaults shown):\n"
    )
    assert yaml_paths(text) == {
        "server",
        "server.port",
        "guard",
        "guard.image_tokens",
        "upstreams",
        "upstreams.name",
        "upstreams.retries",
        "alerts",
        "alerts.webhooks",
        "alerts.webhooks.name",
        "alerts.webhooks.url",
    }


def test_the_committed_reference_is_up_to_date():
    assert REFERENCE.read_text(encoding="utf-8") == render(), (
        "run: tokenward config reference -o docs/config-reference.md"
    )


def test_the_reference_lists_every_option_with_its_default_and_bounds():
    text = REFERENCE.read_text(encoding="utf-8")
    every = options()
    assert len(every) > 60
    for option in every:
        assert f"| `{option.path}` |" in text, option.path
    assert "| `upstreams[].retries` | integer | `0` | >= 0, <= 10 |" in text
    assert "| `server.port` | integer | `4000` | >= 1, <= 65535 |" in text
    assert (
        "| `upstreams[].retry_statuses` | list of integer | `[429, 500, 502, 503, 504]` | each >= 400, <= 599 |" in text
    )
    assert "| `alerts.smtp.timeout_s` | number | `30.0` | > 0 |" in text
    assert "| `budgets[].windows[].limit_usd` | decimal | **required** |  |" in text
    assert "| `budgets[].velocity.window_minutes` | integer | `15` | >= 1, <= 1440 |" in text


def test_the_example_config_shows_every_option():
    shown = yaml_paths(EXAMPLE.read_text(encoding="utf-8"))
    # the five the issue found missing, named so that this test cannot pass vacuously
    for path in ("upstreams.retry_statuses", "upstreams.retry_backoff_s", "alerts.smtp.timeout_s"):
        assert path in shown
    assert {"alerts.webhooks.url", "alerts.webhooks.url_env", "pricing.refresh.file"} <= shown
    assert sorted(schema_paths() - same_rule(shown)) == []


def test_the_example_config_serves_openai_and_anthropic_models():
    from tokenward.proxy.config import load_config
    from tokenward.proxy.routing import Router

    router = Router(load_config(EXAMPLE).upstreams)
    assert router.pick("claude-sonnet-4-5").name == "anthropic"
    assert router.pick("gpt-4o-mini").name == "openai"
    anthropic = router.pick("claude-opus-4-1").config
    assert (anthropic.base_url, anthropic.api_key_header, anthropic.api_key_prefix) == (
        "https://api.anthropic.com/v1",
        "x-api-key",
        "",
    )


def test_config_reference_command_writes_the_same_text(tmp_path):
    out = tmp_path / "ref.md"
    result = CliRunner().invoke(main, ["config", "reference", "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0 and out.read_text(encoding="utf-8") == render()
    printed = CliRunner().invoke(main, ["config", "reference"], catch_exceptions=False)
    assert printed.output == render()
