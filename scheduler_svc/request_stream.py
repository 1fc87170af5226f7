"""One client's stream: turns token updates into GenerateResponse messages.

The step loop pushes; the Generate handler pulls from `events`. Text goes through
the incremental detokenizer and the stop-string matcher, so deltas never split a
character and never reach past a stop string.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
from tokenizers import Tokenizer

from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.request import Request
from scheduler_svc.stop_strings import StopStringMatcher
from service_common.finish_reason import FinishReason
from swarmserve.scheduler.v1 import scheduler_pb2 as pb


@dataclass(frozen=True)
class StreamError:
    """Ends the stream with a gRPC status instead of a final message."""

    code: grpc.StatusCode
    message: str


class RequestStream:
    def __init__(
        self, request: Request, tokenizer: Tokenizer, stop_strings: list[str], include_special_tokens: bool
    ) -> None:
        self.request = request
        self.events: asyncio.Queue[pb.GenerateResponse | StreamError] = asyncio.Queue()
        self._detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, not include_special_tokens)
        self._stops = StopStringMatcher(stop_strings)
        self.is_closed = False
        self.finish_reason: FinishReason | None = None  # once finished
        self.error_code: grpc.StatusCode | None = None  # once failed
        self.error_message = ""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def has_stopped(self) -> bool:
        """A stop string matched: the request must end (its text ends before the stop string)."""
        return self._stops.matched is not None

    def push_tokens(self, token_ids: list[int], logprobs: list) -> int:
        """Stream new tokens; returns how many of them are output: all, or once a stop string
        matched (`has_stopped`), those up to the one that completed it. The tokens after it are
        not output, so a request's tokens end at the same token however many a step brought
        (speculation, decode runs)."""
        if self._stops.is_empty:
            text, num_output = self._detokenizer.push(token_ids), len(token_ids)
        else:
            text, num_output = self._feed_until_stop(token_ids)
        self._put(
            pb.GenerateResponse(
                request_id=self.request_id,
                delta=pb.TokenDelta(token_ids=token_ids[:num_output], text=text, logprobs=logprobs[:num_output]),
            )
        )
        return num_output

    def _feed_until_stop(self, token_ids: list[int]) -> tuple[str, int]:
        """(text to stream, tokens fed): token by token, as if each came in a step of its own, until
        a stop string matches."""
        text = []
        for i, token_id in enumerate(token_ids):
            text.append(self._stops.feed(self._detokenizer.push([token_id])))
            if self._stops.matched is not None:
                return "".join(text), i + 1
        return "".join(text), len(token_ids)

    def finish(self, reason: FinishReason) -> None:
        """Send the held-back text (unless a stop string matched) and the final message."""
        if self.is_closed:
            return
        tail = (
            ""
            if reason == FinishReason.STOP_STRING
            else self._stops.feed(self._detokenizer.flush()) + self._stops.flush()
        )
        if self._stops.matched is not None:
            # The held-back tail completed a stop string: the output ends there.
            reason = FinishReason.STOP_STRING
        if tail:
            self._put(pb.GenerateResponse(request_id=self.request_id, delta=pb.TokenDelta(text=tail)))
        r = self.request
        now = time.monotonic()
        usage = pb.Usage(
            prompt_tokens=r.num_prompt_tokens,
            completion_tokens=len(r.output_token_ids),
            cached_tokens=r.num_cached_tokens,
            queue_time_s=(r.first_scheduled_time or now) - r.arrival_time,
            ttft_s=(r.first_token_time - r.arrival_time) if r.first_token_time else 0.0,
            total_time_s=now - r.arrival_time,
            drafted_tokens=r.num_drafted_tokens,
            accepted_tokens=r.num_accepted_tokens,
            num_preemptions=r.num_preemptions,
        )
        final = pb.GenerateFinal(
            finish_reason=FinishReason(reason).to_pb(pb.FinishReason),
            usage=usage,
            stop_string=self._stops.matched or "",
        )
        self._put(pb.GenerateResponse(request_id=self.request_id, final=final))
        self.finish_reason = reason
        self.is_closed = True

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        if not self.is_closed:
            self._put(StreamError(code, message))
            self.error_code, self.error_message = code, message
            self.is_closed = True

    def _put(self, item) -> None:
        self.events.put_nowait(item)
