"""Why a request ended: one enum on both sides of the step protocol, turned into a proto
enum only at the edge.

Both protos spell it `FINISH_REASON_<NAME>`, so `to_pb` / `from_pb` convert by name and a
new reason needs no table. A StrEnum, so logs, span attributes, metric labels and the
timeline carry its value ("eos", "stop_string", ...) as plain text.
"""

from __future__ import annotations

import enum

_PB_PREFIX = "FINISH_REASON_"


class FinishReason(enum.StrEnum):
    EOS = "eos"  # sampled an end-of-sequence token (and ignore_eos is off)
    STOP_TOKEN = "stop_token"  # sampled one of the request's stop token ids
    STOP_STRING = "stop_string"  # the text matched a stop string (the scheduler detokenizes)
    LENGTH = "length"  # produced max_new_tokens
    CONTEXT_FULL = "context_full"  # prompt + output reached the model's context length
    ABORTED = "aborted"  # the client cancelled or went away

    def to_pb(self, pb_enum) -> int:
        """This reason's value in a proto FinishReason enum (e.g. `executor_pb2.FinishReason`)."""
        return pb_enum.Value(_PB_PREFIX + self.name)

    @classmethod
    def from_pb(cls, pb_enum, value: int) -> FinishReason | None:
        """The reason a proto enum value stands for; None for UNSPECIFIED (the request goes on)."""
        name = pb_enum.Name(value).removeprefix(_PB_PREFIX)
        return None if name == "UNSPECIFIED" else cls[name]
