"""The server's limits on what a client controls, checked before any expensive work.

Everything here is O(size of the message) and runs before tokenizing, rendering a
chat template or queueing, so an oversized request costs the server nothing but a
refusal. Each refusal names the field, the limit and the flag that sets it.
"""

from __future__ import annotations

import re

from scheduler_svc.config import SchedulerConfig
from service_common.errors import InvalidRequestError
from swarmserve.scheduler.v1 import scheduler_pb2 as pb

# Ids are re-sent in every step plan and copied into logs, spans and timelines:
# short, printable, no whitespace, nothing a log or trace viewer would interpret.
ID_PATTERN = re.compile(r"[A-Za-z0-9._:/@+=~-]+")
ID_CHARACTERS = "letters, digits and . _ : / @ + = ~ -"


class LimitExceeded(InvalidRequestError):
    """A client-controlled size or value is beyond the server's limit; the message says which."""


def check_id(field: str, value: str, config: SchedulerConfig) -> None:
    """An optional id (empty is allowed): at most max_id_bytes of the allowed characters."""
    if not value:
        return
    size = len(value.encode())
    if size > config.max_id_bytes:
        raise LimitExceeded(f"{field} is {size} bytes; the limit is {config.max_id_bytes} (--max-id-bytes)")
    if not ID_PATTERN.fullmatch(value):
        raise LimitExceeded(f"{field} {value!r} has characters outside {ID_CHARACTERS}")


def _message_bytes(m: pb.ChatMessage) -> int:
    calls = sum(len(c.id.encode()) + len(c.name.encode()) + len(c.arguments.encode()) for c in m.tool_calls)
    return len(m.role.encode()) + len(m.content.encode()) + len(m.tool_call_id.encode()) + len(m.name.encode()) + calls


def check_request_limits(msg: pb.GenerateRequest, config: SchedulerConfig) -> None:
    """Raise LimitExceeded for the first limit the request is beyond."""
    check_id("request_id", msg.request_id, config)
    check_id("session_id", msg.session_id, config)
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        size = len(msg.text.encode())
        if size > config.max_prompt_bytes:
            raise LimitExceeded(f"text is {size} bytes; the limit is {config.max_prompt_bytes} (--max-prompt-bytes)")
    elif kind == "chat":
        messages = msg.chat.messages
        if len(messages) > config.max_chat_messages:
            raise LimitExceeded(
                f"chat has {len(messages)} messages; the limit is {config.max_chat_messages} (--max-chat-messages)"
            )
        size = len(msg.chat.tools.encode()) + sum(_message_bytes(m) for m in messages)
        if size > config.max_prompt_bytes:
            raise LimitExceeded(
                f"chat.messages and chat.tools are {size} bytes together; the limit is {config.max_prompt_bytes} "
                "(--max-prompt-bytes)"
            )
    grammar_kind = msg.structured_output.WhichOneof("kind")
    if grammar_kind in ("json_schema", "lark", "regex"):
        size = len(getattr(msg.structured_output, grammar_kind).encode())
        if size > config.max_grammar_bytes:
            raise LimitExceeded(
                f"structured_output.{grammar_kind} is {size} bytes; the limit is {config.max_grammar_bytes} "
                "(--max-grammar-bytes)"
            )
    if len(msg.stop) > config.max_stop_strings:
        raise LimitExceeded(
            f"{len(msg.stop)} stop strings; the limit is {config.max_stop_strings} (--max-stop-strings)"
        )
    for i, stop in enumerate(msg.stop):
        if len(stop) > config.max_stop_string_chars:
            raise LimitExceeded(
                f"stop[{i}] is {len(stop)} characters; the limit is {config.max_stop_string_chars} "
                "(--max-stop-string-chars)"
            )
