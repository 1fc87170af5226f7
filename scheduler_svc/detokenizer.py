"""Incremental detokenization: text deltas that never split a UTF-8 character.

Decoding one token at a time is wrong twice over: a byte-level token may hold
half of a multi-byte character, and sentencepiece vocabularies decide a token's
leading space from its neighbour. So each step decodes a short window that
starts a few tokens back (`prefix_offset`) and emits only what the new tokens
added beyond the text already emitted for that window (`read_offset`). Text
that ends in U+FFFD (an incomplete character) is held back until the next token
completes it, or until `flush` at the end of the request.

The window stays short whatever the tokens, so each push costs O(1) decodes of a
few tokens and a request's detokenization is linear in its length:
- tokens that decode to nothing (skipped special tokens) are stepped over, not
  held: held, each would widen the window, and the cost would grow with the
  square of the output length;
- an incomplete UTF-8 character has at most 3 bytes, hence spans at most 3
  tokens: when more are held behind a U+FFFD, the text before the last few is
  settled (invalid bytes, not a character still arriving) and is emitted.

Concatenating every delta gives exactly `decode(output_token_ids)`.
"""

from __future__ import annotations

from tokenizers import Tokenizer

PROMPT_WINDOW = 5  # prompt tokens kept as left context for the first output tokens
MAX_INCOMPLETE_TOKENS = 3  # an incomplete UTF-8 character: at most 3 bytes, so at most 3 tokens
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
        if new_text.endswith(REPLACEMENT_CHAR):
            return self._emit_settled(prefix_text, new_text)
        if new_text == prefix_text:
            # The new tokens decode to nothing: step over them, keeping a few tokens of left context.
            self._read_offset = len(self._token_ids)
            self._prefix_offset = max(self._prefix_offset, self._read_offset - PROMPT_WINDOW)
            self._forget_read_tokens()
            return ""
        if len(new_text) < len(prefix_text):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._forget_read_tokens()
        return new_text[len(prefix_text) :]

    def _emit_settled(self, prefix_text: str, new_text: str) -> str:
        """The text ends in U+FFFD. Hold it while it may be a character still arriving;
        with more tokens held than any character spans, emit up to the last cut whose
        text is a prefix of the whole (a cut inside a character is not)."""
        end = len(self._token_ids)
        for cut in range(end - MAX_INCOMPLETE_TOKENS, self._read_offset, -1):
            cut_text = self._decode(self._token_ids[self._prefix_offset : cut])
            if new_text.startswith(cut_text) and cut_text.startswith(prefix_text):
                self._prefix_offset, self._read_offset = self._read_offset, cut
                self._forget_read_tokens()
                return cut_text[len(prefix_text) :]
        return ""

    def _forget_read_tokens(self) -> None:
        """Drop tokens left of the window: memory stays bounded too."""
        if self._prefix_offset > 0:
            del self._token_ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def flush(self) -> str:
        """At the end of a request: whatever is held back, incomplete characters included."""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]
