"""Reading the model's tool calls back out of its text, as it streams.

Models write calls in the syntax their chat template taught them:

- hermes (Qwen2.5/Qwen3, Hermes, many others): text, then one or more
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks;
- llama3 (Llama 3.1/3.2 JSON tool calling): the whole reply is a JSON object
  `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`, several
  separated by `;`).

A parser is fed text deltas and returns what may be streamed now: plain text (held
back only while it could still be the start of a call) and each call once it is
complete. Text that looks like a call but does not parse is returned as text, so
nothing the model wrote is lost; and it is returned as soon as it can no longer be a
call (hermes: a body that does not start with `{`, holds a character JSON has no place
for outside a string, or goes on after its object closes), not at the end of the
output: a model that opens `<tool_call>` and then rambles must not hold a stream's
text back for a thousand tokens.

A *forced* parser reads an output the tool-call grammar (tool_grammar.py) forced: it
holds calls and the separators between them only, so it returns no text at all, and
a call cut off by the length limit is dropped, not returned as text (it would show
the template's syntax to the client).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Parsed:
    """What a feed returns: text to stream now, and calls completed now."""

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser(Protocol):
    def feed(self, text: str) -> Parsed: ...

    def flush(self) -> Parsed:
        """The end of the output: whatever was held back, as text or calls."""
        ...


def parser_name_for_template(chat_template: str | None) -> str:
    """The syntax a chat template teaches: hermes, llama3, or none."""
    template = chat_template or ""
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or ("ipython" in template and '"parameters"' in template):
        return "llama3"
    return "none"


def make_parser(name: str, forced: bool = False) -> ToolCallParser | None:
    """A fresh parser for one output, or None for `none` (the output is all text); `forced`:
    the output was forced by the tool-call grammar (see the module docstring)."""
    if name == "hermes":
        return HermesParser(forced)
    if name == "llama3":
        return Llama3JsonParser(forced)
    if name == "none":
        return None
    raise ValueError(f"unknown tool-call parser {name!r}")


def _call_from_json(obj: object, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# Outside its strings a JSON object holds only these (true, false and null spelled out).
_JSON_OUTSIDE_STRINGS = frozenset(" \t\r\n{}[]:,.+-0123456789eE" + "truefalsn")


def _can_be_call_body(body: str) -> bool:
    """Whether `body` (what follows `<tool_call>` so far, no closing tag yet) can still become
    `{json object}` and the closing tag. A cheap structural check, not a JSON parser: strings
    are skipped, brackets counted, and once the object closes only whitespace and the start
    of the closing tag may follow."""
    text = body.lstrip()
    if not text:
        return True
    if text[0] != "{":
        return False
    depth, in_string, escaped = 0, False, False
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c not in _JSON_OUTSIDE_STRINGS:
            return False
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                rest = text[i + 1 :].lstrip()
                return HERMES_CLOSE.startswith(rest)
    return True


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks among text. Once a call has been seen, text
    that is only whitespace (the newlines between blocks) is dropped."""

    def __init__(self, forced: bool = False) -> None:
        self._buffer = ""
        self._in_call = False
        self._has_calls = False
        self._forced = forced

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        while True:
            if self._in_call:
                end = self._buffer.find(HERMES_CLOSE)
                if end < 0:
                    if not self._forced and not _can_be_call_body(self._buffer):
                        # Not a call after all: the tag is text, and the rest is read again as text.
                        self._in_call = False
                        self._take_text(HERMES_OPEN, out)
                        continue
                    return out
                body, self._buffer = self._buffer[:end], self._buffer[end + len(HERMES_CLOSE) :]
                self._in_call = False
                self._take_call(body, out)
            else:
                start = self._buffer.find(HERMES_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, HERMES_OPEN)
                    ready, self._buffer = (
                        self._buffer[: len(self._buffer) - keep],
                        self._buffer[len(self._buffer) - keep :],
                    )
                    self._take_text(ready, out)
                    return out
                self._take_text(self._buffer[:start], out)
                self._buffer = self._buffer[start + len(HERMES_OPEN) :]
                self._in_call = True

    def flush(self) -> Parsed:
        out = Parsed()
        rest, self._buffer = self._buffer, ""
        if self._in_call:  # unterminated (length limit, or EOS instead of the closing tag)
            self._in_call = False
            self._take_call(rest, out, closed=False)
        else:
            self._take_text(rest, out)
        return out

    def _take_call(self, body: str, out: Parsed, closed: bool = True) -> None:
        try:
            call = _call_from_json(json.loads(body), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            self._take_text(HERMES_OPEN + body + (HERMES_CLOSE if closed else ""), out)
            return
        out.calls.append(call)
        self._has_calls = True

    def _take_text(self, text: str, out: Parsed) -> None:
        if self._forced or (self._has_calls and not text.strip()):
            return
        out.text += text


class Llama3JsonParser:
    """A reply that is a JSON call (or several, `;`-separated) instead of text. Whether it
    is one is decided at its first non-space character: `{` or the python tag holds the
    reply back to the end; anything else streams as text."""

    def __init__(self, forced: bool = False) -> None:
        self._buffer = ""
        self._mode: str | None = None  # None: undecided; "text" | "json"
        self._forced = forced

    def feed(self, text: str) -> Parsed:
        if self._mode == "text":
            return Parsed(text=text)
        self._buffer += text
        if self._mode == "json":
            return Parsed()
        head = self._buffer.lstrip()
        if not head or PYTHON_TAG.startswith(head):
            return Parsed()
        if head.startswith("{") or head.startswith(PYTHON_TAG):
            self._mode = "json"
            return Parsed()
        self._mode = "text"
        text, self._buffer = self._buffer, ""
        return Parsed(text=text)

    def flush(self) -> Parsed:
        rest, self._buffer = self._buffer, ""
        if self._forced:  # the complete calls; a last one cut off by the length limit is dropped
            return Parsed(calls=_json_calls(rest.strip().removeprefix(PYTHON_TAG), up_to_a_bad_part=True) or [])
        if self._mode != "json":
            return Parsed(text=rest)
        calls = _json_calls(rest.strip().removeprefix(PYTHON_TAG))
        return Parsed(calls=calls) if calls else Parsed(text=rest)


def _json_calls(text: str, up_to_a_bad_part: bool = False) -> list[ToolCall] | None:
    """`{call}; {call}...` → the calls, or None if any part is not a call (with
    `up_to_a_bad_part`: the calls before it)."""
    decoder = json.JSONDecoder()
    calls, position = [], 0
    while True:
        while position < len(text) and text[position] in " \t\r\n;":
            position += 1
        if position == len(text):
            return calls or None
        try:
            obj, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return (calls or None) if up_to_a_bad_part else None
        call = _call_from_json(obj, "parameters")
        if call is None:
            return (calls or None) if up_to_a_bad_part else None
        calls.append(call)
