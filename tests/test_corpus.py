"""Every OpenAI-format exchange of the recorded corpus, through the real proxy.

For each record: the client receives from tokenward exactly what the simulator sends directly
(status, content type, body or event bytes), and the ledger row holds the reported usage
mapped to canonical fields. The mapping below is written out per provider variant from
``shared/reference/usage-and-pricing.md`` part 1, independently of ``proxy/dialects``.
Mismatches are reported by record id. Skipped when ``../shared`` is absent.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tokenward.pricing.usage import TOKEN_FIELDS
from tokenward.proxy.simulator import RECORD_HEADER, without_stream_usage

from .conftest import ProxyFactory, corpus_records

PATHS = {
    "chat_completions": "chat/completions",
    "completions": "completions",
    "embeddings": "embeddings",
    "responses": "responses",
    "anthropic_messages": "messages",
}
USAGE_PATHS = ("usage", "x_groq.usage", "response.usage", "message.usage")
MEDIA_UNITS = ("output_images", "input_audio_seconds", "input_characters")  # no corpus record is a media endpoint
TOKEN_COLUMNS = tuple(f for f in TOKEN_FIELDS if f not in MEDIA_UNITS)  # every other count, in ledger order


def openai_records() -> list[dict[str, Any]]:
    return [r for r in corpus_records() if r["dialect"] == "openai"]


def anthropic_counts(usage: dict[str, Any]) -> dict[str, int]:
    """One Anthropic usage object or iteration: input_tokens EXCLUDES cache reads and writes."""
    reads = usage.get("cache_read_input_tokens") or 0
    writes = usage.get("cache_creation_input_tokens") or 0
    return {
        "input_tokens": (usage.get("input_tokens") or 0) + reads + writes,
        "cached_input_tokens": reads,
        "cache_write_tokens": writes,
        "cache_write_1h_tokens": (usage.get("cache_creation") or {}).get("ephemeral_1h_input_tokens") or 0,
        "output_tokens": usage.get("output_tokens") or 0,
    }


def expected_anthropic(record: dict[str, Any]) -> tuple[dict[str, int] | None, list[tuple[str, dict[str, int]]]]:
    """Counts for the request's own model, and per advisor (other-model) iteration."""
    merged: dict[str, Any] = {}
    for entry in record["usage_as_reported"] or ():
        merged.update(entry["usage"])  # message_delta running totals replace message_start fields
    if not merged:
        return None, []
    iterations = merged.get("iterations") or []
    own = [i for i in iterations if i.get("type") in ("message", "compaction")] or [merged]
    totals = {key: sum(anthropic_counts(i)[key] for i in own) for key in anthropic_counts({})}
    totals.update(
        reasoning_tokens=(merged.get("output_tokens_details") or {}).get("thinking_tokens") or 0,
        audio_input_tokens=0,
        audio_output_tokens=0,
        image_input_tokens=0,
        web_search_requests=(merged.get("server_tool_use") or {}).get("web_search_requests") or 0,
        web_fetch_requests=(merged.get("server_tool_use") or {}).get("web_fetch_requests") or 0,
        file_search_calls=0,
        code_containers=int(code_execution_ran(record)),
        image_generation_calls=0,
    )
    advisors = [(i["model"], anthropic_counts(i)) for i in iterations if i.get("type") == "advisor_message"]
    return totals, advisors


def number(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def expected_tokens(record: dict[str, Any]) -> dict[str, int] | None:
    """Canonical counts from the record's last reported usage object, by the reference's rules."""
    if record["dialect"] == "anthropic":
        return expected_anthropic(record)[0]
    reported = [u for u in record["usage_as_reported"] or () if u["path"] in USAGE_PATHS]
    if not reported:
        return None
    raw = reported[-1]["usage"]
    tools = [u["usage"] for u in record["usage_as_reported"] if u["path"] in ("tool_usage", "response.tool_usage")]
    details_in = raw.get("prompt_tokens_details") or raw.get("input_tokens_details") or {}
    details_out = raw.get("completion_tokens_details") or raw.get("output_tokens_details") or {}

    if "prompt_tokens" in raw:  # chat / completions / embeddings, every compatible provider
        prompt, completion = raw["prompt_tokens"], raw.get("completion_tokens") or 0
    elif "input_tokens" in raw:  # Responses API
        prompt, completion = raw["input_tokens"], raw.get("output_tokens") or 0
    else:  # Voyage embeddings: only a total
        prompt, completion = raw["total_tokens"], 0

    # cache hits: OpenAI-nested first, else DeepSeek, Mistral (old), Hugging Face top level
    if number(details_in.get("cached_tokens")) is not None:
        cached = details_in["cached_tokens"]
    elif "prompt_cache_hit_tokens" in raw:
        cached = raw["prompt_cache_hit_tokens"]
        assert raw["prompt_cache_hit_tokens"] + raw["prompt_cache_miss_tokens"] == prompt
    elif "num_cached_tokens" in raw:
        cached = raw["num_cached_tokens"]
    else:
        cached = number(raw.get("cached_tokens")) or 0

    writes = number(details_in.get("cache_write_tokens")) or 0
    if cached + writes > prompt and max(cached, writes) <= prompt:
        # OpenRouter's Gemini explicit cache reports the written tokens as read too (and bills both):
        # the overlap counts once as read and once as written (rule R1b)
        prompt += min(cached, writes)

    reasoning = number(details_out.get("reasoning_tokens")) or 0
    total = number(raw.get("total_tokens"))
    if total is not None and total > prompt + completion and reasoning == 0:
        # Gemini's OpenAI-compatible endpoint: thinking tokens show only in total_tokens
        reasoning = total - prompt - completion
        completion = total - prompt
    if reasoning > completion and total == prompt + completion:
        reasoning = completion  # OpenRouter: the total vouches for the output; reasoning is a subset (rule R2)

    searches = number((raw.get("server_tool_use_details") or {}).get("web_search_requests")) or 0
    for tool in tools:
        searches = max(searches, number((tool.get("web_search") or {}).get("num_requests")) or 0)
    searches = max(searches, len(web_search_calls(record)))
    return {
        "input_tokens": prompt,
        "cached_input_tokens": cached,
        "cache_write_tokens": writes,
        "cache_write_1h_tokens": 0,
        "output_tokens": completion,
        "reasoning_tokens": reasoning,
        "audio_input_tokens": number(details_in.get("audio_tokens")) or 0,
        "audio_output_tokens": number(details_out.get("audio_tokens")) or 0,
        "image_input_tokens": number(details_in.get("image_tokens")) or 0,
        "web_search_requests": searches,
        # each file search call once; code interpreter billed per container: its distinct container_id
        "web_fetch_requests": 0,
        "file_search_calls": len({item["id"] for item in output_items(record, "file_search_call")}),
        "code_containers": len({item["container_id"] for item in output_items(record, "code_interpreter_call")}),
        "image_generation_calls": len({item["id"] for item in output_items(record, "image_generation_call")}),
    }


def reply_documents(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The reply's JSON body, or each JSON event of its stream."""
    documents = []
    response = record["response"]
    if isinstance(response.get("body"), dict):
        documents.append(response["body"])
    for line in (response.get("sse") or "").split("\n"):
        if line.startswith("data:") and line[5:].strip().startswith("{"):
            documents.append(json.loads(line[5:]))
    return documents


def output_items(record: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """The Responses output items of type ``kind`` a reply holds (a stream repeats them: callers dedupe).

    In a body, its ``output``; in a stream, each ``response.output_item.done`` item and the
    terminal event's ``response.output``.
    """
    found = []
    for document in reply_documents(record):
        items = list(document.get("output") or [])
        items += list((document.get("response") or {}).get("output") or [])
        if document.get("type") == "response.output_item.done":
            items.append(document["item"])
        found += [item for item in items if isinstance(item, dict) and item.get("type") == kind]
    return found


def web_search_calls(record: dict[str, Any]) -> set[str]:
    """Ids of the hosted web searches a Responses reply ran: ``web_search_call`` output items, each id once."""
    return {item["id"] for item in output_items(record, "web_search_call")}


def code_execution_ran(record: dict[str, Any]) -> bool:
    """Whether an Anthropic reply used a code execution tool (a ``server_tool_use`` block naming one)."""
    names = {"code_execution", "bash_code_execution", "text_editor_code_execution"}
    for document in reply_documents(record):
        blocks = [document.get("content_block")] + list(document.get("content") or [])
        blocks += list((document.get("message") or {}).get("content") or [])
        if any(isinstance(b, dict) and b.get("type") == "server_tool_use" and b.get("name") in names for b in blocks):
            return True
    return False


def generated_text(sse: str) -> bool:
    """Whether a chat stream delivered any generated text (content or reasoning) before it ended."""
    for line in sse.split("\n"):
        if line.startswith("data:") and line[5:].strip().startswith("{"):
            for choice in json.loads(line[5:]).get("choices") or []:
                delta = choice.get("delta") or {}
                if any(isinstance(delta.get(k), str) and delta[k] for k in ("content", "reasoning")):
                    return True
    return False


def round_trips(sse: str) -> bool:
    """Whether every JSON event re-encodes to the same text (the simulator's emulation re-encodes)."""
    for line in sse.split("\n"):
        if line.startswith("data: {"):
            data = line[6:]
            if json.dumps(json.loads(data), separators=(",", ":"), ensure_ascii=False) != data:
                return False
    return True


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory, simulator):
    """Send every record (both dialects) directly and through one proxy; collect replies and rows."""
    records = corpus_records()
    factory = ProxyFactory(tmp_path_factory.mktemp("corpus"), simulator)
    proxy = factory()
    results = []
    with httpx.Client(timeout=30) as client:
        for record in records:
            path = PATHS[record["endpoint"]]
            query = ("?" + record["request"]["query"]) if record["request"]["query"] else ""
            body = json.dumps(record["request"]["body"]).encode()
            headers = {RECORD_HEADER: record["id"], "content-type": "application/json"}
            direct = client.post(
                f"{simulator.url}/{record['provider']}/v1/{path}{query}", content=body, headers=headers
            )
            via = client.post(
                f"{proxy.url}/v1/{path}{query}",
                content=body,
                headers={**headers, "x-tokenward-upstream": record["provider"]},
            )
            results.append((record, direct, via))
    rows = {row["request_id"]: row for row in proxy.rows(len(results), "WHERE row_kind = 'request'")}
    parts = proxy.rows(where="WHERE row_kind = 'part'")
    factory.stop_all()
    return results, rows, parts


def test_client_sees_what_the_upstream_sent(corpus_run):
    results, _, _ = corpus_run
    mismatches = []
    for record, direct, via in results:
        same = (direct.status_code, direct.headers.get("content-type"), direct.content) == (
            via.status_code,
            via.headers.get("content-type"),
            via.content,
        )
        if not same:
            mismatches.append(record["id"])
    assert len(results) > 850
    assert mismatches == []


def test_every_record_has_one_row_with_the_reported_usage(corpus_run):
    results, rows, _ = corpus_run
    assert len(rows) == len(results)
    mismatches = []
    for record, _, via in results:
        row = rows[via.headers["x-tokenward-request-id"]]
        expected = expected_tokens(record)
        status = record["response"]["status"]
        problem = None
        if row["http_status"] != status or row["stream"] is not bool(record["stream"]):
            problem = f"status/stream {row['http_status']} {row['stream']}"
        elif expected is not None:
            got = {column: row[column] for column in TOKEN_COLUMNS}
            if got != expected or row["usage_source"] != "reported":
                problem = f"tokens {got} != {expected} ({row['usage_source']})"
            elif row["price_status"] == "priced" and (row["cost_usd"] is None or row["cost_usd"] < 0):
                problem = "priced row without a cost"
            elif row["price_status"] not in ("priced", "unpriced", "partially_priced", "repaired"):
                problem = f"price_status {row['price_status']}"
        elif status >= 400:
            if (row["usage_source"], row["price_status"], row["cost_usd"], row["outcome"]) != (
                "none",
                "not_billed",
                0,
                "upstream_error",
            ):
                problem = f"error reply row {row['usage_source']} {row['price_status']} {row['outcome']}"
        elif record["request"]["body"].get("background"):  # usage comes later from GET /v1/responses/{id}
            if (row["usage_source"], row["price_status"], row["cost_usd"]) != ("none", "deferred", None):
                problem = f"background reply row {row['usage_source']} {row['price_status']}"
        elif row["outcome"] == "upstream_error":  # an error event inside a 200 stream
            # content generated before the error is billed as a partial estimate; none, nothing billed
            generated = generated_text(record["response"].get("sse") or "")
            wanted = ("partial", "priced") if generated else ("none", "not_billed")
            if (row["usage_source"], row["price_status"]) != wanted or row["error"] is None:
                problem = f"error event row {row['usage_source']} {row['price_status']}, expected {wanted}"
        elif row["usage_source"] != "estimated" or row["input_tokens"] <= 0:
            problem = f"no usage reported but row is {row['usage_source']} with {row['input_tokens']} input"
        if problem:
            mismatches.append(f"{record['id']}: {problem}")
    assert mismatches == []


def test_advisor_iterations_are_parts_priced_at_their_own_model(corpus_run):
    results, rows, parts = corpus_run
    expected_parts, got_parts = [], []
    for record, _, via in results:
        if record["dialect"] != "anthropic":
            continue
        request_id = via.headers["x-tokenward-request-id"]
        expected_parts += [(request_id, model, counts) for model, counts in expected_anthropic(record)[1]]
    for part in parts:
        counts = {
            k: part[k]
            for k in (
                "input_tokens",
                "cached_input_tokens",
                "cache_write_tokens",
                "cache_write_1h_tokens",
                "output_tokens",
            )
        }
        got_parts.append((part["parent_request_id"], part["served_model"], counts))
        assert part["price_status"] == "priced" and part["price_entry_id"].endswith(part["served_model"])
    assert len(expected_parts) >= 4
    assert sorted(got_parts, key=str) == sorted(expected_parts, key=str)


def test_no_silent_zero_cost(corpus_run):
    results, rows, _ = corpus_run
    for record, _, via in results:
        row = rows[via.headers["x-tokenward-request-id"]]
        if row["input_tokens"] + row["output_tokens"] > 0:
            assert (row["cost_usd"] is None) == (row["price_status"] == "unpriced"), record["id"]
            assert row["price_status"] == "unpriced" or row["cost_usd"] > 0, record["id"]


def test_hidden_usage_chunks_match_the_upstream_without_include_usage(tmp_path_factory, simulator):
    """A client that did not ask for stream usage gets exactly the events the upstream sends it."""
    records = [
        r
        for r in openai_records()
        if r["stream"]
        and r["endpoint"] == "chat_completions"
        and (r["request"]["body"].get("stream_options") or {}).get("include_usage")
    ]
    factory = ProxyFactory(tmp_path_factory.mktemp("strip"), simulator)
    proxy = factory()
    compared, mismatches = 0, []
    with httpx.Client(timeout=30) as client:
        for record in records:
            sse = record["response"]["sse"]
            if without_stream_usage(sse).count("data:") != sse.count("data:") - 1:
                continue  # no separate usage-only chunk in this recording
            if not round_trips(sse):
                continue  # the simulator's JSON re-encoding would differ, not tokenward
            body = {k: v for k, v in record["request"]["body"].items() if k != "stream_options"}
            headers = {RECORD_HEADER: record["id"]}
            direct = client.post(
                f"{simulator.url}/{record['provider']}/v1/chat/completions", json=body, headers=headers
            )
            via = client.post(
                f"{proxy.url}/v1/chat/completions",
                json=body,
                headers={**headers, "x-tokenward-upstream": record["provider"]},
            )
            compared += 1
            if direct.content != via.content:
                mismatches.append(record["id"])
    rows = proxy.rows(compared)
    factory.stop_all()
    assert compared > 30 and mismatches == []
    assert all(row["usage_source"] == "reported" and row["output_tokens"] > 0 for row in rows)
