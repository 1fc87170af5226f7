"""Checking a request's structured_output at intake, against the model's own token table.

The executor compiles the grammar and masks logits with it (executor_svc/sampling/grammar.py).
A grammar it could not compile would fail the whole step plan, so intake compiles it
first, with the same library (llguidance) and the same source (the shared
StructuredOutput): a bad schema, Lark grammar or regex is INVALID_ARGUMENT naming
the problem, and never reaches a plan. The size limit (request_limits) is checked
before this.

The token table is built once per model, at the first request with a grammar (about
a second for a 50k vocabulary; intake runs off the event loop).
"""

from __future__ import annotations

import functools

import llguidance
from tokenizers import Tokenizer

from service_common.errors import InvalidRequestError
from service_common.structured_output import StructuredOutput


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
        """InvalidRequestError (worded as the executor's compile error) when the grammar does not compile."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            spec.to_llguidance(), self.ll_tokenizer
        )
        if is_error:
            raise InvalidRequestError(f"structured_output.{spec.kind} is invalid: {messages[0]}")
