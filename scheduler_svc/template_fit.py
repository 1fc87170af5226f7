"""Fitting a conversation to what the model's chat template can render.

Agent clients send what a frontier model's API takes; a small model's template may
not render all of it. The gaps are closed here, each found by rendering the
template with a probe (cached per template), never by reading its source:

- **A system message mid-conversation** (Claude Code sends one). Where the
  template renders it in place, it stays a system turn; where the template drops
  it or raises on it, it is folded into the next user turn (its text first, then a
  blank line, then the user's), or becomes a user turn when none follows.
"""

from __future__ import annotations

from functools import lru_cache

from scheduler_svc.chat_template import ChatTemplateError, InvalidMessagesError, render_chat_template

_PROBE_SYSTEM = "swarmserve-probe-system-text"


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
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The prompt for `messages` (and `tools`), fitted to the template as the module says.
    Raises what render_chat_template raises."""
    if any(m["role"] == "system" for m in messages[1:]) and not renders_mid_system(template, bos_token, eos_token):
        messages = fold_mid_system(messages)
    return render_chat_template(
        template, messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token, tools=tools
    )
