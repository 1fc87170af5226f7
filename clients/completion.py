"""A whole Generate result folded from its events, for callers that do not stream.

The fold is a pure function so the CLI (which streams text as it arrives and still
needs the totals at the end) and `complete()` build results the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from clients.events import FinishEvent, GenerateEvent, TokenEvent, TokenLogprob, Usage


@dataclass(frozen=True)
class Completion:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    usage: Usage
    stop_string: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


def collect_completion(request_id: str, events: Iterable[GenerateEvent]) -> Completion:
    """Concatenate the token events and take the finish event; raises ValueError without one."""
    token_ids: list[int] = []
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    finish: FinishEvent | None = None
    for event in events:
        if isinstance(event, TokenEvent):
            token_ids.extend(event.token_ids)
            texts.append(event.text)
            logprobs.extend(event.logprobs)
        elif isinstance(event, FinishEvent):
            finish = event
    if finish is None:
        raise ValueError("the events hold no FinishEvent: the stream did not finish")
    return Completion(
        request_id=request_id,
        token_ids=tuple(token_ids),
        text="".join(texts),
        finish_reason=finish.finish_reason,
        usage=finish.usage,
        stop_string=finish.stop_string,
        logprobs=tuple(logprobs),
    )
