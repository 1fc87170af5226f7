"""Tools on a model whose chat template renders none (ChatML, as SmolLM2's), with default
flags, over real servers on loopback and the official SDKs: the scheduler renders the tools
into the system prompt in the generic Hermes format (scheduler_svc/template_fit.py), so they
reach the prompt, and a forced call is written, parsed and returned as a call."""

from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from tests.support.http_stack import http_stack  # noqa: E402
from tests.support.tiny_gguf import CHATML_TEMPLATE  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": SCHEMA}}  # fmt: skip
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = http_stack(tmp_path_factory, chat_template=CHATML_TEMPLATE)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def claude(stack):
    with anthropic.Anthropic(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_the_tools_reach_the_prompt(claude, client):
    without = claude.messages.count_tokens(model="m", messages=HI).input_tokens
    with_tool = claude.messages.count_tokens(model="m", messages=HI, tools=[WEATHER]).input_tokens
    # The generic section (~330 characters of instructions) and the tool's schema, a token a byte or so here.
    assert with_tool - without > 300
    reply = client.chat.completions.create(model="m", messages=HI, tools=[WEATHER_TOOL], max_tokens=1)
    assert reply.usage.prompt_tokens == with_tool


def test_a_forced_call_is_written_in_the_generic_format_and_parsed(claude, client):
    reply = client.chat.completions.create(
        model="m", messages=HI, tools=[WEATHER_TOOL], max_tokens=200, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), SCHEMA)
    streamed = list(
        client.chat.completions.create(
            model="m", messages=HI, tools=[WEATHER_TOOL], max_tokens=200, temperature=0.0, stream=True,
            tool_choice="required", parallel_tool_calls=False,
        )
    )  # fmt: skip
    deltas = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert not "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    message = claude.messages.create(
        model="m", messages=HI, tools=[WEATHER], max_tokens=200, tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0.0},
    )  # fmt: skip
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
    jsonschema.validate(message.content[0].input, SCHEMA)
    # The next turn, with the call and its result in history, renders (in the same format) and runs.
    history = [*HI, {"role": "assistant", "content": message.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": message.content[0].id, "content": "sunny"}]}]  # fmt: skip
    after = claude.messages.create(model="m", messages=history, tools=[WEATHER], max_tokens=2)
    assert after.usage.cache_read_input_tokens > 0


@pytest.mark.parametrize("max_tokens", [30, 200])  # the first call cut; calls until the limit, or the model stops
def test_a_forced_call_cut_by_the_length_limit_says_so_and_shows_no_syntax(claude, client, max_tokens):
    forced = dict(model="m", messages=HI, max_tokens=max_tokens, temperature=0.0)
    reply = client.chat.completions.create(**forced, tools=[WEATHER_TOOL], tool_choice="required")
    choice, cut = reply.choices[0], reply.usage.completion_tokens == max_tokens
    assert choice.finish_reason == ("length" if cut else "tool_calls") and not choice.message.content
    assert cut or choice.message.tool_calls
    chunks = list(
        client.chat.completions.create(
            **forced, tools=[WEATHER_TOOL], tool_choice="required", stream=True, stream_options={"include_usage": True}
        )
    )
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [choice.finish_reason]

    message = claude.messages.create(
        model="m", messages=HI, max_tokens=max_tokens, tools=[WEATHER], tool_choice={"type": "any"},
        extra_body={"temperature": 0.0},
    )  # fmt: skip
    assert message.stop_reason == ("max_tokens" if cut else "tool_use")
    assert not any(block.type == "text" and block.text for block in message.content)
    with claude.messages.stream(
        model="m", messages=HI, max_tokens=max_tokens, tools=[WEATHER], tool_choice={"type": "any"},
        extra_body={"temperature": 0.0},
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.message.usage.input_tokens for e in events if e.type == "message_start"]
    deltas = [e.usage.input_tokens for e in events if e.type == "message_delta"]
    assert starts == deltas, "message_start and message_delta agree on input_tokens"
    assert final.stop_reason == message.stop_reason
    assert not any(block.type == "text" and block.text for block in final.content)

    responses = dict(model="m", input="hi", max_output_tokens=max_tokens, temperature=0.0, tool_choice="required")
    response = client.responses.create(**responses, tools=[{"type": "function", **WEATHER_TOOL["function"]}])
    assert response.status == ("incomplete" if cut else "completed")
    assert not any(item.type == "message" and item.content and item.content[0].text for item in response.output)
    streamed = list(
        client.responses.create(**responses, tools=[{"type": "function", **WEATHER_TOOL["function"]}], stream=True)
    )
    added = sorted((e.output_index, e.item.id) for e in streamed if e.type == "response.output_item.added")
    last = streamed[-1]
    assert last.type == ("response.incomplete" if cut else "response.completed")
    assert [item_id for _, item_id in added] == [item.id for item in last.response.output]
