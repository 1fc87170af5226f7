"""A request's structured_output: the grammar its output must match, one type for both services
(the scheduler compiles it to refuse bad grammars at intake, the executor to mask logits)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

from service_common.errors import InvalidRequestError
from swarmserve.common.v1 import sampling_pb2 as pb

GRAMMAR_KINDS = ("json_schema", "json_object", "lark", "regex")
# JSON output may put whitespace between tokens, but a bounded run of it: unbounded
# whitespace is where small models get stuck (newline after newline until max_new_tokens).
# A schema with its own "x-guidance" options gets those instead.
JSON_DEFAULTS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # one of GRAMMAR_KINDS
    text: str = ""  # the schema (JSON text), Lark grammar or regex; empty for json_object

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(f"structured_output kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")

    @classmethod
    def from_pb(cls, msg: pb.StructuredOutput) -> StructuredOutput | None:
        """None when unset; InvalidRequestError for json_object=false (unset it for free output)."""
        kind = msg.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "json_object":
            if not msg.json_object:
                raise InvalidRequestError(
                    "structured_output.json_object must be true (leave structured_output unset instead)"
                )
            return cls(kind)
        return cls(kind, getattr(msg, kind))

    def to_pb(self) -> pb.StructuredOutput:
        if self.kind == "json_object":
            return pb.StructuredOutput(json_object=True)
        return pb.StructuredOutput(**{self.kind: self.text})

    def to_llguidance(self) -> str:
        """The llguidance grammar (its JSON form). InvalidRequestError names what is wrong with a
        schema; a Lark grammar or regex is checked only when compiled against a tokenizer."""
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.text)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        schema = '{"type": "object"}' if self.kind == "json_object" else self.text
        try:
            parsed = json.loads(schema)
            if not isinstance(parsed, dict):
                raise ValueError("a JSON schema must be a JSON object")
            defaults = None if "x-guidance" in parsed else JSON_DEFAULTS
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        except ValueError as exc:
            raise InvalidRequestError(f"structured_output.json_schema is not a valid JSON schema: {exc}") from None
