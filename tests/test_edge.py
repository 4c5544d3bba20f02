"""The request edge (sans-IO): path checks, URL building, the unmetered allow-list, the request dialect."""

from __future__ import annotations

import posixpath
import re
from urllib.parse import unquote_to_bytes, urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from yarl import URL

from tokenward.proxy.edge import (
    FREE_ENDPOINTS,
    METERED_ENDPOINTS,
    Base,
    EdgeError,
    UnmeteredPolicy,
    parse_base,
    request_dialect,
    target,
)

REFUSED = {
    b"/v1%2f@127.0.0.1:9/steal": "'@'",
    b"/v1/../admin": "'.' or '..' segment",
    b"/v1/x/../chat/completions": "'.' or '..' segment",
    b"/v1/./chat/completions": "'.' or '..' segment",
    b"/v1/chat/completions/.": "'.' or '..' segment",
    b"/v1/%2e%2e/%2e%2e/secret": "percent-encodes '.' (%2e)",
    b"/v1/%2E/chat/completions": "percent-encodes '.' (%2E)",
    b"//v1/chat/completions": "empty segment",
    b"/v1//chat/completions": "empty segment",
    b"/v1/models/": "empty segment",
    b"/v1/chat%2fcompletions": "percent-encodes '/' (%2f)",
    b"/v1/chat%5ccompletions": "percent-encodes '\\\\' (%5c)",
    b"/v1/chat\\completions": "a backslash",
    b"/v1/a%00b": "percent-encodes '\\x00' (%00)",
    b"/v1/a%0d%0aX-Evil:%201": "percent-encodes '\\r' (%0d)",
    b"/v1/ch%61t/completions": "percent-encodes 'a' (%61)",  # the upstream would decode it to chat/...
    b"/v1/a%252e%252e": "percent-encodes '%' (%25)",  # double encoding
    b"/v1/chat/completions;x=1": "';'",  # path parameters: some servers drop them
    b"/v1/models/%C0%AE%C0%AE%C0%AFfiles": "not UTF-8",  # overlong '../': the IIS traversal to files
    b"/v1/models/%C0%AFfiles": "not UTF-8",
    b"/v1/models/%ED%A0%80": "not UTF-8",  # a surrogate
    b"/v1/models/a%E9": "not UTF-8",  # a lone latin-1 byte
    b"/v1/a%2": "not a plain path",
    b"/v1/a%zz": "not a plain path",
    b"/v1/caf\xc3\xa9": "non-ASCII byte",
    b"/v1/a b": "a space",
    b"*": "must start with '/'",
    b"http://evil/v1/models": "must start with '/'",
}


@pytest.mark.parametrize("raw", list(REFUSED))
def test_paths_that_could_mean_two_things_are_refused_with_a_reason(raw):
    with pytest.raises(EdgeError) as info:
        target(raw, "POST")
    assert (info.value.status, info.value.code) == (400, "invalid_path")
    assert REFUSED[raw] in info.value.message


def test_plain_paths_are_routed_on_the_bytes_that_are_sent():
    chat = target(b"/v1/chat/completions", "POST", b"include%5B%5D=x%2A")
    assert chat is not None and chat.endpoint is METERED_ENDPOINTS["chat/completions"]
    assert (chat.path, chat.tail, chat.query) == ("/v1/chat/completions", "chat/completions", "include%5B%5D=x%2A")
    # other methods on a metered path, and other paths, are not metered
    assert target(b"/v1/chat/completions", "GET").endpoint is None  # type: ignore[union-attr]
    ft = target(b"/v1/models/ft%3Agpt-4o-mini%3Aacme%3A1", "GET")
    assert ft is not None and ft.tail == "models/ft%3Agpt-4o-mini%3Aacme%3A1" and ft.endpoint is None
    utf8 = target(b"/v1/models/caf%C3%A9", "GET")  # escapes that spell UTF-8 pass, as sent
    assert utf8 is not None and utf8.tail == "models/caf%C3%A9"
    # an upstream that matches paths without regard to case would serve this as chat: so is tokenward
    upper = target(b"/v1/Chat/Completions", "POST")
    assert upper is not None and upper.endpoint is METERED_ENDPOINTS["chat/completions"]
    assert upper.tail == "Chat/Completions"  # sent as it came
    assert target(b"/v1/messages", "POST").endpoint.name == "anthropic_messages"  # type: ignore[union-attr]


def test_paths_outside_v1_are_not_targets():
    for raw in (b"/", b"/healthz", b"/v1", b"/v2/chat/completions", b"/V1/models", b"/favicon.ico"):
        assert target(raw, "GET") is None


def test_query_strings_are_kept_verbatim_or_refused():
    assert target(b"/v1/models", "GET", b"a=%2A&b=*&c=%7e&d=[]").query == "a=%2A&b=*&c=%7e&d=[]"  # type: ignore[union-attr]
    for query in (b"a=b c", b"a=\x01", b"a=\xc3\xa9", b"a=1#frag"):
        with pytest.raises(EdgeError) as info:
            target(b"/v1/models", "GET", query)
        assert info.value.code == "invalid_query"


def test_base_urls_are_parsed_once_into_components():
    assert parse_base("https://api.openai.com/v1") == Base("https", "api.openai.com", 443, "/v1")
    assert parse_base("HTTPS://API.DeepSeek.com/") == Base("https", "api.deepseek.com", 443, "")
    assert parse_base("http://[::1]:8080/openai/v1/") == Base("http", "[::1]", 8080, "/openai/v1")
    for bad, reason in {
        "ftp://x/v1": "absolute http(s) URL",
        "/v1": "absolute http(s) URL",
        "https://user:pw@api.example.com/v1": "user or password",
        "https://api.example.com/v1?api-version=1": "query string",
        "https://api.example.com/a/../v1": "plain segments",
        "https://api.example.com//v1": "plain segments",
        "https://api.example.com/v1%2fx": "plain segments",
    }.items():
        with pytest.raises(ValueError, match=re.escape(reason)):
            parse_base(bad)


def test_the_url_is_built_from_components_and_keeps_the_query_bytes():
    base = parse_base("http://127.0.0.1:9000")
    url = base.url("chat/completions", "include%5B%5D=file_search_call.results%2A")
    assert str(url) == "http://127.0.0.1:9000/chat/completions?include%5B%5D=file_search_call.results%2A"
    assert url.raw_path_qs == "/chat/completions?include%5B%5D=file_search_call.results%2A"
    with_path = parse_base("https://api.openai.com/v1").url("models/ft%3Ax")
    assert str(with_path) == "https://api.openai.com/v1/models/ft%3Ax"


def test_a_url_that_leaves_the_base_is_refused():
    base = parse_base("http://127.0.0.1:9000/v1")
    for url in (
        URL("http://127.0.0.1:9001/v1/x"),
        URL("http://127.0.0.2:9000/v1/x"),
        URL("https://127.0.0.1:9000/v1/x"),
        URL("http://127.0.0.1:9000/v11/x"),
        URL("http://127.0.0.1:9000/admin"),
        URL("http://u@127.0.0.1:9000/v1/x"),
    ):
        with pytest.raises(EdgeError, match="leave the upstream's base"):
            base.check(url)
    # tails that did not come from target(): refused too, whatever their trick
    for tail in ("../admin", "x/../../admin", "./x", "x//y", "%2f@127.0.0.1:1/steal", "a%2e%2e"):
        with pytest.raises(EdgeError):
            base.url(tail)
    base.check(URL("http://127.0.0.1:9000/v1/x"))  # and the real thing passes


def test_unmetered_policy_globs_by_method():
    free = UnmeteredPolicy(FREE_ENDPOINTS)
    assert free.allows("GET", "models") and free.allows("HEAD", "models/gpt-4o") and free.allows("GET", "Models")
    assert free.allows("POST", "messages/count_tokens") and free.allows("POST", "responses/input_tokens")
    assert not free.allows("DELETE", "models/ft:gpt-4o:acme")  # deleting a fine-tune is not free
    assert not free.allows("POST", "models") and not free.allows("GET", "files")
    assert free.allows("OPTIONS", "files")  # nothing to bill or change
    files = UnmeteredPolicy(["files", "files/*", "GET batches/*"])
    assert (
        files.allows("POST", "files")
        and files.allows("DELETE", "files/file-1")
        and files.allows("GET", "files/f/content")
    )
    assert (
        files.allows("GET", "batches/b1") and not files.allows("POST", "batches") and not files.allows("GET", "models")
    )
    assert not UnmeteredPolicy([]).allows("GET", "models")
    for bad in ("FETCH files", "/v1/files", "GET ", "GET files extra", ""):
        with pytest.raises(ValueError, match="allow_unmetered entry"):
            UnmeteredPolicy([bad])


def test_request_dialect():
    assert request_dialect("messages", False) == "anthropic"
    assert request_dialect("messages/count_tokens", False) == "anthropic"
    assert request_dialect("messages/batches/b1", False) == "anthropic"
    assert request_dialect("complete", False) == "anthropic"
    assert request_dialect("models", True) == "anthropic"
    assert request_dialect("models", False) == "openai"
    assert request_dialect("chat/completions", False) == "openai"


PIECES = [
    "v1", "chat", "completions", "Chat", "models", "..", ".", "", "%2e", "%2E", "%2e%2e", "%2f", "%2F", "%5c", "\\",
    "@", "%40", "127.0.0.1:1", "evil.example", "%00", "%25", "%252e", ";", "x", "ch%61t", "%63hat", "a%20b", "~u",
    ":", "%3A", "messages", "count_tokens", "steal", "admin",
]  # fmt: skip


def remove_dot_segments(path: str) -> str:
    """RFC 3986 section 5.2.4, as an upstream that normalises would apply it."""
    normalised = posixpath.normpath(path) if path else path
    return normalised.lstrip("/") and "/" + normalised.lstrip("/")


PREFIXES = ["/v1/", "/v1/", "/v1/", "/v1/", "//v1/", "/v1%2f", "/v1%2f@127.0.0.1:1/", "/", "/v1/../", "\\v1/"]
SEPARATORS = ["/", "/", "/", "/", "/", "%2f", "%2F", "\\", "//", "/./", "/../", "%5c"]


def join(prefix: str, pieces: list[str], separators: list[str]) -> str:
    return prefix + pieces[0] + "".join(sep + piece for sep, piece in zip(separators, pieces[1:], strict=False))


paths = st.builds(
    join,
    st.sampled_from(PREFIXES),
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=6),
    st.lists(st.sampled_from(SEPARATORS), min_size=6, max_size=6),
)
"""Request paths built from the pieces attacks are made of (a few plain ones among them)."""


@settings(max_examples=500, deadline=None)
@given(paths, st.sampled_from(["", "/v1", "/openai/v1"]))
def test_whatever_passes_means_the_same_to_every_reader(raw, base_path):
    raw_bytes = raw.encode()
    try:
        found = target(raw_bytes, "POST")
    except EdgeError:
        return
    if found is None:
        return
    decoded = unquote_to_bytes(found.path).decode("utf-8", "replace")
    # no reader can find another path in it: decoding keeps the segments, normalising changes nothing
    assert decoded.split("/") == [unquote_to_bytes(s).decode("utf-8", "replace") for s in found.path.split("/")]
    assert remove_dot_segments(decoded) == decoded and "//" not in decoded and "\\" not in decoded
    # metered exactly when the path the upstream will resolve (decoded, any case) is a metered one
    assert (found.endpoint is not None) == (decoded.lower().removeprefix("/v1/") in METERED_ENDPOINTS)
    # and the URL keeps the base's origin with the tail below the base path, bytes unchanged
    url = Base("http", "127.0.0.1", 9000, base_path).url(found.tail, found.query)
    parts = urlsplit(str(url))
    assert (parts.hostname, parts.port, parts.username) == ("127.0.0.1", 9000, None)
    assert url.raw_path == base_path + raw.removeprefix("/v1")
