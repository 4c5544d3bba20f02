"""Claude Code's metadata.user_id: the account (or device) is the end user, the session the session."""

from __future__ import annotations

import json

import anthropic
import pytest

from tokenward.proxy.dialects.claude_code import ClaudeCodeIdentity, parse_user_id
from tokenward.proxy.simulator import RECORD_HEADER, Recording

DEVICE = "0123456789abcdef" * 4
ACCOUNT = "bbbbbbbb-bbbb-4bbb-8bbb-bbbbbbbbbbbb"
SESSION = "aaaaaaaa-aaaa-4aaa-8aaa-aaaaaaaaaaaa"


@pytest.mark.parametrize(
    ("user_id", "expected"),
    [
        # Claude Code 2.1.78 and later: a JSON string
        (json.dumps({"device_id": DEVICE, "account_uuid": ACCOUNT, "session_id": SESSION}), (ACCOUNT, SESSION)),
        # an API-key login has no account: the device is the user
        (json.dumps({"device_id": DEVICE, "account_uuid": "", "session_id": SESSION}), (DEVICE, SESSION)),
        # the older concatenated form
        (f"user_{DEVICE}_account_{ACCOUNT}_session_{SESSION}", (ACCOUNT, SESSION)),
        (f"user_{DEVICE}_account__session_{SESSION}", (DEVICE, SESSION)),
        # anything else is an ordinary end-user id, kept as sent
        ("customer-42", ("customer-42", None)),
        ('{"not": "claude code"}', ('{"not": "claude code"}', None)),
        ("{broken json", ("{broken json", None)),
        (f"user_{DEVICE[:10]}_account__session_{SESSION}", (f"user_{DEVICE[:10]}_account__session_{SESSION}", None)),
    ],
)
def test_user_id_forms(user_id, expected):
    assert parse_user_id(user_id) == ClaudeCodeIdentity(*expected)


def test_not_a_string_is_no_identity():
    assert parse_user_id(None) is None and parse_user_id(42) is None and parse_user_id({"id": 1}) is None


def test_claude_code_requests_are_attributed_to_the_account_and_session(start_proxy, simulator):
    proxy = start_proxy()
    request = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": json.dumps({"device_id": DEVICE, "account_uuid": ACCOUNT, "session_id": SESSION})},
    }
    body = {
        "id": "msg_cc",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5-20250929",
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 10, "output_tokens": 2},
    }
    response = {"status": 200, "content_type": "application/json", "body": body}
    simulator.simulator.add(
        Recording(
            "claude-code", "anthropic", "anthropic", "anthropic_messages", False, {"body": request}, response, None
        )
    )
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0)
    headers = {RECORD_HEADER: "claude-code", "x-tokenward-upstream": "anthropic"}
    for _ in range(2):
        client.messages.create(
            model=request["model"],
            max_tokens=64,
            messages=request["messages"],
            metadata=request["metadata"],
            extra_headers=headers,
        )
    client.messages.create(
        model=request["model"],
        max_tokens=64,
        messages=request["messages"],
        metadata=request["metadata"],
        extra_headers={**headers, "x-tokenward-session": "agent-run-7"},  # an explicit session wins
    )
    client.close()
    rows = proxy.rows(3)
    assert [(r["end_user"], r["session_id"]) for r in rows] == [
        (ACCOUNT, SESSION),
        (ACCOUNT, SESSION),
        (ACCOUNT, "agent-run-7"),
    ]
    # the client's metadata goes upstream unchanged
    assert json.loads(simulator.simulator.requests[-1]["body"])["metadata"] == request["metadata"]
