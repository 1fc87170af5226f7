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
