"""The Anthropic-compatible API (/v1/messages, /v1/messages/count_tokens) over real servers on
loopback, driven by the official `anthropic` SDK, unmodified: plain and streamed messages,
the streaming event sequence, usage (cache reads included), stop sequences, tool_use /
tool_result turns, errors in Anthropic's shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")

from tests.support.http_stack import http_stack, pick_stop  # noqa: E402

SYSTEM = "You are terse."
GREEDY = {"temperature": 0.0}  # the SDK has no sampling arguments any more: they go in the body
MESSAGES = [{"role": "user", "content": "Name three colors."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = http_stack(tmp_path_factory, "--clamp-max-tokens")  # the OpenAI routes' opt-in (the clamp test)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    with anthropic.Anthropic(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_a_message_plain_and_streamed_with_usage(client):
    reply = client.messages.create(model="m", system=SYSTEM, messages=MESSAGES, max_tokens=10, extra_body=GREEDY)
    assert reply.role == "assistant" and reply.stop_reason == "max_tokens"
    assert [block.type for block in reply.content] == ["text"]
    assert reply.usage.output_tokens == 10
    counted = client.messages.count_tokens(model="m", system=SYSTEM, messages=MESSAGES).input_tokens
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted > 0

    events = list(
        client.messages.create(
            model="m", system=SYSTEM, messages=MESSAGES, max_tokens=10, stream=True, extra_body=GREEDY
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:4] == ["content_block_start", "content_block_delta", "content_block_delta"] or "ping" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    with client.messages.stream(
        model="m", system=SYSTEM, messages=MESSAGES, max_tokens=10, extra_body=GREEDY
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == reply.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    assert final.usage.cache_read_input_tokens > 0, "the same prompt again is read from the prefix cache"
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted


def test_a_stop_sequence_is_reported(client):
    seeded = dict(
        model="m", system=SYSTEM, messages=MESSAGES, max_tokens=24, extra_body={"temperature": 1.0, "seed": 5}
    )
    full = client.messages.create(**seeded).content[0].text
    stop = pick_stop(full)
    reply = client.messages.create(**seeded, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == full[: full.index(stop)]


def test_tool_use_and_tool_result_turns_render_and_hit_the_cache(client):
    turn = [{"role": "user", "content": "What is the weather in Paris? " * 3}]
    first = client.messages.create(model="m", messages=turn, tools=[WEATHER], max_tokens=4, extra_body=GREEDY)
    turn += [
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}, {"type": "text", "text": "Thanks"}]},
    ]  # fmt: skip
    second = client.messages.create(model="m", messages=turn, tools=[WEATHER], max_tokens=4, extra_body=GREEDY)
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > first_prompt
    assert second.usage.cache_read_input_tokens >= 16 * (first_prompt // 16) > 0
    count = client.messages.count_tokens(model="m", messages=turn, tools=[WEATHER]).input_tokens
    assert count == second.usage.input_tokens + second.usage.cache_read_input_tokens


def test_a_forced_tool_call_comes_back_as_tool_use(client):
    reply = client.messages.create(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], max_tokens=256,
        extra_body=GREEDY, tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    uses = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])


def test_a_streamed_tool_choice_any_gives_tool_use_blocks_only(client):
    """Several calls allowed: the tiny model writes calls until max_tokens; the stream holds the
    complete ones as tool_use blocks, never the cut-off last one as text, and says max_tokens."""
    with client.messages.stream(
        model="m", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], max_tokens=256,
        extra_body=GREEDY, tool_choice={"type": "any"},
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.stop_reason == ("max_tokens" if final.usage.output_tokens == 256 else "tool_use")
    assert final.content and all(block.type == "tool_use" for block in final.content)
    for block in final.content:
        jsonschema.validate(block.input, WEATHER["input_schema"])


def test_output_config_json_schema_is_followed(client):
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "maxLength": 10}},
        "required": ["color"],
        "additionalProperties": False,
    }
    for seed in range(5):
        reply = client.messages.create(
            model="m", messages=MESSAGES, max_tokens=100, output_config={"format": {"type": "json_schema", "schema": schema}},
            extra_body={"temperature": 1.0, "seed": seed},
        )  # fmt: skip
        assert reply.stop_reason == "end_turn"
        jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_errors_come_in_anthropics_shape(stack, client):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model="m", messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}], max_tokens=4
        )
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in refused.value.body["error"]["message"]
    missing = httpx.post(stack.http_url + "/v1/messages", json={"model": "m", "messages": MESSAGES})
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
    huge = httpx.post(
        stack.http_url + "/v1/messages", content=b"x" * (5 << 20), headers={"content-type": "application/json"}
    )
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", messages=MESSAGES, max_tokens=4, tool_choice={"type": "any"})


def claude_code_body(num_tools: int) -> dict:
    """The first request of Claude Code 2.1.197 (`claude -p hi`, captured on loopback), its text cut
    down to fit the test model's 1024 tokens: the real one carries 24 tools and is 20,345 tokens
    on SmolLM2. Its shape is kept whole: three system blocks (two with cache_control), a user turn
    of two text blocks, then a `system` message inside `messages` (its mid-conversation system
    beta, after the user's turn), `thinking` adaptive, `context_management`, `output_config.effort`,
    `metadata.user_id`, `max_tokens` 64000, streamed. A thinking block sent back in history (later
    turns) rides along too."""
    tools = [
        {"name": f"Tool{i}", "description": f"Tool number {i}.", "input_schema": {
            "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
            "properties": {"arg": {"description": "The argument.", "type": "string"}}, "required": ["arg"],
            "additionalProperties": False}}
        for i in range(num_tools)
    ]  # fmt: skip
    return {
        "model": "claude-opus-4-8",
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>Today's date is 2026-12-02.</system-reminder>"},
                {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "greet back", "signature": "c2ln"},
                {"type": "redacted_thinking", "data": "b3BhcXVl"},
                {"type": "text", "text": "Hello."}]},
            {"role": "user", "content": "What next?"},
            {"role": "system", "content": "Environment: a Linux box; the working directory is a git repository."},
        ],
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": tools,
        "metadata": {"user_id": '{"device_id":"d2","account_uuid":"","session_id":"6cc4"}'},
        "max_tokens": 64000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }  # fmt: skip


def test_claude_codes_request_shape_is_answered_with_a_stream(stack):
    headers = {
        "anthropic-beta": "claude-code-20250219,context-1m-2025-08-07,interleaved-thinking-2025-05-14,"
        "context-management-2025-06-27,prompt-caching-scope-2026-01-05,mid-conversation-system-2026-04-07,"
        "effort-2025-11-24",
        "anthropic-version": "2023-06-01",
        "authorization": "Bearer unused",
        "x-app": "cli",
    }
    body = claude_code_body(1)
    url = stack.http_url + "/v1/messages?beta=true"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        kinds = [line.removeprefix("event: ") for line in reply.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"] and "error" not in kinds
    counted = httpx.post(stack.http_url + "/v1/messages/count_tokens?beta=true", json=body, headers=headers)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def test_max_tokens_beyond_the_context_is_clamped_on_messages_and_on_openai_routes_by_flag(client):
    # The stack's context is 1024 tokens; its KV cache holds 992 for one request (64 blocks of 16:
    # one the executor's null block, one the watermark), the least of the two, so a prompt of
    # ~980 tokens leaves a few, and 64000 is cut to those.
    long = [{"role": "user", "content": "hi " * 320}]
    counted = client.messages.count_tokens(model="m", messages=long).input_tokens
    assert 970 < counted < 992
    reply = client.messages.create(model="m", messages=long, max_tokens=64000, extra_body=GREEDY)
    assert reply.stop_reason == "max_tokens"
    assert reply.usage.output_tokens == 992 - counted
    # The OpenAI routes clamp too with --clamp-max-tokens (this stack's; without it they refuse).
    chat = httpx.post(
        str(client.base_url) + "/v1/chat/completions",
        json={"model": "m", "messages": long, "max_tokens": 64000, "temperature": 0.0},
    ).json()
    assert chat["choices"][0]["finish_reason"] == "length" and chat["usage"]["completion_tokens"] == 992 - counted
    # A prompt that leaves no room is refused, clearly.
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="m", messages=[{"role": "user", "content": "hi " * 600}], max_tokens=64000)
    assert "leaves no room to generate" in refused.value.body["error"]["message"]
