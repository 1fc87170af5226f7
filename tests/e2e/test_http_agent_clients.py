"""Agent frameworks, unmodified, against a real stack on loopback: openai-agents (an Agent with
a function tool, through the Chat Completions model and the Responses model) and LangChain's
`bind_tools`, on a tiny random model whose chat template renders no tools (as SmolLM2's, the
embedded model's), with default flags: the scheduler renders the tools itself
(scheduler_svc/template_fit.py). A random model never chooses a call on its own, so the first
turn forces one (`tool_choice` required / named); the framework runs the tool, sends its
result back, and the next turn (auto) ends the loop."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

openai = pytest.importorskip("openai")
agents = pytest.importorskip("agents")
langchain_openai = pytest.importorskip("langchain_openai")

from tests.support.http_stack import http_stack  # noqa: E402
from tests.support.tiny_gguf import CHATML_TEMPLATE  # noqa: E402

# An enum, so the forced call's arguments are short: a random model writes a free string until max_tokens.
# Even so it writes up to 20 newlines wherever JSON allows whitespace: a call takes ~150 tokens of this
# byte-level vocabulary, hence max_tokens 400 and a context of 2048.
City = Literal["Paris", "Rome"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = http_stack(tmp_path_factory, chat_template=CHATML_TEMPLATE, context_length=2048)
    yield s
    s.stop()


def _run_agent(stack, model_class, tool_use_behavior: str) -> tuple[list[str], list[object]]:
    """(the cities the tool was called with, the run's items) for one agent run through `model_class`."""
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: City) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    async def run():
        client = openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        settings = agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=400, temperature=0.0
        )
        agent = agents.Agent(
            name="weather",
            instructions="Answer with the tool.",
            tools=[get_weather],
            model=model_class(model="m", openai_client=client),
            model_settings=settings,
            reset_tool_choice=True,  # after the call, auto: the random model's text ends the run
            tool_use_behavior=tool_use_behavior,
        )
        try:
            return await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)
        finally:
            await client.close()

    agents.set_tracing_disabled(True)
    result = asyncio.run(run())
    return calls, result.new_items


def test_an_openai_agents_agent_calls_its_function_tool_and_answers(stack):
    """Through Chat Completions: the call, the tool's result sent back, the model's answer (cut by
    max_tokens: a random model rarely ends its text, and this model class takes `length`)."""
    calls, items = _run_agent(stack, agents.OpenAIChatCompletionsModel, "run_llm_again")
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    kinds = [item.type for item in items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


def test_an_openai_agents_agent_calls_its_function_tool_through_responses(stack):
    """Through the Responses model the run stops at the tool's result: the answer after it would
    be `incomplete` at max_output_tokens (a random model rarely ends its text), which this model
    class raises on, rightly."""
    calls, items = _run_agent(stack, agents.OpenAIResponsesModel, "stop_on_first_tool")
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    assert [item.type for item in items] == ["tool_call_item", "tool_call_output_item"]


def test_langchain_bind_tools_parses_a_forced_call(stack):
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: City) -> str:
        """The weather in a city."""
        return "sunny"

    llm = langchain_openai.ChatOpenAI(
        base_url=stack.http_url + "/v1", api_key="unused", model="m", temperature=0.0, max_tokens=400, max_retries=0
    )
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    question = [("user", "Weather in Paris?")]
    reply = forced.invoke(question)
    assert [call["name"] for call in reply.tool_calls] == ["get_weather"]
    assert reply.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
    answer = llm.bind_tools([get_weather]).invoke(
        [
            *question,
            reply,
            ToolMessage(
                content=get_weather.invoke(reply.tool_calls[0]["args"]), tool_call_id=reply.tool_calls[0]["id"]
            ),
        ]
    )
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
