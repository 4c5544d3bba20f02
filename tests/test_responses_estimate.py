"""A Responses request's input is estimated with its message overhead, as OpenAI bills it.

A real proxy in front of :class:`~tests.raw_upstream.RawUpstream`, whose Responses replies carry
no usage, so the row is a tokenizer estimate; the real ``openai`` SDK as client. Builtin prices:
gpt-4o-mini 0.15 in / 0.60 out per 1M tokens. Counts are o200k_base: "hello world" is 2 tokens,
"Be brief." 3, "Hi" 1. OpenAI's recipe (Chat Completions, and recorded Responses usage to the
token): each message adds 3 tokens and its role (1), the reply's priming 3.
"""

from __future__ import annotations

import json
from decimal import Decimal

import openai
import pytest

from .raw_upstream import json_reply

REPLY = {"id": "resp_1", "object": "response", "status": "completed", "model": "gpt-4o-mini", "error": None,
         "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                     "content": [{"type": "output_text", "text": "Hi", "annotations": []}]}]}  # fmt: skip


@pytest.fixture
def proxy(raw_proxy):
    return raw_proxy()


CASES = [
    # a bare string is one user message: 2 + 1 + 3 + 3 = 9 (before: 2, no overhead)
    ({"input": "hello world"}, 9),
    ({"input": [{"role": "user", "content": "hello world"}]}, 9),
    # instructions are a message too: 2 + 3 + 2 x (1 + 3) + 3 = 16
    ({"instructions": "Be brief.", "input": "hello world"}, 16),
]


@pytest.mark.parametrize(("request_body", "input_tokens"), CASES, ids=["string", "message", "instructions"])
def test_a_responses_input_is_estimated_with_its_message_overhead(proxy, raw_upstream, request_body, input_tokens):
    raw_upstream.script = lambda head, body: [json_reply(json.dumps(REPLY).encode())]
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as client:
        client.responses.create(model="gpt-4o-mini", **request_body)
    (row,) = proxy.rows(1)
    assert (row["usage_source"], row["input_tokens"], row["output_tokens"]) == ("estimated", input_tokens, 1)
    # input x 0.15 + 1 x 0.60 per 1M
    assert row["cost_usd"] == (Decimal(input_tokens) * Decimal("0.15") + Decimal("0.60")) / 1_000_000
