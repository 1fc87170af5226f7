"""template_fit: a conversation fitted to what the chat template renders, found by probing it."""

from __future__ import annotations

from scheduler_svc.chat_template import render_chat_template
from scheduler_svc.template_fit import fold_mid_system, render_prompt, renders_mid_system, renders_tools, tool_syntax
from tests.support.tiny_gguf import CHATML_TEMPLATE, HERMES_TOOLS_TEMPLATE

# A template that reads only a leading system message and skips any other, as many do.
FIRST_SYSTEM_ONLY_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}<<SYS>>{{ messages[0]['content'] }}<</SYS>>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] != 'system' %}[{{ m['role'] }}] {{ m['content'] }}\n{% endif %}{% endfor %}"
)
# One that refuses a system message anywhere but first (Llama 2's, Mistral's kind).
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System role only at the start') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n"
    "{% endfor %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "system", "content": "The date is today."},
    {"role": "user", "content": "what now?"},
]


def test_templates_that_render_a_mid_conversation_system_message_keep_it_a_system_turn():
    assert renders_mid_system(CHATML_TEMPLATE) and renders_mid_system(HERMES_TOOLS_TEMPLATE)
    prompt = render_prompt(CHATML_TEMPLATE, CONVERSATION, None)
    assert "<|im_start|>system\nThe date is today.<|im_end|>\n<|im_start|>user\nwhat now?" in prompt


def test_elsewhere_it_is_folded_into_the_next_user_turn():
    for template in (FIRST_SYSTEM_ONLY_TEMPLATE, STRICT_TEMPLATE):
        assert not renders_mid_system(template)
        prompt = render_prompt(template, CONVERSATION, None)
        assert "[user] The date is today.\n\nwhat now?" in prompt
    assert fold_mid_system([*CONVERSATION[:3], CONVERSATION[3]])[-1] == {
        "role": "user",
        "content": "The date is today.",
    }


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "warm"},
]


def test_a_template_that_renders_no_tools_gets_them_in_the_generic_hermes_format():
    assert renders_tools(HERMES_TOOLS_TEMPLATE) and not renders_tools(CHATML_TEMPLATE)
    assert tool_syntax(CHATML_TEMPLATE, "auto") == ("hermes", True)
    assert tool_syntax(CHATML_TEMPLATE, "hermes") == ("hermes", True)
    assert tool_syntax(CHATML_TEMPLATE, "none") == ("none", False)  # the operator said: no tool calls
    assert tool_syntax(HERMES_TOOLS_TEMPLATE, "auto") == ("hermes", False)  # the template's own
    prompt = render_prompt(CHATML_TEMPLATE, [{"role": "system", "content": "Be terse."}, *TOOL_TURNS], TOOLS)
    assert prompt.startswith("<|im_start|>system\nBe terse.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "The weather' in prompt
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>" in prompt
    )
    # No system message: one is added for the tools.
    assert render_prompt(CHATML_TEMPLATE, TOOL_TURNS[:1], TOOLS).startswith("<|im_start|>system\n# Tools\n")
    # Without tools, or with a template that renders its own, nothing changes.
    assert (
        render_prompt(CHATML_TEMPLATE, TOOL_TURNS[:1], None)
        == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )
    own = render_prompt(HERMES_TOOLS_TEMPLATE, TOOL_TURNS, TOOLS)
    assert own == render_chat_template(HERMES_TOOLS_TEMPLATE, TOOL_TURNS, add_generation_prompt=True, tools=TOOLS)
