"""Request and stream edits: asking for stream usage, and hiding what that added."""

from __future__ import annotations

import json

import httpx
import msgspec

from tokenward.proxy.forward import _with_include_usage
from tokenward.proxy.relay import strip_usage as _strip_usage
from tokenward.proxy.simulator import RECORD_HEADER

CHAT = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"


def test_include_usage_is_spliced_without_reencoding():
    body = b'  {"model": "gpt-4o", "stream": true, "messages": [{"role": "user", "content": "h\\u00e9"}]}'
    out = _with_include_usage(body, msgspec.UNSET)
    assert (
        out
        == b'  {"stream_options":{"include_usage":true},"model": "gpt-4o", "stream": true, "messages": [{"role": "user", "content": "h\\u00e9"}]}'
    )
    assert json.loads(out)["stream_options"] == {"include_usage": True}


def test_existing_stream_options_are_edited_in_place_without_reencoding():
    body = b'{"model": "m", "stream": true, "stream_options": {"include_obfuscation": false}, "x": "\\u00e9", "n": 1.0}'
    assert (
        _with_include_usage(body, {"include_obfuscation": False})
        == b'{"model": "m", "stream": true, "stream_options": {"include_usage":true,"include_obfuscation": false}, "x": "\\u00e9", "n": 1.0}'
    )
    asked_not = b'{"stream_options": {"include_usage": false}, "stream": true, "messages": [{"content": "1e2"}]}'
    assert (
        _with_include_usage(asked_not, {"include_usage": False})
        == b'{"stream_options": {"include_usage": true}, "stream": true, "messages": [{"content": "1e2"}]}'
    )
    null = _with_include_usage(b'{"model":"m","stream":true,"stream_options":null, "n": 1E2}', None)
    assert null == b'{"model":"m","stream":true,"stream_options":{"include_usage":true}, "n": 1E2}'
    assert json.loads(null)["stream_options"] == {"include_usage": True}


def test_include_usage_into_an_empty_object_needs_no_comma():
    for body in (b"{}", b"{ \n\t}", b' { "model" : "m" } '):
        out = _with_include_usage(body, msgspec.UNSET)
        assert json.loads(out)["stream_options"] == {"include_usage": True}
        assert out.count(b",") == (0 if b"model" not in body else 1)


def test_existing_stream_options_are_kept():
    body = b'{"model":"m","stream":true,"stream_options":{"include_obfuscation":false}}'
    out = json.loads(_with_include_usage(body, {"include_obfuscation": False}))
    assert out["stream_options"] == {"include_obfuscation": False, "include_usage": True}
    null = json.loads(_with_include_usage(b'{"model":"m","stream":true,"stream_options":null}', None))
    assert null["stream_options"] == {"include_usage": True}


def test_strip_usage_removes_only_what_include_usage_added():
    chunk = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null,"obfuscation":"x"}\n\n'
    assert (
        _strip_usage(chunk)
        == b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}],"obfuscation":"x"}\n\n'
    )
    usage_only = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    assert _strip_usage(usage_only) == b""
    azure_first = b'data: {"choices":[],"created":0,"id":"","model":"","prompt_filter_results":[]}\n\n'
    assert _strip_usage(azure_first) == azure_first
    # usage that tokenward made ride on a chunk with choices: the member goes, the chunk stays
    finishing = b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":3},"x":1}\n\n'
    assert _strip_usage(finishing) == b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"x":1}\n\n'
    first = b'data:{"usage": {"prompt_tokens": 3}, "choices": [{"delta": {"content": "usage"}}]}\r\n\r\n'
    assert _strip_usage(first) == b'data:{"choices": [{"delta": {"content": "usage"}}]}\r\n\r\n'
    spaced_null = b'data: {"choices":[{"delta":{}}], "usage": null}\n\n'
    assert _strip_usage(spaced_null) == b'data: {"choices":[{"delta":{}}]}\n\n'
    nested = b'data: {"choices":[{"delta":{}}],"x_groq":{"usage":{"prompt_tokens":3}}}\n\n'
    assert _strip_usage(nested) == nested  # not the member include_usage adds
    assert _strip_usage(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def test_client_headers_are_forwarded_and_tokenward_headers_are_not(start_proxy, simulator, sample):
    proxy = start_proxy()
    body = sample[CHAT].request["body"]
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=body,
        headers={
            RECORD_HEADER: CHAT,
            "x-tokenward-upstream": "openai",
            "openai-organization": "org-1",
            "authorization": "Bearer sk-client",
            "accept-encoding": "gzip",
        },
    )
    assert reply.status_code == 200
    sent = simulator.simulator.requests[-1]["headers"]
    assert sent["openai-organization"] == "org-1" and sent["authorization"] == "Bearer sk-client"
    assert "x-tokenward-upstream" not in sent
    assert sent["accept-encoding"] == "gzip"  # the client's own, not one of tokenward's
    assert "user-agent" not in sent or sent["user-agent"].startswith("python-httpx")
    assert reply.headers["x-tokenward-request-id"]
