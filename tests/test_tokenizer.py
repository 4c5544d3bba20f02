"""Offline tokenizer data: genuine (sha256-checked), loads with no network."""

from __future__ import annotations

import hashlib
from importlib import resources

import pytest

from tokenward.proxy import tokenizer


@pytest.mark.parametrize("name", ["o200k_base", "cl100k_base"])
def test_shipped_files_match_published_sha256(name):
    data = (resources.files("tokenward.proxy") / "tokenizer_data" / f"{name}.tiktoken").read_bytes()
    assert hashlib.sha256(data).hexdigest() == tokenizer.SHA256[name]


def test_published_hashes_are_tiktokens_own():
    source = (resources.files("tiktoken_ext") / "openai_public.py").read_text()
    for digest in tokenizer.SHA256.values():
        assert digest in source


def test_counts_match_known_values():
    assert tokenizer.count_tokens("hello world", "o200k_base") == 2
    assert tokenizer.get_encoding("cl100k_base").encode("hello world") == [15339, 1917]
    assert tokenizer.get_encoding("o200k_base").encode("hello world") == [24912, 2375]
    assert tokenizer.count_tokens("", "o200k_base") == 0


def test_model_to_encoding():
    assert tokenizer.encoding_for_model("gpt-4o-2024-08-06") == "o200k_base"
    assert tokenizer.encoding_for_model("gpt-4") == "cl100k_base"
    assert tokenizer.encoding_for_model("openai/gpt-4.1-mini") == "o200k_base"
    assert tokenizer.encoding_for_model("claude-sonnet-4-5") == "o200k_base"


def test_tampered_data_is_refused(monkeypatch):
    monkeypatch.setitem(tokenizer.SHA256, "cl100k_base", "0" * 64)
    monkeypatch.setattr(tokenizer, "_loaded", {})
    with pytest.raises(tokenizer.TokenizerDataError, match="sha256"):
        tokenizer.get_encoding("cl100k_base")
