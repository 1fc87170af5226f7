"""The one exception the client raises for a failed call: the server's status code and message.

gRPC already says precisely what went wrong (INVALID_ARGUMENT for a bad temperature,
RESOURCE_EXHAUSTED for a full queue, UNAVAILABLE when nothing listens), so the client
keeps both and drops the transport details (metadata, debug strings) callers never use.
"""

from __future__ import annotations

import grpc


class SwarmServeError(Exception):
    """A call to the scheduler failed with `code`; `message` is the server's own words."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.aio.AioRpcError) -> SwarmServeError:
        return cls(error.code(), error.details() or "")

    def __str__(self) -> str:
        if not self.message:
            return self.code.name
        return f"{self.code.name}: {self.message}"
