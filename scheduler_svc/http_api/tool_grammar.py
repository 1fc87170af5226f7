"""Grammars that force a valid tool call (`tool_choice` required or named).

The result is an llguidance Lark grammar for StructuredOutput.lark: the executor
masks sampling so the model can only write a call, in its own syntax (tool_calls.py),
to one of the allowed functions, with arguments valid against that function's
parameter schema (embedded as `%json{...}`).
"""

from __future__ import annotations

import json

from scheduler_svc.http_api.tool_calls import HERMES_CLOSE, HERMES_OPEN
from service_common.structured_output import JSON_DEFAULTS


def _call_schema(name: str, parameters: dict | None, arguments_key: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, arguments_key: parameters or {"type": "object"}},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def forced_call_grammar(parser: str, functions: list[tuple[str, dict | None]], allow_several: bool) -> str:
    """A Lark grammar whose every sentence is a call to one of `functions` ((name,
    parameter schema) pairs), or with `allow_several` one or more calls."""
    if not functions:
        raise ValueError("a forced tool call needs at least one function")
    if parser == "hermes":
        arguments_key, separator = "arguments", '"\\n"'
    elif parser == "llama3":
        arguments_key, separator = "parameters", '"; "'
    else:
        raise ValueError(f"no grammar for tool-call syntax {parser!r}")
    schemas = [_call_schema(name, parameters, arguments_key) for name, parameters in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # The same bounded whitespace as json_schema output: `%json` alone allows any run of it,
    # and a model can loop on newlines inside the call until max_tokens.
    schema = {**schema, "x-guidance": JSON_DEFAULTS}
    repeat = f"({separator} call)*" if allow_several else ""
    if parser == "hermes":
        call = f'call: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"'
    else:
        call = "call: body"
    return f"start: call {repeat}\n{call}\nbody: %json {json.dumps(schema)}\n"
