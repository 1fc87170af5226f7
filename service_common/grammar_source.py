"""A structured_output spec as llguidance grammar source: one mapping for both services
(the scheduler compiles it to refuse bad grammars at intake, the executor to mask logits)."""

from __future__ import annotations

import json

import llguidance

from service_common.errors import InvalidRequestError

GRAMMAR_KINDS = ("json_schema", "json_object", "lark", "regex")
# JSON output may put whitespace between tokens, but a bounded run of it: unbounded
# whitespace is where small models get stuck (newline after newline until max_new_tokens).
# A schema with its own "x-guidance" options gets those instead.
JSON_DEFAULTS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}


def grammar_source(kind: str, text: str) -> str:
    """The llguidance grammar (its JSON form) for a spec of `kind` (GRAMMAR_KINDS): `text` is the
    schema (JSON text), Lark grammar or regex, empty for json_object. InvalidRequestError names
    what is wrong with a kind or a schema."""
    if kind not in GRAMMAR_KINDS:
        raise InvalidRequestError(f"structured_output kind must be one of {GRAMMAR_KINDS}, got {kind!r}")
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(text)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    schema = '{"type": "object"}' if kind == "json_object" else text
    try:
        parsed = json.loads(schema)
        if not isinstance(parsed, dict):
            raise ValueError("a JSON schema must be a JSON object")
        defaults = None if "x-guidance" in parsed else JSON_DEFAULTS
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    except ValueError as exc:
        raise InvalidRequestError(f"structured_output.json_schema is not a valid JSON schema: {exc}") from None
