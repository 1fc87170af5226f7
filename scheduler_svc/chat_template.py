"""Turning a conversation into a prompt string with the model's chat template.

The template is Jinja source shipped in the model file (`tokenizer.chat_template`),
so it is untrusted code: it runs in Jinja's immutable sandbox. The environment is
the one transformers' `apply_chat_template` builds -- `trim_blocks`, `lstrip_blocks`,
`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, loop
controls, the `{% generation %}` tag -- because the model was trained on prompts
rendered that way, and one differing space changes the tokens it sees.

Everything here is a pure function of its arguments (bar `strftime_now`, which
reads the clock, as in transformers); compiled templates are cached by source.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_ALLOWED_ROLES = frozenset({"system", "user", "assistant", "tool"})


class ChatTemplateError(ValueError):
    """The chat template does not compile, fails while rendering, or rejects the conversation."""


class InvalidMessagesError(ValueError):
    """The messages are not a list of {role, content} dicts with allowed roles."""


class _TemplateRaised(jinja2.TemplateError):
    """What the template's own `raise_exception(message)` throws."""


def validate_messages(
    messages: Sequence[Mapping[str, Any]], allowed_roles: Collection[str] = DEFAULT_ALLOWED_ROLES
) -> list[dict[str, Any]]:
    """Checked copies of the messages: each needs a `role` in `allowed_roles` and a str `content`.

    Keys whose value is None are dropped, as transformers does: templates test
    for a key's presence (`'tool_calls' in message`), and would render "None".
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidMessagesError(f"messages must be a list of messages, got {type(messages).__name__}")
    checked: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidMessagesError(f"message {index} must be a mapping, got {type(message).__name__}")
        role = message.get("role")
        if role is None:
            raise InvalidMessagesError(f"message {index} has no 'role'")
        if role not in allowed_roles:
            raise InvalidMessagesError(
                f"message {index} has role {role!r}; allowed roles: {', '.join(sorted(allowed_roles))}"
            )
        content = message.get("content")
        if not isinstance(content, str):
            problem = "no 'content'" if content is None else f"'content' of type {type(content).__name__}"
            raise InvalidMessagesError(f"message {index} ({role}) has {problem}; content must be a string")
        checked.append({key: value for key, value in message.items() if value is not None})
    return checked


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    bos_token: str | None = None,
    eos_token: str | None = None,
    allowed_roles: Collection[str] = DEFAULT_ALLOWED_ROLES,
    **extra: Any,
) -> str:
    """The prompt `template` renders for `messages`, identical to transformers'
    `apply_chat_template(messages, tokenize=False, ...)`.

    `extra` reaches the template as further variables (e.g. `tools`,
    `enable_thinking`). Raises InvalidMessagesError for bad messages and
    ChatTemplateError when the template fails or rejects them.
    """
    checked = validate_messages(messages, allowed_roles)
    compiled = compile_chat_template(template)
    variables: dict[str, Any] = {"tools": None, "documents": None}
    if bos_token is not None:
        variables["bos_token"] = bos_token
    if eos_token is not None:
        variables["eos_token"] = eos_token
    variables.update(extra)
    try:
        return compiled.render(messages=checked, add_generation_prompt=add_generation_prompt, **variables)
    except _TemplateRaised as exc:
        raise ChatTemplateError(f"the chat template rejected the conversation: {exc.message}") from exc
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from exc
    except (ArithmeticError, LookupError, TypeError, ValueError) as exc:
        # Template code is Python underneath: `message['content'] + 1` raises TypeError.
        raise ChatTemplateError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from exc


@lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """The compiled template; raises ChatTemplateError naming the line of a syntax error."""
    try:
        return _ENVIRONMENT.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template is not valid Jinja (line {exc.lineno}): {exc.message}") from exc
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for transformers'
    training masks; for a prompt it renders just its body, but must parse."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, '), which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _sandbox() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


_ENVIRONMENT = _sandbox()  # never modified after this line
