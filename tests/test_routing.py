"""Which upstream a request goes to: explicit name, model patterns by dialect, the dialect's default."""

from __future__ import annotations

import pytest

from tokenward.proxy.config import ConfigError, UpstreamConfig, load_config
from tokenward.proxy.edge import Base
from tokenward.proxy.errors import ProxyError
from tokenward.proxy.routing import Router


def upstream(name: str, **kw) -> UpstreamConfig:
    return UpstreamConfig(name=name, base_url=kw.pop("base_url", f"https://{name}.example/v1"), **kw)


MIXED = [
    upstream("openai", default=True),
    upstream("groq", models=["llama-*"]),
    upstream("anthropic", models=["claude-opus-*"]),
    upstream("bedrock-claude", dialect="anthropic", models=["claude-3-*"]),
    upstream("claude-gw", base_url="https://api.anthropic.com/v1"),  # inferred from the host
]


def test_dialects_are_declared_or_inferred():
    assert [u.api_dialect for u in MIXED] == ["openai", "openai", "anthropic", "anthropic", "anthropic"]
    assert upstream("x", provider="Anthropic").api_dialect == "anthropic"
    assert upstream("anthropic-ish", dialect="openai").api_dialect == "openai"  # declared wins


def test_requests_without_a_model_go_to_their_dialects_default():
    router = Router(MIXED)
    assert router.pick(None, dialect="openai").name == "openai"
    # three Anthropic upstreams, none marked default: the global default then (an openai one) ...
    assert router.pick(None, dialect="anthropic").name == "openai"
    # ... unless one is marked, or there is just one
    marked = Router([*MIXED[:2], upstream("anthropic", default=True, models=["claude-opus-*"]), *MIXED[3:]])
    assert marked.pick(None, dialect="anthropic").name == "anthropic" and marked.pick(None).name == "openai"
    single = Router([upstream("openai", default=True), upstream("anthropic")])
    assert single.pick(None, dialect="anthropic").name == "anthropic"
    assert single.pick("claude-sonnet-4-5", dialect="anthropic").name == "anthropic"  # no pattern matches
    only = Router([upstream("litellm")])  # one OpenAI-compatible gateway serving /v1/messages too
    assert only.pick(None, dialect="anthropic").name == "litellm"


def test_model_patterns_prefer_the_requests_dialect():
    router = Router(
        [
            upstream("openai", default=True),
            upstream("oai-claude", models=["claude-*"]),
            upstream("anthropic", models=["claude-*"]),
        ]
    )
    assert router.pick("claude-sonnet-4-5", dialect="anthropic").name == "anthropic"
    assert router.pick("claude-sonnet-4-5", dialect="openai").name == "oai-claude"  # Anthropic's OpenAI-compatible API
    assert router.pick("llama-3", dialect="anthropic").name == "anthropic"  # no pattern: the dialect's only upstream
    assert Router(MIXED).pick("claude-3-haiku", dialect="openai").name == "bedrock-claude"  # any dialect, then
    assert Router(MIXED).pick("x", explicit="groq", dialect="anthropic").name == "groq"


def test_no_upstream_for_a_model_is_a_400():
    router = Router([upstream("a"), upstream("b")])
    with pytest.raises(ProxyError) as info:
        router.pick("gpt-4o")
    assert (info.value.status, info.value.code) == (400, "model_not_found")
    with pytest.raises(ProxyError, match="Unknown upstream 'c'"):
        router.pick("gpt-4o", explicit="c")


def test_base_urls_are_parsed_once_per_route():
    (route,) = Router([upstream("deepseek", base_url="https://api.deepseek.com/")]).routes
    assert route.base == Base("https", "api.deepseek.com", 443, "") and route.dialect == "openai"


def write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_config_refuses_base_urls_the_edge_cannot_build_from(tmp_path):
    for base_url, reason in (
        ("https://user:secret@api.example.com/v1", "user or password"),
        ("https://api.example.com/v1?api-version=2024", "query string"),
        ("https://api.example.com/v1/../admin", "plain segments"),
    ):
        with pytest.raises(ConfigError, match=reason) as info:
            load_config(write(tmp_path, f"upstreams: [{{name: a, base_url: '{base_url}'}}]\n"))
        assert "$.upstreams[0].base_url" in str(info.value)


def test_one_default_per_dialect(tmp_path):
    two = "upstreams: [{name: openai, base_url: 'https://a/v1', default: true}, {name: anthropic, base_url: 'https://b/v1', default: true}]\n"
    assert [u.default for u in load_config(write(tmp_path, two)).upstreams] == [True, True]
    clash = "upstreams: [{name: a, base_url: 'https://a/v1', default: true}, {name: b, base_url: 'https://b/v1', default: true}]\n"
    with pytest.raises(ConfigError, match="at most one openai upstream can be the default"):
        load_config(write(tmp_path, clash))


def test_stream_usage_defaults_by_provider():
    assert [upstream(n, provider=n).stream_usage_mode for n in ("openai", "groq", "mistral", "deepseek")] == [
        "ask",
        "always",
        "always",
        "ask",
    ]
    assert upstream("groq", provider="groq", stream_usage="ask").stream_usage_mode == "ask"
