"""A request's structured_output, checked at intake and carried to the executor.

The executor compiles the grammar and masks logits with it (executor_svc/grammar.py).
A grammar it could not compile would fail the whole step plan, so intake compiles it
first, with the same library (llguidance) and the model's own token table: a bad
schema, Lark grammar or regex is INVALID_ARGUMENT naming the problem, and never
reaches a plan. The size limit (request_limits) is checked before this.

The token table is built once per model, at the first request with a grammar (about
a second for a 50k vocabulary; intake runs off the event loop).

How a spec becomes an llguidance grammar is written here and in the executor's
grammar.py alike: the scheduler does not import executor code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import llguidance
from swarmserve.executor.v1 import executor_pb2 as epb
from swarmserve.scheduler.v1 import scheduler_pb2 as pb
from tokenizers import Tokenizer

from service_common.errors import InvalidRequestError
from service_common.grammar_source import grammar_source

class InvalidGrammar(ValueError):
    """The structured_output cannot be compiled; the message names the field and the problem."""


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # json_schema | json_object | lark | regex
    text: str = ""  # the schema (JSON text), Lark grammar or regex; empty for json_object

    @classmethod
    def from_pb(cls, msg: pb.StructuredOutput) -> StructuredOutput | None:
        """None when unset; InvalidGrammar for json_object=false (unset it for free output)."""
        kind = msg.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "json_object":
            if not msg.json_object:
                raise InvalidGrammar("structured_output.json_object must be true (leave structured_output unset instead)")
            return cls(kind)
        return cls(kind, getattr(msg, kind))

    def to_pb(self) -> epb.StructuredOutput:
        if self.kind == "json_object":
            return epb.StructuredOutput(json_object=True)
        return epb.StructuredOutput(**{self.kind: self.text})

    def to_llguidance(self) -> str:
        try:
            return grammar_source(self.kind, self.text)
        except InvalidRequestError as exc:
            raise InvalidGrammar(str(exc)) from None


class GrammarChecker:
    """Compiles grammars against the model's token table, to refuse bad ones at intake."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token: str) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None

    @functools.cached_property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        eos = self._eos_token_id
        return llguidance.LLTokenizer(self._tokenizer.to_str(), n_vocab=self._vocab_size, eos_token=eos)

    def check(self, spec: StructuredOutput) -> None:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(spec.to_llguidance(), self.ll_tokenizer)
        if is_error:
            raise InvalidGrammar(f"structured_output.{spec.kind} is invalid: {messages[0]}")
