"""Keys: who is calling, which credential counts, which unmetered endpoints a key may use, what it may claim."""

from __future__ import annotations

import pytest

from tokenward.proxy.config import (
    AttributionRule,
    AttributionSettings,
    AuthConfig,
    ConfigError,
    VirtualKeyConfig,
    load_config,
)
from tokenward.proxy.errors import ProxyError
from tokenward.proxy.keys import Attribution, Authenticator, fingerprint, presented_key, upstream_credential


def test_the_credential_the_upstream_checks():
    assert upstream_credential(b"authorization", b"Bearer sk-1 ") == "sk-1"
    assert upstream_credential(b"authorization", b"Basic dXNlcg==") == "Basic dXNlcg=="
    assert upstream_credential(b"x-api-key", b"sk-ant-1") == "sk-ant-1"
    assert upstream_credential(b"api-key", b"") is None and upstream_credential(b"authorization", b"Bearer ") is None
    assert presented_key(b"authorization", b"Basic dXNlcg==") is None  # not a virtual key


def test_keys_carry_their_own_allow_list_and_rules_over_the_global_ones():
    auth = AuthConfig(
        mode="virtual_keys",
        allow_unmetered=["GET models"],
        attribution=AttributionSettings(end_user=AttributionRule(prefix="org/"), session=AttributionRule(prefix="s-")),
    )
    keys = [
        VirtualKeyConfig(name="a", key="tw-a-1"),
        VirtualKeyConfig(
            name="b",
            key="tw-b-2",
            allow_unmetered=["files/*"],
            attribution=AttributionSettings(end_user=AttributionRule(pinned="svc")),
        ),
    ]
    authenticator = Authenticator(auth, keys)
    a, b = authenticator.identify("tw-a-1"), authenticator.identify("tw-b-2")
    assert a.unmetered.allows("GET", "models") and not a.unmetered.allows("GET", "files/f1")
    assert b.unmetered.allows("GET", "files/f1") and not b.unmetered.allows("GET", "models")
    assert (a.unmetered_setting, b.unmetered_setting) == (
        "auth.allow_unmetered",
        "virtual_keys[1].allow_unmetered (key 'b')",
    )
    assert a.attribution.settle("org/x", ("t",), "s-1") == ("org/x", ("t",), "s-1")
    assert b.attribution.settle("anyone", (), "s-2") == ("svc", (), "s-2")  # pinned here, session rule global
    with pytest.raises(ProxyError, match=r"auth.attribution.session"):
        b.attribution.settle("anyone", (), "x-2")
    authenticator.use_stored([("c", "ab" * 32, None, None)])  # created with `tokenward keys`: the global rules
    stored = authenticator._by_hash["ab" * 32]
    assert stored.unmetered.entries == ("GET models",) and stored.attribution.end_user is not None
    passthrough = Authenticator(AuthConfig(attribution=AttributionSettings(tags=AttributionRule(allow=["x"]))), [])
    assert passthrough.identify("sk-1").principal == fingerprint("sk-1")
    with pytest.raises(ProxyError, match="tag 'y'"):
        passthrough.identify("sk-1").attribution.settle(None, ("x", "y"), None)


def test_an_open_policy_changes_nothing():
    assert Attribution().open and Attribution().settle("u", ("t",), "s") == ("u", ("t",), "s")
    tags = Attribution.from_settings(
        ("auth.attribution", AttributionSettings(tags=AttributionRule(pinned=["b", "a", "a"])))
    )
    assert tags.settle(None, ("z",), None) == (None, ("a", "b"), None)


def write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


UP = "upstreams: [{name: a, base_url: 'http://x'}]\n"


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        ("auth: {allow_unmetered: ['FETCH files']}", "unknown method 'FETCH' - at `$.auth`"),
        ("auth: {allow_unmetered: ['/v1/files']}", "no leading '/'"),
        ("virtual_keys: [{name: k, key: k1, allow_unmetered: ['GET']}]", "at `$.virtual_keys[0]`"),
        ("auth: {attribution: {end_user: {pinned: a, prefix: b}}}", "at most one of pinned, allow and prefix"),
        ("auth: {attribution: {end_user: {pinned: [a, b]}}}", "end_user.pinned is one value"),
        ("auth: {attribution: {session: {pinned: a, required: true}}}", "required means nothing with pinned"),
        ("auth: {attribution: {user: {pinned: a}}}", "unknown field `user`"),
    ],
)
def test_config_errors_name_the_setting(tmp_path, yaml, message):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, UP + yaml + "\n"))
    assert message in str(info.value)


def test_config_defaults():
    auth = AuthConfig()
    assert auth.allow_unmetered == [
        "GET models",
        "GET models/*",
        "POST messages/count_tokens",
        "POST responses/input_tokens",
    ]
    assert auth.attribution == AttributionSettings()


EXPIRING = """\
upstreams: [{{name: sim, base_url: "{url}/openai/v1", provider: openai, api_key_env: SIM_UPSTREAM_KEY}}]
auth: {{mode: virtual_keys}}
virtual_keys:
  - {{name: ci, key: tw-ci-key-0001, expires: 2020-01-01}}                          # a date: midnight UTC
  - {{name: contractor, key: tw-contractor-0001, expires: "2099-01-31T18:00:00+01:00"}}
  - {{name: ops, key: tw-ops-admin-0001, role: admin, expires: 2020-06-01T09:30:00+02:00}}
"""


def test_config_keys_expire_with_a_401_key_expired_and_its_row(start_proxy, simulator, tmp_path, monkeypatch):
    """Before: a config key had no ``expires`` (unknown field); only ``keys create --expires`` keys could expire."""
    import hashlib

    import httpx
    import openai

    monkeypatch.setenv("SIM_UPSTREAM_KEY", "sk-upstream")
    path = tmp_path / "c.yaml"
    path.write_text(EXPIRING.format(url=simulator.url))
    config = load_config(path)
    proxy = start_proxy(upstreams=config.upstreams, auth="virtual_keys", keys=config.virtual_keys)

    def ask(key: str):
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0)
        return client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])

    assert ask("tw-contractor-0001").usage.prompt_tokens == 8  # not expired: served
    with pytest.raises(openai.AuthenticationError) as info:
        ask("tw-ci-key-0001")
    assert info.value.status_code == 401 and info.value.body == {
        "message": "The tokenward virtual key 'ci' expired at 2020-01-01T00:00:00+00:00: ask your admin for a new one.",
        "type": "invalid_request_error",
        "param": None,
        "code": "key_expired",
    }
    # an expired admin key opens neither /metrics nor the dashboard's API (it did, for stored keys too)
    metrics = httpx.get(f"{proxy.url}/metrics", headers={"authorization": "Bearer tw-ops-admin-0001"})
    assert metrics.status_code == 401
    with pytest.raises(openai.AuthenticationError) as admin:
        ask("tw-ops-admin-0001")
    assert "'ops' expired at 2020-06-01T09:30:00+02:00" in admin.value.body["message"]
    rows = sorted(proxy.rows(expect=3), key=lambda r: r["started_at"])  # /metrics has no row
    # each refusal's row names the expired key (before: "anonymous", as for a key nobody knows)
    assert [(r["principal"], r["key_id"], r["http_status"], r["outcome"], r["upstream"]) for r in rows] == [
        ("contractor", "vk-" + hashlib.sha256(b"tw-contractor-0001").hexdigest()[:12], 200, "ok", "sim"),
        ("ci", "vk-" + hashlib.sha256(b"tw-ci-key-0001").hexdigest()[:12], 401, "unauthorized", None),
        ("ops", "vk-" + hashlib.sha256(b"tw-ops-admin-0001").hexdigest()[:12], 401, "unauthorized", None),
    ]
    assert "'ci' expired at" in rows[1]["error"] and "'ops' expired at" in rows[2]["error"]
