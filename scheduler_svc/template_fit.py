"""Fitting a conversation to what the model's chat template can render.

Agent clients send what a frontier model's API takes; a small model's template may
not render all of it. Two gaps are closed here, each found by rendering the
template with and without a probe (cached per template), never by reading its
source:

- **Tools.** A template that never reads `tools` (SmolLM2's, and many more) would
  drop them silently: a `tool_choice: auto` request got prose and nothing said so.
  Such a model gets the tools from the scheduler instead, in one generic format,
  Hermes-style (Qwen2.5's wording, the syntax llama.cpp and Ollama fall back to):
  the functions' JSON schemas inside `<tools></tools>` appended to the system
  prompt (a system message is added when there is none), and calls written as
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, which the
  hermes parser reads back and tool_grammar forces. The conversation's history
  follows the same format: an assistant's earlier calls become those blocks in its
  text, and tool results become a user turn of `<tool_response>` blocks. A template
  that renders tools keeps its own format; `--tool-call-parser llama3|none` turns
  the generic one off (the operator named another syntax, or none).
- **A system message mid-conversation** (Claude Code sends one). Where the
  template renders it in place, it stays a system turn; where the template drops
  it or raises on it, it is folded into the next user turn (its text first, then a
  blank line, then the user's), or becomes a user turn when none follows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache

from scheduler_svc.chat_template import ChatTemplateError, InvalidMessagesError, render_chat_template
from scheduler_svc.http_api.tool_calls import parser_name_for_template

GENERIC_TOOL_SYNTAX = "hermes"  # the parser (tool_calls.py) and grammar (tool_grammar.py) for the generic format

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "swarmserve_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}

_PROBE_SYSTEM = "swarmserve-probe-system-text"


GENERIC_TOOLS_HEADER = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
GENERIC_TOOLS_FOOTER = (
    "</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@lru_cache(maxsize=32)
def renders_tools(template: str, bos_token: str = "", eos_token: str = "") -> bool:
    """Whether the template writes `tools` into the prompt: a probe tool changes the render."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        plain = render_chat_template(
            template, messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token
        )
        with_tool = render_chat_template(
            template,
            messages,
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=[_PROBE_TOOL],
        )
    except (ChatTemplateError, InvalidMessagesError):
        return False
    return plain != with_tool


@lru_cache(maxsize=32)
def renders_mid_system(template: str, bos_token: str = "", eos_token: str = "") -> bool:
    """Whether a system message after the first turn reaches the prompt (and does not raise)."""
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "system", "content": _PROBE_SYSTEM},
        {"role": "user", "content": "c"},
    ]
    try:
        text = render_chat_template(
            template, messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token
        )
    except (ChatTemplateError, InvalidMessagesError):
        return False
    return _PROBE_SYSTEM in text


def tool_syntax(template: str | None, configured: str, bos_token: str = "", eos_token: str = "") -> tuple[str, bool]:
    """(the tool-call parser for this model, whether the scheduler renders the tools itself).

    `configured` is --tool-call-parser: anything but auto wins; auto reads the syntax the
    template teaches, or takes the generic format when the template renders no tools."""
    is_generic = (
        bool(template)
        and configured in ("auto", GENERIC_TOOL_SYNTAX)
        and not renders_tools(template, bos_token, eos_token)
    )
    if configured != "auto":
        return configured, is_generic
    return (GENERIC_TOOL_SYNTAX if is_generic else parser_name_for_template(template)), is_generic


def generic_tools_text(tools: Sequence[dict]) -> str:
    """The tools as the generic format's system-prompt section."""
    lines = "".join(json.dumps(tool, ensure_ascii=False) + "\n" for tool in tools)
    return GENERIC_TOOLS_HEADER + lines + GENERIC_TOOLS_FOOTER


def _call_text(call: dict) -> str:
    function = call.get("function", call)
    body = {"name": function["name"], "arguments": function.get("arguments", {})}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def with_generic_tools(messages: list[dict], tools: Sequence[dict] | None) -> list[dict]:
    """The conversation in the generic format: tools in the system prompt, earlier calls as
    `<tool_call>` blocks in the assistant's text, tool results as a user turn of
    `<tool_response>` blocks (consecutive results share one turn)."""
    out: list[dict] = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_call_text(call) for call in message["tool_calls"])
            content = message.get("content") or ""
            message = {"role": "assistant", "content": (content + "\n" if content else "") + calls}
        elif message["role"] == "tool":
            response = "<tool_response>\n" + (message.get("content") or "") + "\n</tool_response>"
            if out and out[-1].get("is_tool_responses"):
                out[-1]["content"] += "\n" + response
                continue
            message = {"role": "user", "content": response, "is_tool_responses": True}
        out.append(dict(message))
    for message in out:
        message.pop("is_tool_responses", None)
    if tools:
        section = generic_tools_text(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0]["content"] + "\n\n" if out[0]["content"] else "") + section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def fold_mid_system(messages: list[dict]) -> list[dict]:
    """System messages after the first turn folded into the next user turn (or made a user
    turn when none follows), for a template that cannot render them in place."""
    out: list[dict] = []
    pending: list[str] = []
    for index, message in enumerate(messages):
        if message["role"] == "system" and index > 0:
            pending.append(message.get("content") or "")
            continue
        if message["role"] == "user" and pending:
            message = {**message, "content": "\n\n".join([*pending, message.get("content") or ""])}
            pending = []
        out.append(message)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def render_prompt(
    template: str,
    messages: list[dict],
    tools: list[dict] | None,
    tool_call_parser: str = "auto",
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The prompt for `messages` (and `tools`), fitted to the template as the module says.
    Raises what render_chat_template raises."""
    _, is_generic = tool_syntax(template, tool_call_parser, bos_token, eos_token)
    if is_generic:
        messages, tools = with_generic_tools(messages, tools), None
    if any(m["role"] == "system" for m in messages[1:]) and not renders_mid_system(template, bos_token, eos_token):
        messages = fold_mid_system(messages)
    return render_chat_template(
        template, messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token, tools=tools
    )
