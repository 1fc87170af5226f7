"""Sends the scheduler's API key (`authorization: Bearer <key>`) with every call on a channel."""

from __future__ import annotations

import grpc


def _with_key(details: grpc.aio.ClientCallDetails, metadatum: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(
        details.method,
        details.timeout,
        grpc.aio.Metadata(*(details.metadata or ()), metadatum),
        details.credentials,
        details.wait_for_ready,
    )


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, metadatum: tuple[str, str]) -> None:
        self._metadatum = metadatum

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_key(client_call_details, self._metadatum), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, metadatum: tuple[str, str]) -> None:
        self._metadatum = metadatum

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_key(client_call_details, self._metadatum), request)


def api_key_interceptors(api_key: str) -> list:
    """One interceptor per call shape: grpc.aio files an interceptor under one shape only,
    so a single class serving both would leave streaming calls (Generate) without the key."""
    metadatum = ("authorization", f"Bearer {api_key}")
    return [_UnaryUnary(metadatum), _UnaryStream(metadatum)]
