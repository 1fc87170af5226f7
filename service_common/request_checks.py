"""The checks of a new request's contents that both services make, in one wording.

The scheduler makes them at intake, so a client hears what is wrong before its request is
queued; the executor makes them again before a plan changes anything (a plan is not trusted
blindly, and a bad one must not take the engine down). Same checks, same messages: a
refusal reads the same whichever service made it.

What is not here checks itself where it is built (SamplingParams and StructuredOutput
refuse out-of-range options in their constructors), or needs one service's own knowledge:
the scheduler's size limits (request_limits), the executor's requests in flight, KV
capacity, and compiling a grammar against the model's tokens (both services do that, each
with its own llguidance token table, with the same message).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Protocol

from service_common.errors import InvalidRequestError


class NewRequestContents(Protocol):
    """What a new request carries on both sides: the scheduler's Request and the executor's NewRequest."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # already generated: non-empty only when resubmitted after an executor restart
    max_new_tokens: int
    stop_token_ids: Collection[int]
    retention_s: float


def check_room_to_generate(num_prompt_tokens: int, context_length: int, num_output_tokens: int = 0) -> None:
    """The prompt (and any output it already has) leaves room for at least one new token."""
    if num_prompt_tokens + num_output_tokens >= context_length:
        already = f" (+ {num_output_tokens} already generated)" if num_output_tokens else ""
        raise InvalidRequestError(
            f"the prompt is {num_prompt_tokens} tokens{already}; the model's context is {context_length} tokens, "
            "which leaves no room to generate"
        )


def check_in_vocabulary(what: str, token_ids: Collection[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def check_retention_s(retention_s: float) -> None:
    if not (math.isfinite(retention_s) and retention_s >= 0):
        raise InvalidRequestError(f"retention_s must be a finite number >= 0, got {retention_s}")


def check_new_request(request: NewRequestContents, context_length: int, vocab_size: int) -> None:
    """InvalidRequestError naming the first thing wrong with `request` for a model of this
    context and vocabulary. O(tokens): cheap next to anything the request goes on to cost."""
    if not request.prompt_token_ids:
        raise InvalidRequestError("the prompt is empty")
    check_room_to_generate(len(request.prompt_token_ids), context_length, len(request.output_token_ids))
    if request.max_new_tokens <= 0:
        raise InvalidRequestError(f"max_new_tokens must be > 0, got {request.max_new_tokens}")
    if len(request.output_token_ids) >= request.max_new_tokens:
        raise InvalidRequestError(
            f"{len(request.output_token_ids)} tokens already generated, max_new_tokens={request.max_new_tokens}: "
            "nothing is left to generate"
        )
    check_in_vocabulary("the prompt's token ids", request.prompt_token_ids, vocab_size)
    check_in_vocabulary("output_token_ids", request.output_token_ids, vocab_size)
    check_in_vocabulary("stop_token_ids", request.stop_token_ids, vocab_size)
    check_retention_s(request.retention_s)
