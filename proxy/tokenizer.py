"""Offline tiktoken encodings, for counting tokens when an upstream reports none.

The genuine ``o200k_base`` and ``cl100k_base`` rank files ship inside the package
(``tokenizer_data/``) and are checked against the sha256 that tiktoken itself expects
(``tiktoken_ext/openai_public.py``) before use, so nothing is downloaded at run time.
Encoding is CPU work (about 10 MB/s per core): callers run it off the event loop.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tiktoken

__all__ = [
    "SHA256",
    "TokenizerDataError",
    "count_tokens",
    "encoding_for_model",
    "encoding_name_known",
    "get_encoding",
    "is_loaded",
]

SHA256 = {
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
}
"""Published sha256 of each shipped rank file (tiktoken 0.14 ``openai_public.py`` ``expected_hash``)."""

# Split patterns and special tokens as defined in tiktoken_ext/openai_public.py (tiktoken 0.14).
_PATTERNS = {
    "o200k_base": "|".join(
        [
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    ),
    "cl100k_base": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",  # noqa: E501
}
_SPECIAL = {
    "o200k_base": {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
    "cl100k_base": {
        "<|endoftext|>": 100257,
        "<|fim_prefix|>": 100258,
        "<|fim_middle|>": 100259,
        "<|fim_suffix|>": 100260,
        "<|endofprompt|>": 100276,
    },
}

_lock = threading.Lock()
_loaded: dict[str, tiktoken.Encoding] = {}


class TokenizerDataError(RuntimeError):
    """A shipped rank file is missing or does not match its published sha256."""


def get_encoding(name: str) -> tiktoken.Encoding:
    """Load (once, thread-safely) and return the shipped encoding ``name``.

    Raises:
        KeyError: ``name`` is not one of the shipped encodings.
        TokenizerDataError: the rank file is missing or its sha256 differs from :data:`SHA256`.
    """
    encoding = _loaded.get(name)
    if encoding is not None:
        return encoding
    expected = SHA256[name]
    with _lock:
        if name not in _loaded:
            path = resources.files("tokenward.proxy") / "tokenizer_data" / f"{name}.tiktoken"
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise TokenizerDataError(f"tokenizer data {name} is missing: {exc}") from exc
            actual = hashlib.sha256(data).hexdigest()
            if actual != expected:
                raise TokenizerDataError(f"tokenizer data {name}: sha256 {actual} != published {expected}")
            ranks = {
                base64.b64decode(token): int(rank)
                for token, rank in (line.split() for line in data.splitlines() if line)
            }
            import tiktoken  # not at start: its extension module is over 1 MB of RSS in a proxy that never counts

            _loaded[name] = tiktoken.Encoding(
                name=name, pat_str=_PATTERNS[name], mergeable_ranks=ranks, special_tokens=_SPECIAL[name]
            )
    return _loaded[name]


def is_loaded(name: str) -> bool:
    """Whether :func:`get_encoding` returns ``name`` at once (its rank file was read already).

    Loading one takes about a second of CPU (``o200k_base``: 200,000 ranks decoded and checked):
    callers on the event loop count on it only once this is true, and go to a worker thread before.
    """
    return name in _loaded


def _encoding_name_for_model(model: str) -> str:
    """``tiktoken.model.encoding_name_for_model``, imported on the first call (raises ``KeyError``)."""
    global _encoding_name_for_model
    from tiktoken.model import encoding_name_for_model

    _encoding_name_for_model = encoding_name_for_model  # later calls go straight to tiktoken's
    return encoding_name_for_model(model)


def encoding_for_model(model: str | None) -> str:
    """Name of the shipped encoding to count ``model``'s tokens with.

    OpenAI models get the encoding tiktoken assigns them; every other model (or an OpenAI
    model using an encoding not shipped here) is approximated with ``o200k_base``.
    """
    if model:
        try:
            name = _encoding_name_for_model(model.rpartition("/")[2])
        except KeyError:
            name = ""
        if name in SHA256:
            return name
    return "o200k_base"


def encoding_name_known(model: str | None) -> bool:
    """Whether tiktoken knows ``model``'s own encoding (an OpenAI model: counts are exact)."""
    if not model:
        return False
    try:
        return _encoding_name_for_model(model.rpartition("/")[2]) in SHA256
    except KeyError:
        return False


def count_tokens(text: str, encoding: str = "o200k_base") -> int:
    """Number of tokens in ``text`` (special-token text counted as ordinary text)."""
    if not text:
        return 0
    return len(get_encoding(encoding).encode_ordinary(text))
