"""The one escaping function for client-supplied text, and the log filter built on it."""

from __future__ import annotations

import io
import logging

from uvicorn.logging import AccessFormatter

from tokenward.reports.sanitize import EscapeControlChars, printable


def test_printable_escapes_controls_separators_and_bidi_and_keeps_the_rest():
    assert printable("gpt-4o") == "gpt-4o"
    assert printable("a\r\nb\tc\x00d\x7fe\x85f") == "a\\x0d\\x0ab\\x09c\\x00d\\x7fe\\x85f"
    assert printable("x\u2028y\u2029z") == "x\\u2028y\\u2029z"
    assert printable("\u202eexe.txt\u2066") == "\\u202eexe.txt\\u2066"
    assert printable("модель 模型 🤖 é") == "модель 模型 🤖 é"  # other scripts and emoji are kept
    assert printable(None) == "None" and printable(42) == "42"


def test_printable_cuts_to_a_limit():
    assert printable("abcdef", 4) == "abc…"
    assert printable("abcd", 4) == "abcd"
    assert printable("a\nb", 4) == "a\\x…"  # counted after escaping: the result never exceeds the limit
    assert len(printable("\n" * 100, 10)) == 10


def test_the_filter_escapes_messages_and_arguments_and_keeps_numbers_formattable():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(EscapeControlChars())
    logger = logging.getLogger("tokenward.test.sanitize")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("model %s after %d tries, %r", "a\r\nFORGED", 3, ValueError("bad\nline"))
        logger.warning("f-string model a\r\nFORGED")
        logger.warning("%(who)s said", {"who": "b\nFORGED"})
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue().splitlines() == [
        "model a\\x0d\\x0aFORGED after 3 tries, ValueError('bad\\nline')",
        "f-string model a\\x0d\\x0aFORGED",
        "b\\x0aFORGED said",
    ]


def test_the_filter_keeps_uvicorns_access_formatter_working():
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("1.2.3.4:5", "GET", "/a\r\nb", "1.1", 404),
        None,
    )
    assert EscapeControlChars().filter(record)
    line = AccessFormatter("%(client_addr)s - %(request_line)s %(status_code)s", use_colors=False).format(record)
    assert line == "1.2.3.4:5 - GET /a\\x0d\\x0ab HTTP/1.1 404 Not Found"
