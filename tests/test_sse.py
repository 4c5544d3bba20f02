"""The SSE splitter: any split of the bytes gives the same events, and nothing is lost."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from tokenward.proxy.sse import SSEDecoder, parse_event

STREAM = (
    b": OPENROUTER PROCESSING\n\n"
    b'data: {"a":1}\n\n'
    b'event: response.completed\ndata: {"b":2}\n\n'
    b'data:{"c":3}\n\n'
    b"data: line1\ndata: line2\n\n"
    b"data: [DONE]\n\n"
)


def split_all(data: bytes, cuts: list[int]) -> list[bytes]:
    decoder = SSEDecoder()
    blocks: list[bytes] = []
    start = 0
    for cut in sorted(cuts) + [len(data)]:
        blocks += decoder.feed(data[start:cut])
        start = cut
    return blocks + decoder.flush()


def test_whole_stream_splits_into_events():
    blocks = split_all(STREAM, [])
    assert [parse_event(b) for b in blocks] == [
        (None, None),
        (None, b'{"a":1}'),
        ("response.completed", b'{"b":2}'),
        (None, b'{"c":3}'),
        (None, b"line1\nline2"),
        (None, b"[DONE]"),
    ]
    assert b"".join(blocks) == STREAM


def test_every_single_split_offset_gives_the_same_events():
    expected = split_all(STREAM, [])
    for offset in range(len(STREAM) + 1):
        assert split_all(STREAM, [offset]) == expected, offset


def test_crlf_and_cr_line_endings():
    data = b"data: one\r\n\r\nevent: x\rdata: two\r\rdata: three\n\n"
    blocks = split_all(data, [])
    assert [parse_event(b) for b in blocks] == [(None, b"one"), ("x", b"two"), (None, b"three")]
    for offset in range(len(data) + 1):
        assert [parse_event(b) for b in split_all(data, [offset])] == [parse_event(b) for b in blocks], offset


def test_unterminated_last_event_is_returned_by_flush():
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"x":1}\n\ndata: {"y"') == [b'data: {"x":1}\n\n']
    assert decoder.flush() == [b'data: {"y"']
    assert decoder.flush() == []


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_random_splits_are_lossless(cuts):
    assert split_all(STREAM, cuts) == split_all(STREAM, [])


def test_many_events_in_one_read():
    data = b"".join(b"data: %d\n\n" % i for i in range(1000))
    blocks = SSEDecoder().feed(data)
    assert len(blocks) == 1000 and parse_event(blocks[-1]) == (None, b"999")
    rng = random.Random(7)
    cuts = rng.sample(range(len(data)), 200)
    assert split_all(data, cuts) == blocks
