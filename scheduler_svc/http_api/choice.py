"""One completion's output as the HTTP APIs see it: text and tool calls, token ids,
logprobs and the final message, accumulated from the gRPC token deltas.

`items` keeps the text runs and calls in the order they were streamed (each event's
text before its calls, as the streams send them), so a response built after the end
lists them in the order its stream gave them indices.

An output cut by the length limit finishes as `length`, calls or not: with several
calls allowed, a forced output writes calls until max_tokens, and `tool_calls` would
tell the client the model was done when it was cut off.
"""

from __future__ import annotations

from scheduler_svc.http_api.tool_calls import Parsed, ToolCall, ToolCallParser
from swarmserve.scheduler.v1 import scheduler_pb2 as pb


class ChoiceOutput:
    def __init__(self, parser: ToolCallParser | None) -> None:
        self._parser = parser
        self.text = ""
        self.calls: list[ToolCall] = []
        self.token_ids: list[int] = []
        self.logprobs: list[pb.TokenLogprob] = []
        self.final: pb.GenerateFinal | None = None
        self.items: list[str | ToolCall] = []  # text runs and calls, in stream order

    def add(self, event: pb.TokenDelta | pb.GenerateFinal) -> Parsed:
        """Take one event; returns the text and calls it makes ready to stream."""
        if isinstance(event, pb.GenerateFinal):
            self.final = event
            parsed = self._parser.flush() if self._parser is not None else Parsed()
        else:
            self.token_ids.extend(event.token_ids)
            self.logprobs.extend(event.logprobs)
            parsed = self._parser.feed(event.text) if self._parser is not None else Parsed(text=event.text)
        self.text += parsed.text
        self.calls.extend(parsed.calls)
        if parsed.text:
            if self.items and isinstance(self.items[-1], str):
                self.items[-1] += parsed.text
            else:
                self.items.append(parsed.text)
        self.items.extend(parsed.calls)
        return parsed

    @property
    def is_cut(self) -> bool:
        """Ended by the length limit (max_tokens, or the context full)."""
        return self.final is not None and self.final.finish_reason in (
            pb.FINISH_REASON_LENGTH,
            pb.FINISH_REASON_CONTEXT_FULL,
        )

    @property
    def is_finished(self) -> bool:
        return self.final is not None


def openai_finish_reason(output: ChoiceOutput) -> str:
    if output.is_cut:
        return "length"
    return "tool_calls" if output.calls else "stop"
