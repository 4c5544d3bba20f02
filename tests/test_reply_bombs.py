"""A compressed reply is decoded for the meter within a bound, whatever its compression ratio.

The client gets the upstream's bytes as sent; the meter reads a decoded copy. Before, that copy
was decoded whole: a broken or hostile upstream's 306 KB gzip body of 300 MiB of spaces raised
the proxy's peak memory by 610 MiB, a 1 MB one of 1 GiB by 2 GiB, and so on until the kernel killed
the proxy with every request in flight. Now a whole reply decodes to at most ``MAX_DECODED_BODY_BYTES`` (128 MiB,
what the relay holds of an uncompressed reply) and a streamed chunk to ``MAX_DECODED_CHUNK_BYTES``;
past that the reply is relayed but not metered (``usage_unknown``: the request's bound is kept
as spend).
"""

from __future__ import annotations

import gzip
import json
import zlib
from decimal import Decimal

import brotli
import httpx
import pytest
import zstandard

from tokenward.proxy import metering
from tokenward.proxy.reply_coding import DecodedTooLarge, reply_decoder

from .conftest import read_rows
from .raw_upstream import RawUpstream
from .test_http_edge_attacks import KEY, PROVIDER_KEY, proxy

MIB = 1 << 20

CHAT = {
    "id": "chatcmpl-bomb",
    "object": "chat.completion",
    "model": "gpt-4o-mini-2024-07-18",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10},
}


def compress(coding: str, data: bytes) -> bytes:
    if coding == "gzip":
        return gzip.compress(data, 6)
    if coding == "deflate":
        return zlib.compress(data, 6)
    if coding == "br":
        return brotli.compress(data, quality=5)
    return zstandard.ZstdCompressor(level=3).compress(data)


CODINGS = ["gzip", "deflate", "br", "zstd"]


@pytest.fixture(autouse=True)
def provider_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_KEY", PROVIDER_KEY)


@pytest.mark.parametrize("coding", CODINGS)
def test_each_coding_decodes_piece_by_piece_and_stops_past_its_room(coding):
    text = json.dumps(CHAT).encode() * 2000  # ~500 KB of JSON
    packed = compress(coding, text)
    decoder = reply_decoder(coding)
    assert decoder is not None
    out = b"".join(decoder.decode(packed[i : i + 4096], MIB) for i in range(0, len(packed), 4096))
    assert out == text

    bomb = compress(coding, b" " * (64 * MIB))  # 64 MiB of spaces in a few KB (zstd and br: a few hundred bytes)
    assert len(bomb) < 256 * 1024
    with pytest.raises(DecodedTooLarge):
        reply_decoder(coding).decode(bomb, MIB)  # type: ignore[union-attr]


def test_identity_and_unknown_codings_are_not_decoded():
    assert reply_decoder(None) is None and reply_decoder("identity") is None and reply_decoder("compress") is None


def whole(coding: str, body: bytes) -> list[bytes | float | str]:
    return [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: " + coding.encode()
        + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n",
        body,
    ]  # fmt: skip


def relayed_bytes(url: str, body: dict[str, object]) -> bytes:
    """What the client receives, undecoded."""
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60
    ) as reply:
        assert reply.status_code == 200
        return b"".join(reply.iter_raw())


REQUEST = {
    "model": "gpt-4o-mini",
    "max_tokens": 2,
    "service_tier": "default",
    "messages": [{"role": "user", "content": "hi"}],
}
# The bound kept as spend when the reply is not metered (gpt-4o-mini standard: $0.15 in, $0.60 out per 1M).
# The $0.01 budget has room, so the input is bounded by its bytes: "user" and "hi" are 6, + 3 per message + 3
# = 12; ceil(12 x 1.1) + 300 = 314 in, 2 out: 314 x 0.15 + 2 x 0.60 = 48.3 -> $0.0000483.
BOUND = Decimal("0.0000483")


@pytest.mark.parametrize("coding", CODINGS)
def test_a_whole_reply_that_decodes_past_the_cap_is_relayed_and_kept_at_its_bound(tmp_path, monkeypatch, coding):
    monkeypatch.setattr(metering, "MAX_DECODED_BODY_BYTES", MIB)
    decoded = json.dumps(CHAT).encode()[:-1] + b" " * (3 * MIB) + b"}"  # valid JSON, 3 MiB decoded
    packed = compress(coding, decoded)
    upstream = RawUpstream()
    upstream.script = lambda head, sent: whole(coding, packed)
    with upstream.running(), proxy(upstream.url, tmp_path / "l.duckdb") as url:
        assert relayed_bytes(url, REQUEST) == packed  # the client's bytes are the upstream's
    (row,) = read_rows(tmp_path / "l.duckdb")
    assert (row["http_status"], row["outcome"], row["price_status"], row["cost_usd"]) == (
        200,
        "ok",
        "usage_unknown",
        None,
    )
    assert row["error"] == "the reply decodes to more than 1,048,576 bytes: relayed, not metered"
    assert row["reserved_usd"] == BOUND


def test_a_whole_reply_within_the_cap_is_metered_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(metering, "MAX_DECODED_BODY_BYTES", MIB)
    decoded = json.dumps(CHAT).encode()[:-1] + b" " * (MIB // 2) + b"}"
    packed = compress("gzip", decoded)
    upstream = RawUpstream()
    upstream.script = lambda head, sent: whole("gzip", packed)
    with upstream.running(), proxy(upstream.url, tmp_path / "l.duckdb") as url:
        assert relayed_bytes(url, REQUEST) == packed
    (row,) = read_rows(tmp_path / "l.duckdb")
    # 8 x $0.15 + 2 x $0.60 per 1M = $0.0000024
    assert (row["price_status"], row["input_tokens"], row["output_tokens"], row["cost_usd"]) == (
        "priced",
        8,
        2,
        Decimal("0.0000024"),
    )


def test_a_streamed_chunk_that_decodes_past_the_cap_is_relayed_and_kept_at_its_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(metering, "MAX_DECODED_CHUNK_BYTES", MIB)
    first = b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'  # noqa: E501
    usage = b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":8,"completion_tokens":2,"total_tokens":10}}\n\n'  # noqa: E501
    packer = zlib.compressobj(6, zlib.DEFLATED, 31)
    pieces = [
        packer.compress(first) + packer.flush(zlib.Z_SYNC_FLUSH),
        packer.compress(b": " + b" " * (3 * MIB) + b"\n\n") + packer.flush(zlib.Z_SYNC_FLUSH),  # one chunk, 3 MiB
        packer.compress(usage + b"data: [DONE]\n\n") + packer.flush(),
    ]
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n"  # noqa: E501
    steps: list[bytes | float | str] = [head]
    for piece in pieces:
        steps += [b"%x\r\n" % len(piece) + piece + b"\r\n", 0.05]
    steps.append(b"0\r\n\r\n")
    upstream = RawUpstream()
    upstream.script = lambda head, sent: list(steps)
    with upstream.running(), proxy(upstream.url, tmp_path / "l.duckdb") as url:
        # the client asked for usage, so its stream is relayed as sent (compressed)
        streamed = {**REQUEST, "stream": True, "stream_options": {"include_usage": True}}
        assert relayed_bytes(url, streamed) == b"".join(pieces)
    (row,) = read_rows(tmp_path / "l.duckdb")
    assert (row["http_status"], row["price_status"], row["cost_usd"]) == (200, "usage_unknown", None)
    assert row["error"] == "the reply decodes to more than 1,048,576 bytes: relayed, not metered"
    assert row["reserved_usd"] == BOUND
