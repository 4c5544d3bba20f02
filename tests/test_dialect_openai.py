"""OpenAI-format usage objects of every provider variant, mapped to canonical counts."""

from __future__ import annotations

from decimal import Decimal

from tokenward.pricing.usage import Usage
from tokenward.proxy.dialects import Observation, openai


def usage(raw, tool_usage=None):
    return openai.to_usage(raw, tool_usage)


def test_openai_chat_subsets_are_not_added():
    # field case B09: cached_tokens is inside prompt_tokens
    u = usage(
        {
            "prompt_tokens": 2150,
            "completion_tokens": 120,
            "total_tokens": 2270,
            "prompt_tokens_details": {"cached_tokens": 2048, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0},
        }
    )
    assert u == Usage(input_tokens=2150, cached_input_tokens=2048, output_tokens=120)
    assert u.uncached_input_tokens == 102


def test_cache_writes_are_a_subset_of_prompt_tokens():
    u = usage(
        {
            "completion_tokens": 4,
            "prompt_tokens": 4020,
            "total_tokens": 4024,
            "prompt_tokens_details": {"audio_tokens": 0, "cache_write_tokens": 4012, "cached_tokens": 0},
        }
    )
    assert (u.input_tokens, u.cache_write_tokens, u.uncached_input_tokens) == (4020, 4012, 8)


def test_deepseek_top_level_cache_fields_read_once():
    # field case B12: only the DeepSeek fields are present
    u = usage(
        {
            "prompt_tokens": 6000,
            "completion_tokens": 300,
            "total_tokens": 6300,
            "prompt_cache_hit_tokens": 5888,
            "prompt_cache_miss_tokens": 112,
        }
    )
    assert (u.input_tokens, u.cached_input_tokens, u.uncached_input_tokens, u.output_tokens) == (6000, 5888, 112, 300)
    # both shapes present: read one, never add them
    both = usage(
        {
            "prompt_tokens": 563,
            "completion_tokens": 116,
            "prompt_cache_hit_tokens": 512,
            "prompt_cache_miss_tokens": 51,
            "prompt_tokens_details": {"cached_tokens": 512},
            "completion_tokens_details": {"reasoning_tokens": 60},
            "total_tokens": 679,
        }
    )
    assert (both.cached_input_tokens, both.reasoning_tokens) == (512, 60)


def test_mistral_and_huggingface_cache_variants():
    assert (
        usage(
            {"completion_tokens": 6, "num_cached_tokens": 32, "prompt_tokens": 64, "total_tokens": 70}
        ).cached_input_tokens
        == 32
    )
    hf = usage(
        {
            "cached_tokens": 7,
            "completion_tokens": 29,
            "prompt_tokens": 19,
            "total_tokens": 48,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
    )
    assert (hf.input_tokens, hf.cached_input_tokens, hf.output_tokens) == (19, 7, 29)


def test_responses_api_keys():
    # field case B13: cached tokens under input_tokens_details
    u = usage(
        {
            "input_tokens": 5200,
            "input_tokens_details": {"cached_tokens": 4864},
            "output_tokens": 410,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 5610,
        }
    )
    assert (u.input_tokens, u.cached_input_tokens, u.output_tokens) == (5200, 4864, 410)


def test_gemini_compat_thinking_only_in_total():
    u = usage({"completion_tokens": 12, "prompt_tokens": 35, "total_tokens": 109})
    assert (u.output_tokens, u.reasoning_tokens) == (74, 62)


def test_voyage_embeddings_only_total():
    assert usage({"total_tokens": 3}) == Usage(input_tokens=3)


def test_audio_and_qwen_cache_creation_split():
    audio = usage(
        {
            "prompt_tokens": 64,
            "completion_tokens": 40,
            "prompt_tokens_details": {"audio_tokens": 44, "text_tokens": 20},
            "completion_tokens_details": {"audio_tokens": 30},
        }
    )
    assert (audio.audio_input_tokens, audio.audio_output_tokens) == (44, 30)
    qwen = usage(
        {
            "prompt_tokens": 29719,
            "completion_tokens": 10,
            "prompt_tokens_details": {
                "text_tokens": 29719,
                "cache_creation": {"ephemeral_5m_input_tokens": 29713},
                "cache_creation_input_tokens": 29713,
                "cache_type": "ephemeral",
                "cached_tokens": 0,
            },
        }
    )
    assert (qwen.cache_write_tokens, qwen.cache_write_1h_tokens, qwen.uncached_input_tokens) == (29713, 0, 6)


def test_explicit_zero_is_a_value():
    u = usage(
        {
            "prompt_tokens": 10,
            "completion_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": 0},
            "num_cached_tokens": 5,
        }
    )
    assert u.cached_input_tokens == 0 and u.output_tokens == 0


def test_web_search_counts_and_provider_cost():
    raw = {
        "prompt_tokens": 8174,
        "completion_tokens": 30,
        "cost": 0.0133176,
        "server_tool_use_details": {"web_search_requests": 1},
    }
    assert usage(raw).web_search_requests == 1
    assert openai.provider_cost(raw) == Decimal("0.0133176")
    responses = usage({"input_tokens": 10, "output_tokens": 2}, {"web_search": {"num_requests": 3}})
    assert responses.web_search_requests == 3


def test_observe_takes_the_last_usage_and_groq_x_groq():
    seen = Observation()
    openai.observe_body(b'{"model":"","choices":[]}', seen)  # Azure's leading content-filter chunk
    assert seen.model is None and seen.usage is None
    openai.observe_body(
        b'{"model":"m","choices":[{"delta":{}}],"x_groq":{"usage":{"prompt_tokens":5,"completion_tokens":1}}}', seen
    )
    openai.observe_body(
        b'{"model":"m","usage":{"prompt_tokens":5,"completion_tokens":2},"x_groq":{"usage":{"prompt_tokens":5,"completion_tokens":2}}}',
        seen,
    )
    assert seen.model == "m" and seen.usage == {"prompt_tokens": 5, "completion_tokens": 2}


def test_observe_responses_terminal_event_and_error_on_200():
    seen = Observation()
    openai.observe_body(
        b'{"type":"response.created","response":{"model":"gpt-4.1-mini","usage":null,"service_tier":"auto"}}', seen
    )
    openai.observe_body(
        b'{"type":"response.completed","response":{"model":"gpt-4.1-mini","service_tier":"default",'
        b'"usage":{"input_tokens":21,"output_tokens":38}}}',
        seen,
    )
    assert (seen.model, seen.service_tier, seen.usage["output_tokens"]) == ("gpt-4.1-mini", "default", 38)
    error = Observation()
    openai.observe_body(
        b'{"error":{"message":"Provider returned error","code":502},"usage":{"prompt_tokens":3}}', error
    )
    assert error.error == "Provider returned error"
