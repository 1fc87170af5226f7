"""One completion's output as the HTTP APIs see it: text and tool calls, token ids,
logprobs and the final message, accumulated from the gRPC token deltas."""

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
        return parsed

    @property
    def is_finished(self) -> bool:
        return self.final is not None


def openai_finish_reason(output: ChoiceOutput) -> str:
    if output.calls:
        return "tool_calls"
    reason = output.final.finish_reason if output.final is not None else pb.FINISH_REASON_UNSPECIFIED
    if reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_CONTEXT_FULL):
        return "length"
    return "stop"
