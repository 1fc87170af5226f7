"""Incremental detokenization: text deltas that never split a UTF-8 character.

Decoding one token at a time is wrong twice over: a byte-level token may hold
half of a multi-byte character, and sentencepiece vocabularies decide a token's
leading space from its neighbour. So each step decodes a short window that
starts a few tokens back (`prefix_offset`) and emits only what the new tokens
added beyond the text already emitted for that window (`read_offset`). Text
that ends in U+FFFD (an incomplete character) is held back until the next token
completes it, or until `flush` at the end of the request.

Concatenating every delta gives exactly `decode(output_token_ids)`.
"""

from __future__ import annotations

from tokenizers import Tokenizer

PROMPT_WINDOW = 5  # prompt tokens kept as left context for the first output tokens
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids = list(prompt_token_ids[-PROMPT_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Add new output tokens; returns the text they complete (possibly empty)."""
        self._token_ids.extend(token_ids)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a request: whatever is held back, incomplete characters included."""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]
