"""Byte-exact JSON member edits: every byte outside the edited member is kept."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenward.proxy.splice import Member, find_member, remove_member, set_member


def test_find_member_skips_nested_members_and_strings():
    doc = b'{"a": {"usage": 1}, "text": "\\"usage\\": {", "usage" : {"x": [1, {"y": "}"}]}, "b": "usage"}'
    member = find_member(doc, "usage")
    assert member is not None and doc[member.value_start : member.value_end] == b'{"x": [1, {"y": "}"}]}'
    assert doc[member.key_start : member.key_start + 7] == b'"usage"'
    assert find_member(doc, "missing") is None
    assert find_member(b'[{"usage": 1}]', "usage") is None  # not an object
    assert find_member(b'{"usage": ', "usage") is None  # cut short
    assert find_member(b'{"us\\u0061ge": 5}', "usage") == Member(1, 15, 16)  # escaped key names match
    assert find_member(b'{"usage": 1, "usage": 2}', "usage") == Member(13, 22, 23)  # the last one wins


def test_remove_member_takes_one_comma_with_it():
    assert remove_member(b'{"choices":[],"usage":{"p":1}}', "usage") == b'{"choices":[]}'
    assert remove_member(b'{"usage":{"p":1}, "id":"c"}', "usage") == b'{"id":"c"}'
    assert remove_member(b'{ "usage" : null }', "usage") == b"{  }"
    assert remove_member(b'{"id":"c" ,\n "usage":3,"x":1}', "usage") == b'{"id":"c" ,"x":1}'
    assert remove_member(b'{"id":"c"}', "usage") is None


def test_set_member_replaces_in_place_or_adds_first():
    assert set_member(b'{"include_usage":false , "x":1}', "include_usage", b"true") == b'{"include_usage":true , "x":1}'
    assert set_member(b"{ }", "include_usage", b"true") == b'{"include_usage":true }'
    assert set_member(b'{"x":1}', "include_usage", b"true") == b'{"include_usage":true,"x":1}'
    nested = b'{"model":"m","stream_options":{"include_obfuscation":false}}'
    member = find_member(nested, "stream_options")
    assert member is not None
    assert (
        set_member(nested, "include_usage", b"true", member.value_start)
        == b'{"model":"m","stream_options":{"include_usage":true,"include_obfuscation":false}}'
    )
    assert set_member(b"[1]", "x", b"1") is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
names = st.sampled_from(["usage", "stream_options", "x", 'q"uote', "é", "include_usage"])


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.text(max_size=8) | names, json_values, min_size=1, max_size=6), names, json_values, st.booleans()
)
def test_edits_match_decode_edit_encode_and_keep_the_rest(document, name, value, spaced):
    doc = json.dumps(document, indent=1 if spaced else None, ensure_ascii=not spaced).encode()
    removed = remove_member(doc, name)
    if name in document:
        assert removed is not None
        expected = {k: v for k, v in document.items() if k != name}
        assert json.loads(removed) == expected
        assert deletes_one_span(doc, removed)
    else:
        assert removed is None
    encoded = json.dumps(value).encode()
    edited = set_member(doc, name, encoded)
    assert edited is not None and json.loads(edited) == {**document, name: value}
    if name not in document:
        assert deletes_one_span(edited, doc)  # only the new member (and a comma) was added


def deletes_one_span(longer: bytes, shorter: bytes) -> bool:
    """Whether ``shorter`` is ``longer`` with one contiguous run of bytes cut out."""
    prefix = 0
    while prefix < len(shorter) and longer[prefix] == shorter[prefix]:
        prefix += 1
    return longer.endswith(shorter[prefix:]) and len(longer) > len(shorter)
