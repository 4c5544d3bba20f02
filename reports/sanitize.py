r"""Escaping control characters in client-supplied text: mail headers, chat messages, log lines.

A model name, key name, tag, user id or request path is whatever a client sent. A CR or LF in
one makes the stdlib refuse a mail header that holds it (so every mail about that model
fails), forges extra lines in a log file or a webhook message, and bidirectional-override
characters make a line read differently from what it holds. :func:`printable` is the one
escaping function, used at each of those boundaries; :class:`EscapeControlChars` applies it to
every log record, and :func:`escape_log_lines` installs it on the configured log handlers.

Escaped: C0 controls (tab, CR and LF included), DEL, C1 controls, U+2028/U+2029 (line and
paragraph separators) and the bidi embedding, override and isolate characters, each as
``\xNN`` or ``\uNNNN``. Everything else, other scripts and emoji included, is kept.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

__all__ = ["EscapeControlChars", "escape_log_lines", "printable"]

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: object, limit: int | None = None) -> str:
    """``value`` as text on one line, control characters escaped, cut to ``limit`` characters.

    Args:
        value: any object (``str()`` is taken of non-strings).
        limit: longest result in characters (the last one then is ``…``); ``None``: no limit.
    """
    text = value if isinstance(value, str) else str(value)
    if _UNSAFE.search(text) is not None:
        text = _UNSAFE.sub(_escape, text)
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 1, 0)] + "…"
    return text


class _Escaped:
    """A log argument that is escaped when the record is formatted (``%s`` or ``%r``)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return printable(self.value)

    def __repr__(self) -> str:
        return printable(repr(self.value))


def _safe_arg(arg: Any) -> Any:
    if isinstance(arg, str):
        return printable(arg)
    if arg is None or isinstance(arg, int | float | Decimal):  # numbers keep %d and %f working
        return arg
    return _Escaped(arg)


class EscapeControlChars(logging.Filter):
    """A logging filter escaping control characters in a record's message and arguments.

    Arguments are escaped one by one, so formatters that read ``record.args`` (uvicorn's access
    log) keep working; exception tracebacks are left as they are (they are multi-line by design
    and their text comes from tokenward's code).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Escape ``record`` in place; never drops it."""
        if isinstance(record.msg, str):
            record.msg = printable(record.msg)
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(_safe_arg(a) for a in args)
        elif isinstance(args, Mapping):
            record.args = {k: _safe_arg(v) for k, v in args.items()}
        return True


def escape_log_lines() -> None:
    """Add :class:`EscapeControlChars` to every handler configured so far (idempotent).

    Covers the root logger's handlers and those of named loggers (uvicorn's ``default`` and
    ``access`` handlers); call it after logging is configured.
    """
    loggers: list[logging.Logger] = [logging.getLogger()]
    loggers += [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(f, EscapeControlChars) for f in handler.filters):
                handler.addFilter(EscapeControlChars())
