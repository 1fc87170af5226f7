"""HTTP errors in each API's own shape, and the gRPC status → HTTP status mapping.

OpenAI: `{"error": {"message", "type", "param", "code"}}`.
Anthropic: `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import grpc

# HTTP status → (OpenAI error type, Anthropic error type)
_ERROR_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    409: ("conflict_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("service_unavailable", "overloaded_error"),
    504: ("timeout_error", "api_error"),
}

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class ApiError(Exception):
    """Ends a request with an HTTP error; `param` names the bad field where there is one."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str, param: str | None = None) -> ApiError:
        return cls(_HTTP_STATUS.get(code, 500), message, param)

    def openai_body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, _ERROR_TYPES[500])[0]
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}

    def anthropic_body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, _ERROR_TYPES[500])[1]
        message = f"{self.param}: {self.message}" if self.param and self.param not in self.message else self.message
        return {"type": "error", "error": {"type": kind, "message": message}}


def bad_field(param: str, message: str) -> ApiError:
    """A 400 naming the field; the message starts with it."""
    return ApiError(400, f"{param}: {message}", param)
