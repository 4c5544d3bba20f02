"""The SSE splitter: any split of the bytes gives the same events, and nothing is lost."""

from __future__ import annotations

import json
import random

from hypothesis import given
from hypothesis import strategies as st

from tokenward.proxy.sse import Elider, Fragment, SSEDecoder, parse_event

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


def test_an_event_over_the_cap_comes_back_as_fragments_whatever_the_split():
    big = b"data: " + b"x" * 200 + b"\n\n"
    data = b"data: 1\n\n" + big + b"data: 2\n\n"
    for offset in range(len(data) + 1):
        decoder = SSEDecoder(max_event_bytes=64)
        blocks = decoder.feed(data[:offset]) + decoder.feed(data[offset:]) + decoder.flush()
        assert b"".join(blocks) == data, offset  # nothing lost, nothing reordered
        events = [parse_event(b) for b in blocks if not isinstance(b, Fragment)]
        assert events == [(None, b"1"), (None, b"2")], offset
        assert b"".join(b for b in blocks if isinstance(b, Fragment)) == big and decoder.overflowed


def test_an_endless_event_is_passed_on_as_it_comes_and_not_held():
    decoder = SSEDecoder(max_event_bytes=1000)
    passed = 0
    for _ in range(100):
        blocks = decoder.feed(b"y" * 300)
        passed += sum(len(b) for b in blocks if isinstance(b, Fragment))
        assert len(decoder._buffer) <= 1000 + 300  # the cap plus one read, never the whole event
    assert passed >= 100 * 300 - 1000 - 3 and decoder.overflowed
    tail = decoder.feed(b"\n\ndata: after\n\n")
    assert isinstance(tail[0], Fragment) and parse_event(tail[1]) == (None, b"after")
    assert not isinstance(tail[1], Fragment)


def test_crlf_boundaries_across_reads_with_the_lookbehind():
    data = b"data: a\r\n\r\ndata: b\r\rdata: c\n\r\n"
    expected = [(None, b"a"), (None, b"b"), (None, b"c")]
    for first in range(len(data) + 1):
        for second in range(first, len(data) + 1):
            blocks = split_all(data, [first, second])
            assert [parse_event(b) for b in blocks] == expected and b"".join(blocks) == data, (first, second)


def elided(event: bytes, cuts: list[int], keep: int = 40, limit: int = 1 << 20) -> bytes | None:
    elider = Elider(keep=keep, limit=limit)
    for start, end in zip([0, *cuts], [*cuts, len(event)], strict=True):
        elider.feed(event[start:end])
    return elider.result()


def test_an_oversized_events_copy_empties_its_long_strings_wherever_the_pieces_split():
    document = {
        "type": "response.completed",
        "b64": "QUJD" * 50,
        "escaped": 'a "quoted" \\ back\\slash \u00e9\u20ac\U0001f600 and more text, more than 40 bytes',
        "short": 'x"y \u00e9\\',
        "usage": {"input_tokens": 12, "output_tokens": 4},
    }
    expected = {**document, "b64": "", "escaped": ""}
    for ascii_only in (True, False):  # escapes, or raw UTF-8 (a character is never split)
        event = b"event: response.completed\ndata: " + json.dumps(document, ensure_ascii=ascii_only).encode() + b"\n\n"
        for offset in range(len(event) + 1):
            for second in (offset, min(offset + 1, len(event)), min(offset + 7, len(event))):
                copy = elided(event, sorted({offset, second}))
                assert copy is not None
                name, data = parse_event(copy)
                assert (name, json.loads(data)) == ("response.completed", expected), (offset, second)
    # unicode and escapes kept whole when the string is short enough
    small = b'data: {"t":"\\u00e9\\"\xc3\xa9"}\n\n'
    assert elided(small, [13, 14, 15, 19], keep=64) == small


def test_an_oversized_events_copy_is_bounded():
    event = b'data: {"parts":[' + b",".join([b'"abc"'] * 1000) + b"]}\n\n"
    assert elided(event, [100], keep=8, limit=1000) is None  # many short strings: the copy would pass the limit
    assert elided(b'data: {"cut": "abc', [], keep=8) is None  # ended inside a string
