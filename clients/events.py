"""What a Generate stream yields, as plain frozen dataclasses rather than protobuf messages.

Callers iterate `TokenEvent`s (new token ids and the text they complete) and then
exactly one `FinishEvent`. Converting here keeps protobuf types out of user code and
turns the finish-reason enum into the short names people write (`"eos"`, `"length"`).
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmserve.scheduler.v1 import scheduler_pb2 as pb

_FINISH_REASON_PREFIX = "FINISH_REASON_"


@dataclass(frozen=True)
class Usage:
    """Token counts and server-side timings of one request (seconds since its arrival)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time_s: float = 0.0
    ttft_s: float = 0.0
    total_time_s: float = 0.0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    num_preemptions: int = 0

    @classmethod
    def from_pb(cls, usage: pb.Usage) -> Usage:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            queue_time_s=usage.queue_time_s,
            ttft_s=usage.ttft_s,
            total_time_s=usage.total_time_s,
            drafted_tokens=usage.drafted_tokens,
            accepted_tokens=usage.accepted_tokens,
            num_preemptions=usage.num_preemptions,
        )


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's logprob and, when asked for, the top-n alternatives."""

    token_id: int
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()

    @classmethod
    def from_pb(cls, logprob: pb.TokenLogprob) -> TokenLogprob:
        return cls(
            token_id=logprob.token_id,
            logprob=logprob.logprob,
            top_logprobs=tuple(TopLogprob(t.token_id, t.logprob) for t in logprob.top_logprobs),
        )


@dataclass(frozen=True)
class TokenEvent:
    """New tokens. `text` may lag `token_ids` while a stop string could still be starting,
    and never splits a UTF-8 character, so concatenating every event's text is the output."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class FinishEvent:
    """The last event of a stream. `stop_string`: the stop string that matched, None if none did."""

    finish_reason: str
    usage: Usage
    stop_string: str | None = None


GenerateEvent = TokenEvent | FinishEvent


def finish_reason_name(value: int) -> str:
    """`FINISH_REASON_STOP_STRING` -> `"stop_string"`; a value this client predates -> `"unknown_<n>"`."""
    try:
        name = pb.FinishReason.Name(value)
    except ValueError:
        return f"unknown_{value}"
    return name.removeprefix(_FINISH_REASON_PREFIX).lower()


def event_from_pb(response: pb.GenerateResponse) -> GenerateEvent | None:
    """The event a response carries, or None for an event kind newer than this client."""
    kind = response.WhichOneof("event")
    if kind == "delta":
        delta = response.delta
        return TokenEvent(
            token_ids=tuple(delta.token_ids),
            text=delta.text,
            logprobs=tuple(TokenLogprob.from_pb(lp) for lp in delta.logprobs),
        )
    if kind == "final":
        final = response.final
        return FinishEvent(
            finish_reason=finish_reason_name(final.finish_reason),
            usage=Usage.from_pb(final.usage),
            stop_string=final.stop_string or None,
        )
    return None
